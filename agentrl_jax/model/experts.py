"""Routing and expert activations of the MoE layer, with the pretrained families' variants.

Legend: N tokens, E experts, K experts per token, F expert hidden dim, D model dim, C capacity.

Routing (``ModelConfig.routing``):
  * ``softmax_topk`` (the project's and Qwen3-MoE's): softmax over all experts in the router
    dtype, clamped to ``[PROB_MIN, 1]``, top-k (ties to the lower index), the k gates
    renormalised to sum to one when ``route_renorm`` (Qwen3-MoE's ``norm_topk_prob``);
  * ``topk_softmax`` (gpt-oss): top-k of the raw logits, softmax over the k selected logits.
Under routing replay the gates are computed from the same logits at the replayed experts, so
the router still gets gradients.

Expert activation (``ModelConfig.expert_act``):
  * ``swiglu``: ``silu(g) * u``;
  * ``clamped_swiglu`` (gpt-oss): ``g' = min(g, limit)``, ``u' = clip(u, -limit, limit)``,
    ``(u' + 1) * g' * sigmoid(alpha * g')``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.config import ModelConfig

PROB_MIN = 1e-6


def route(
    logits: jax.Array,
    k: int,
    replay_routes: jax.Array | None = None,
    *,
    mode: str = "softmax_topk",
    renorm: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router probabilities, top-k experts and their gates.

    Args:
      logits: [..., E] router logits (their dtype is kept).
      k: experts per token.
      replay_routes: optional int [..., k] experts to use instead of the top-k (routing replay).
        Indices must lie in [0, E) or be -1 (not recorded: that entry takes the top-k's);
        indices >= E give NaN gates.
      mode: 'softmax_topk' | 'topk_softmax' (module docstring).
      renorm: with 'softmax_topk', renormalise the k gates to sum to one.

    Returns:
      probs [..., E] softmax clamped to [1e-6, 1] (for the auxiliary losses, in both modes);
      routes int32 [..., k] (descending score, ties to the lower index); gates [..., k].

    Raises:
      ValueError: unknown ``mode``.
    """
    if mode not in ("softmax_topk", "topk_softmax"):
        raise ValueError(f"route mode={mode!r}; allowed: 'softmax_topk', 'topk_softmax'")
    probs = jnp.clip(jax.nn.softmax(logits, axis=-1), PROB_MIN, 1.0)
    scores = probs if mode == "softmax_topk" else logits
    if replay_routes is None:
        top, routes = jax.lax.top_k(scores, k)
    else:  # -1: a token without recorded routes takes the router's own top-k
        routes = jnp.where(replay_routes < 0, jax.lax.top_k(scores, k)[1], replay_routes)
        top = jnp.take_along_axis(scores, routes, axis=-1, mode="fill", fill_value=jnp.nan)
    if mode == "topk_softmax":
        gates = jax.nn.softmax(top, axis=-1)
    elif renorm:
        gates = top / jnp.sum(top, axis=-1, keepdims=True)
    else:
        gates = top
    return probs, routes.astype(jnp.int32), gates


def expert_activation(gate: jax.Array, up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The gated activation of ``cfg.expert_act`` on pre-activations ``gate``, ``up`` [..., F]."""
    if cfg.expert_act == "swiglu":
        return jax.nn.silu(gate) * up
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def moe_reference(params, x, cfg: ModelConfig, *, valid=None, replay_routes=None, keep=None):
    """Dense pure-jnp MoE in float32 (every expert on every token), for tests.

    Args:
      params: the MoE's params dict (unboxed).
      x: [B, T, D]. valid: unused for outputs except that invalid rows get no routed output.
      replay_routes: optional int [B, T, K]. keep: optional bool [B, T, K] mask of kept pairs
        (default: all kept, i.e. dropless).

    Returns:
      y [B, T, D] float32, routes int32 [B, T, K].
    """
    hi = jax.lax.Precision.HIGHEST
    x = x.astype(jnp.float32)
    logits = jnp.einsum("BTD,DE->BTE", x, params["router"].astype(jnp.float32), precision=hi)
    if cfg.router_bias:
        logits = logits + params["router_bias"]
    probs = jnp.clip(jnp.exp(logits - jax.nn.logsumexp(logits, -1, keepdims=True)), PROB_MIN, 1.0)
    k = cfg.experts_per_token
    scores = probs if cfg.routing == "softmax_topk" else logits
    routes = (
        jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
        if replay_routes is None
        else replay_routes
    )
    top = jnp.take_along_axis(scores, routes, axis=-1)
    if cfg.routing == "topk_softmax":
        top = jnp.exp(top - jnp.max(top, -1, keepdims=True))
        gates = top / jnp.sum(top, -1, keepdims=True)
    else:
        gates = top / jnp.sum(top, -1, keepdims=True) if cfg.route_renorm else top
    if keep is not None:
        gates = gates * keep
    if valid is not None:
        gates = gates * valid[..., None]
    y = jnp.zeros_like(x)
    for ex in range(cfg.n_experts):
        g = jnp.einsum("BTD,DF->BTF", x, params["w_gate"][ex], precision=hi)
        u = jnp.einsum("BTD,DF->BTF", x, params["w_up"][ex], precision=hi)
        if cfg.expert_bias:
            g, u = g + params["b_gate"][ex], u + params["b_up"][ex]
        h = expert_activation(g, u, cfg)
        o = jnp.einsum("BTF,FD->BTD", h, params["w_down"][ex], precision=hi)
        if cfg.expert_bias:
            o = o + params["b_down"][ex]
        y = y + jnp.sum(gates * (routes == ex), -1)[..., None] * o
    if cfg.n_shared_experts:
        g = jnp.einsum("BTD,DF->BTF", x, params["shared_gate"], precision=hi)
        u = jnp.einsum("BTD,DF->BTF", x, params["shared_up"], precision=hi)
        y = y + jnp.einsum("BTF,FD->BTD", jax.nn.silu(g) * u, params["shared_down"], precision=hi)
    return y, routes.astype(jnp.int32)


def mlp_reference(params, x):
    """Dense SwiGLU in float32 for tests: ``(silu(x Wg) * x Wu) Wd``."""
    hi = jax.lax.Precision.HIGHEST
    x = x.astype(jnp.float32)
    g = jnp.einsum("BTD,DF->BTF", x, params["w_gate"], precision=hi)
    u = jnp.einsum("BTD,DF->BTF", x, params["w_up"], precision=hi)
    return jnp.einsum("BTF,FD->BTD", jax.nn.silu(g) * u, params["w_down"], precision=hi)


def clamped_swiglu_reference(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float):
    """float64 numpy clamped SwiGLU, written from its definition (for tests)."""
    g = np.minimum(np.asarray(gate, np.float64), limit)
    u = np.clip(np.asarray(up, np.float64), -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
