"""Feed-forward layers: dense SwiGLU ``MLP`` and the routed mixture of experts ``MoE``.

Einsum legend:
  B batch, T time, D model dim, F hidden (expert / mlp) dim, E experts, C expert capacity,
  N tokens (B*T), K experts per token.

Routing: router logits ``x @ W_r`` (+ an optional bias) in ``policy.router`` dtype (fp32 by
default, HIGHEST matmul precision so no TF32 on GPUs), softmax, probabilities clamped to
``[1e-6, 1]``, top-k (ties go to the lower expert index, ``lax.top_k``), the k gates
renormalised to sum to one; ``model.experts`` has the families' variants (top-k of the logits
then a softmax over the k; no renormalisation) and their expert activations and biases.
Routing replay (``replay_routes``) forces the experts; the gates are then the router
probabilities gathered at the replayed experts and renormalised, so the router still gets
gradients through them.

Dispatch computes only routed (token, expert) pairs: the N*K pairs are ordered slot-major (every
token's first choice before any second choice, then token order), stably sorted by expert, and
a pair's position inside its expert decides whether it fits the capacity
``C = cfg.capacity(tokens per shard)`` (``capacity_factor == 0``: dropless, ``C`` = tokens per
shard). Kept pairs are gathered into ``[E, C, D]`` buffers, the experts run a SwiGLU over their
``C`` rows (batched matmuls over E; on the CPU backend bf16 ones are one 2-D matmul per expert,
``expert_matmul``), and the outputs are gathered back and summed with the gates. Dropped pairs
and padding rows (``valid == False``) contribute zero routed output and take no capacity.

Under a mesh (the module's ``mesh`` attribute, or else the ambient one: ``jax.set_mesh`` /
``agentrl_jax.sharding.activate``) whose batch axes ``data, fsdp, expert`` or ``expert`` axis
have size > 1, the dispatch runs per token shard inside ``jax.shard_map``: tokens are split over
those batch axes, the expert hidden dim over ``tensor`` (partial down projections are summed
with ``psum``). With ``expert`` > 1 (expert parallelism) the experts are split over it and
``all_to_all`` over ``expert`` sends each expert its ``[C, D]`` rows from every shard and brings
the outputs back; otherwise each shard runs every expert on its own tokens. (A dispatch over
the global token array instead sorts and gathers every token on every device: a data-parallel
update ran 12x slower.) Capacity is per token shard, so with a finite capacity factor which
pairs drop depends on the shard count; dropless results equal the one-device results up to
float rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from agentrl_jax.model import expert_matmul
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.experts import (  # noqa: F401 - route and the references re-exported
    PROB_MIN,
    expert_activation,
    mlp_reference,
    moe_reference,
    route,
)
from agentrl_jax.model.layers import PACKED, DecodeForm, PackedExperts, weight_product
from agentrl_jax.precision import DTypePolicy

TOKEN_AXES = ("data", "fsdp", "expert")  # mesh axes tokens are split over inside the dispatch
_HIGHEST = jax.lax.Precision.HIGHEST
# a first try at this many times the mean rows per expert (``small_capacity``)
CAPACITY_SLACK = 2.0
CAPACITY_ROUND = 4


def _init(std: float, names: tuple):
    return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), names)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward ``D -> cfg.d_ff -> D`` (used when ``cfg.n_experts == 0``).

    ``__call__(x [B, T, D] compute dtype) -> [B, T, D]`` compute dtype. Under a
    ``form.fused_mlp`` form (``decode_params.fuse_projections``) the parameters hold
    ``w_gate_up`` [D, 2F] in place of ``w_gate`` and ``w_up``: the two projections are one
    matmul; ``form.matmul`` says how the weight matmuls run (``layers.weight_product``).
    """

    cfg: ModelConfig
    policy: DTypePolicy
    form: DecodeForm = DecodeForm()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, pol = self.cfg, self.policy
        if x.ndim != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(f"MLP input x.shape={x.shape} must be [B, T, d_model={cfg.d_model}]")
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        f = cfg.d_ff
        form = self.form
        if form.fused_mlp:
            names, shape = ("embed", "mlp"), (cfg.d_model, 2 * f)
            w = self.param("w_gate_up", _init(cfg.init_std, names), shape, pol.param)
            gu = weight_product(self, "w_gate_up", "BTD,DF->BTF", x, w, pol, form)
            gate, up = gu[..., :f], gu[..., f:]
        else:
            w_gate = self.param(
                "w_gate", _init(cfg.init_std, ("embed", "mlp")), (cfg.d_model, f), pol.param
            )
            w_up = self.param(
                "w_up", _init(cfg.init_std, ("embed", "mlp")), (cfg.d_model, f), pol.param
            )
            gate = weight_product(self, "w_gate", "BTD,DF->BTF", x, w_gate, pol, form)
            up = weight_product(self, "w_up", "BTD,DF->BTF", x, w_up, pol, form)
        w_down = self.param("w_down", _init(std_out, ("mlp", "embed")), (f, cfg.d_model), pol.param)
        h = nn.silu(gate) * up
        return weight_product(self, "w_down", "BTF,FD->BTD", h, w_down, pol, form)


def load_balance_loss(
    probs: jax.Array, routes: jax.Array, valid: jax.Array, n_experts: int
) -> jax.Array:
    """Switch-style balance loss ``E * sum_e f_e * P_e`` over valid tokens (1.0 when uniform).

    Args:
      probs: [N, E] router probabilities.
      routes: int [N, K] chosen experts; ``f_e`` is the share of valid (token, slot) pairs
        sent to expert e.
      valid: bool [N].
      n_experts: E.

    Returns:
      scalar float32; gradients flow through ``P_e`` (mean router probability) only.
    """
    m = valid.astype(jnp.float32)
    n_valid = jnp.maximum(jnp.sum(m), 1.0)
    k = routes.shape[-1]
    counts = (
        jnp.zeros((n_experts,), jnp.float32)
        .at[routes]
        .add(jnp.broadcast_to(m[:, None], routes.shape))
    )
    frac = counts / (n_valid * k)
    mean_prob = jnp.sum(probs.astype(jnp.float32) * m[:, None], axis=0) / n_valid
    return n_experts * jnp.sum(frac * mean_prob)


def _expert_ffn(buf, w_gate, w_up, w_down, policy, tensor_axis, cfg, biases=()):
    """Gated FFN per expert on ``buf [E, C, D]``; partial sums over a split F are psum-ed.

    ``biases``: () or ``(b_gate [E, F], b_up [E, F], b_down [E, D])`` (b_down added once,
    after the psum).
    """
    g = expert_matmul.expert_einsum(policy, "ECD,EDF->ECF", buf, w_gate)
    u = expert_matmul.expert_einsum(policy, "ECD,EDF->ECF", buf, w_up)
    if biases:
        g = g + biases[0][:, None, :].astype(g.dtype)
        u = u + biases[1][:, None, :].astype(u.dtype)
    h = expert_activation(g, u, cfg)
    out = expert_matmul.expert_einsum(policy, "ECF,EFD->ECD", h, w_down)
    if tensor_axis is not None:
        out = jax.lax.psum(out.astype(policy.accum), tensor_axis).astype(policy.compute)
    if biases:
        out = out + biases[2][:, None, :].astype(out.dtype)
    return out


def small_capacity(n: int, k: int, n_experts: int, capacity: int) -> int | None:
    """The smaller capacity tried first when ``capacity`` is larger than a balanced load needs.

    ``CAPACITY_SLACK`` x the mean rows per expert (``n * k / n_experts``), rounded up to a
    multiple of ``CAPACITY_ROUND``; None when that is not below ``capacity`` (e.g. dropless with
    ``n_experts <= CAPACITY_SLACK * k``, or a tight ``capacity_factor``).
    """
    r = CAPACITY_ROUND
    small = -(-math.ceil(CAPACITY_SLACK * n * k / n_experts) // r) * r
    return small if small < capacity else None


def dispatch_combine(
    x,
    routes,
    gates,
    valid,
    w_gate,
    w_up,
    w_down,
    *biases,
    capacity,
    policy,
    cfg,
    expert_axis=None,
    tensor_axis=None,
    small_first=False,
):
    """Routed expert outputs for one token shard (called directly or inside ``shard_map``).

    With ``small_first``, on one shard (``expert_axis`` None) under a non-parity policy, when
    the most rows any expert gets fit :func:`small_capacity`, the experts run at that capacity
    instead (a ``lax.cond``): the same pairs are kept, the expert matmuls have fewer rows (dropless:
    capacity is every token, ``n_experts / k`` times the routed pairs). Rounding can differ
    from the full-capacity branch (XLA picks matmul kernels by row count), so parity policies,
    whose rollout and trainer passes must pick identical kernels, always run ``capacity``.

    Args:
      x: [N, D] tokens (compute dtype). routes: int [N, K]. gates: [N, K]. valid: bool [N].
      w_gate, w_up: [E_local, D, F_local]; w_down: [E_local, F_local, D].
      capacity: C, rows per expert from this shard.
      policy: dtype policy.
      cfg: model config (the expert activation).
      expert_axis: mesh axis experts are split over (None: all experts local).
      tensor_axis: mesh axis F is split over (None: F local).
      small_first: try :func:`small_capacity` first (see above).

    Returns:
      y [N, D] compute dtype (sum over kept pairs of gate * expert output), keep bool [N, K].
    """
    n, d = x.shape
    k = routes.shape[1]
    n_shards = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    n_exp = w_gate.shape[0] * n_shards
    # Pairs in slot-major order; padding rows get the sentinel expert n_exp (sorted last).
    expert = jnp.where(valid[None, :], routes.T, n_exp).reshape(-1)  # [K*N]
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=n_exp + 1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(k * n, dtype=order.dtype))
    pos = rank - starts[expert]
    weights = (w_gate, w_up, w_down, *biases)

    def run(cap):
        return _at_capacity(
            x, expert, pos, gates, weights, cap, n_exp, policy, cfg, expert_axis, tensor_axis
        )

    small = small_capacity(n, k, n_exp, capacity)
    if not small_first or small is None or expert_axis is not None or policy.parity:
        return run(capacity)
    fits = jnp.max(counts[:n_exp]) <= small
    return jax.lax.cond(fits, lambda: run(small), lambda: run(capacity))


def _at_capacity(x, expert, pos, gates, weights, cap, n_exp, policy, cfg, expert_axis, tensor_axis):
    """``dispatch_combine`` at capacity ``cap``: pairs with ``pos < cap`` are kept, gathered
    into ``[E, cap, D]``, run through their expert and combined with the gates."""
    n, d = x.shape
    k = gates.shape[1]
    keep = (expert < n_exp) & (pos < cap)
    slot = jnp.where(keep, expert * cap + pos, n_exp * cap)  # n_exp*cap: "nowhere"
    token = jnp.tile(jnp.arange(n), k)
    src = jnp.full((n_exp * cap,), n).at[slot].set(token, mode="drop")  # n: the zero row
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)], axis=0)
    buf = x_pad[src].reshape(n_exp, cap, d)
    if expert_axis is not None:  # [E, C, D] -> [E_local, shards*C, D]
        buf = jax.lax.all_to_all(buf, expert_axis, 0, 1, tiled=True)
    w_gate, w_up, w_down, *biases = weights
    out = _expert_ffn(buf, w_gate, w_up, w_down, policy, tensor_axis, cfg, tuple(biases))
    if expert_axis is not None:  # back to [E, C, D] for this shard's tokens
        out = jax.lax.all_to_all(out, expert_axis, 1, 0, tiled=True)
    out = jnp.concatenate([out.reshape(n_exp * cap, d), jnp.zeros((1, d), out.dtype)], axis=0)
    pair_out = out[slot].astype(policy.accum)  # [K*N, D]; dropped pairs read the zero row
    w = jnp.where(keep, gates.T.reshape(-1), 0).astype(policy.accum)
    pairs = (pair_out * w[:, None]).reshape(k, n, d)
    # The k slots summed by adds: XLA's CPU backend turns a sum over the leading axis into a
    # reduction with the gather above fused into it, ~25x slower (docs/results.md).
    y = functools.reduce(jnp.add, [pairs[i] for i in range(k)])
    return y.astype(policy.compute), keep.reshape(k, n).T


def _ambient_mesh():
    """The mesh set by ``jax.set_mesh`` or, failing that, a legacy ``with mesh:`` block."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh
    try:  # ``with mesh:`` (agentrl_jax.sharding.activate on jax 0.10) only sets this
        from jax._src import mesh as mesh_lib

        legacy = mesh_lib.thread_resources.env.physical_mesh
    except (ImportError, AttributeError):
        return None
    return None if legacy.empty else legacy


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus optional always-on shared experts.

    Attributes:
      cfg: model config (``n_experts > 0``).
      policy: dtype policy.
      mesh: mesh for expert parallelism; None uses the ambient mesh (if any). Experts are
        dispatched with ``shard_map``/``all_to_all`` when its ``expert`` axis is > 1.
      small_first: try :func:`small_capacity` first (``dispatch_combine``); the transformer
        sets it on its cached (rollout) path only: under autodiff the ``lax.cond`` keeps both
        branches' residuals, and under ``vmap`` it runs both branches.
      form: the parameters' layout (``layers.DecodeForm``): under a packed one the experts
        multiply their packed copies (``<name>_packed``), off a mesh.
    """

    cfg: ModelConfig
    policy: DTypePolicy
    mesh: jax.sharding.Mesh | None = None
    small_first: bool = False
    form: DecodeForm = DecodeForm()

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        *,
        valid: jax.Array | None = None,
        replay_routes: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """Applies the layer.

        Args:
          x: [B, T, D] compute dtype.
          valid: optional bool [B, T]; False rows (padding) take no capacity, get no routed
            output and are left out of the auxiliary losses.
          replay_routes: optional int [B, T, K] experts to use (routing replay). Entries must
            lie in [0, E) on valid rows (out of range gives NaN gates); padding rows are ignored.

        Returns:
          y [B, T, D] compute dtype; routes int32 [B, T, K]; aux dict of float32 scalars
          ``load_balance_loss``, ``z_loss``, ``aux_loss`` (weighted sum) and
          ``dropped_fraction`` (share of valid pairs over capacity).

        Raises:
          ValueError: ``cfg.n_experts == 0``, or a shape that does not match the config / mesh.
        """
        cfg, pol = self.cfg, self.policy
        e, k, dm = cfg.n_experts, cfg.experts_per_token, cfg.d_model
        if e == 0:
            raise ValueError("MoE needs ModelConfig.n_experts >= 1 (use MLP when it is 0)")
        if x.ndim != 3 or x.shape[-1] != dm:
            raise ValueError(f"MoE input x.shape={x.shape} must be [B, T, d_model={dm}]")
        b, t, _ = x.shape
        if valid is not None and valid.shape != (b, t):
            raise ValueError(f"MoE valid.shape={valid.shape} must be {(b, t)}")
        if replay_routes is not None and replay_routes.shape != (b, t, k):
            raise ValueError(f"MoE replay_routes.shape={replay_routes.shape} must be {(b, t, k)}")
        mesh, token_axes, n_shards, tp, ep = self._layout(b * t)
        w_router, w_gate, w_up, w_down, biases = self._expert_params()
        n = b * t
        xf = x.reshape(n, dm)
        vf = jnp.ones((n,), bool) if valid is None else valid.reshape(n).astype(bool)
        logits = jnp.einsum(
            "ND,DE->NE",
            xf.astype(pol.router),
            w_router.astype(pol.router),
            precision=_HIGHEST,
            preferred_element_type=pol.router,
        )
        if cfg.router_bias:
            r_bias = self.param("router_bias", _init(cfg.init_std, (None,)), (e,), pol.param)
            logits = logits + r_bias.astype(pol.router)
        replay = None
        if replay_routes is not None:  # padding rows may hold anything: the router routes them
            replay = jnp.where(vf[:, None], replay_routes.reshape(n, k), -1)
        probs, routes, gates = route(logits, k, replay, mode=cfg.routing, renorm=cfg.route_renorm)
        weights = (w_gate, w_up, w_down, *biases)
        if mesh is not None:
            cap = cfg.capacity(n // n_shards)
            tok, ex = P(token_axes), P(token_axes, None)
            fax = "tensor" if tp else None
            eax = "expert" if ep else None
            fn = jax.shard_map(
                lambda *a: dispatch_combine(
                    *a,
                    capacity=cap,
                    policy=pol,
                    cfg=cfg,
                    expert_axis=eax,
                    tensor_axis=fax,
                    small_first=self.small_first,
                ),
                mesh=mesh,
                in_specs=(
                    ex,
                    ex,
                    ex,
                    tok,
                    P(eax, None, fax),
                    P(eax, None, fax),
                    P(eax, fax, None),
                    *((P(eax, fax), P(eax, fax), P(eax, None)) if biases else ()),
                ),
                out_specs=(ex, ex),
            )
            y, keep = fn(xf.astype(pol.compute), routes, gates, vf, *weights)
        else:
            if self.form.packed:  # ``decode_params.pack_weights``
                impl = self.form.matmul
                packed = {n: self.get_variable("params", n + PACKED) for n in ("w_gate", "w_up",
                                                                             "w_down")}  # fmt: skip
                weights = (PackedExperts(packed["w_gate"], cfg.d_expert, impl),
                           PackedExperts(packed["w_up"], cfg.d_expert, impl),
                           PackedExperts(packed["w_down"], dm, impl), *biases)  # fmt: skip
            y, keep = dispatch_combine(
                xf.astype(pol.compute), routes, gates, vf, *weights,
                capacity=cfg.capacity(n), policy=pol, cfg=cfg, small_first=self.small_first,
            )  # fmt: skip
        y = self._shared_experts(x, y.reshape(b, t, dm))
        aux = self._aux(probs, routes, logits, keep, vf)
        if replay_routes is not None:  # hand back exactly what was replayed, padding included
            return y, replay_routes.astype(jnp.int32), aux
        return y, routes.reshape(b, t, k), aux

    def _layout(self, n_tokens: int):
        """``(mesh or None, token axes, token shards, tensor-parallel experts, expert-parallel)``
        of the dispatch: a mesh whose token axes (``TOKEN_AXES``) or ``expert`` axis has size
        > 1 dispatches per token shard inside ``shard_map`` (a dispatch over the global token
        array would sort and gather every token on every device); None on one device, or when
        the tokens do not split evenly over the token axes and the experts are not split.

        Raises ValueError when the experts, tokens or expert width do not divide an
        expert-parallel mesh.
        """
        cfg = self.cfg
        mesh = self.mesh if self.mesh is not None else _ambient_mesh()
        sizes = dict(mesh.shape) if mesh is not None else {}
        token_axes = tuple(a for a in TOKEN_AXES if sizes.get(a, 1) > 1)
        n_token_shards = int(np.prod([sizes[a] for a in token_axes]))
        ep = sizes.get("expert", 1) > 1
        if not ep and (n_token_shards == 1 or n_tokens % n_token_shards):
            return None, (), 1, False, False
        if ep and cfg.n_experts % sizes["expert"]:
            raise ValueError(
                f"ModelConfig.n_experts={cfg.n_experts} must be a multiple of mesh "
                f"expert={sizes['expert']}"
            )
        if n_tokens % n_token_shards:
            raise ValueError(
                f"MoE tokens B*T={n_tokens} must be a multiple of {n_token_shards} "
                f"(mesh {token_axes})"
            )
        tp = sizes.get("tensor", 1) > 1
        if tp and cfg.d_expert % sizes["tensor"]:
            raise ValueError(
                f"ModelConfig.d_expert={cfg.d_expert} must be a multiple of mesh "
                f"tensor={sizes['tensor']}"
            )
        return mesh, token_axes, n_token_shards, tp, ep

    def _expert_params(self):
        """Router ``[D, E]``, expert weights ``[E, D, F]`` x2 / ``[E, F, D]`` and the expert
        biases (``()`` or ``[E, F]`` x2, ``[E, D]``)."""
        cfg, pol = self.cfg, self.policy
        e, dm, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        w_router = self.param("router", _init(cfg.init_std, ("embed", None)), (dm, e), pol.param)
        w_gate = self.param(
            "w_gate", _init(cfg.init_std, ("expert", "embed", "expert_mlp")), (e, dm, f), pol.param
        )
        w_up = self.param(
            "w_up", _init(cfg.init_std, ("expert", "embed", "expert_mlp")), (e, dm, f), pol.param
        )
        w_down = self.param(
            "w_down", _init(std_out, ("expert", "expert_mlp", "embed")), (e, f, dm), pol.param
        )
        biases = ()
        if cfg.expert_bias:
            zeros = nn.initializers.zeros_init()
            biases = tuple(
                self.param(name, nn.with_logical_partitioning(zeros, axes), shape, pol.param)
                for name, axes, shape in (
                    ("b_gate", ("expert", "expert_mlp"), (e, f)),
                    ("b_up", ("expert", "expert_mlp"), (e, f)),
                    ("b_down", ("expert", "embed"), (e, dm)),
                )
            )
        return w_router, w_gate, w_up, w_down, biases

    def _shared_experts(self, x, y):
        """``y`` plus the always-on shared experts' SwiGLU of ``x`` (both [B, T, D])."""
        cfg, pol = self.cfg, self.policy
        if not cfg.n_shared_experts:
            return y
        dm, fs = cfg.d_model, cfg.n_shared_experts * cfg.d_expert
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        s_gate = self.param(
            "shared_gate", _init(cfg.init_std, ("embed", "mlp")), (dm, fs), pol.param
        )
        s_up = self.param("shared_up", _init(cfg.init_std, ("embed", "mlp")), (dm, fs), pol.param)
        s_down = self.param("shared_down", _init(std_out, ("mlp", "embed")), (fs, dm), pol.param)
        xc = x.astype(pol.compute)
        h = nn.silu(pol.einsum("BTD,DF->BTF", xc, s_gate)) * pol.einsum("BTD,DF->BTF", xc, s_up)
        out = y.astype(pol.accum) + pol.einsum("BTF,FD->BTD", h, s_down).astype(pol.accum)
        return out.astype(pol.compute)

    def _aux(self, probs, routes, logits, keep, vf):
        """Load-balance and z losses (over valid tokens), their weighted sum, dropped share."""
        cfg = self.cfg
        m = vf.astype(jnp.float32)
        n_valid = jnp.maximum(jnp.sum(m), 1.0)
        lb = load_balance_loss(probs, routes, vf, cfg.n_experts)
        z = jnp.sum(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2 * m) / n_valid
        dropped = jnp.sum((1.0 - keep.astype(jnp.float32)) * m[:, None]) / (
            n_valid * cfg.experts_per_token
        )
        return {
            "load_balance_loss": lb,
            "z_loss": z,
            "aux_loss": cfg.router_aux_weight * lb + cfg.router_z_weight * z,
            "dropped_fraction": dropped,
        }
