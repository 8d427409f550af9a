"""Attention mass for attention-based credit (``advantage='attn_credit'``).

From one teacher-forced pass, the attention probabilities of the final turn's action tokens
(the queries) over every earlier token (the keys), averaged over queries, heads and layers:

  p^l_{b,n}(i, j) = softmax_j (q^l_{b,i,n} . k^l_{b,j,g(n)} / sqrt(H))   over allowed keys j
  mass[b, j]      = mean_{l, n} mean_{i in Q_b} p^l_{b,n}(i, j)          (0 if Q_b is empty)

with Q_b the action tokens of episode b's last turn and g(n) the KV head of query head n
(grouped-query attention). Allowed keys: valid tokens j <= i, and for sliding-window ("S")
layers i - j < window. Sparse ("F") layers are scored over all causal keys (their block
selection is not replayed), so the mass reads what those layers could attend to. The final
turn's own tokens then get mass 0 (``attn_credit`` credits only earlier turns by attention and
gives the final turn its uniform share). Before that, ``mass`` sums to 1 over j for each
episode with queries.

The q and k come from the model's own projections (``Attention`` sows them when the
``intermediates`` collection is mutable), so they match the training forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import traverse_util

from agentrl_jax.model.transformer import Transformer


def _last_turn(action_mask: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """int [B, 1]: each episode's last turn with action tokens (-1 if none)."""
    return jnp.max(jnp.where(action_mask, turn_ids, -1), axis=1, keepdims=True)


def final_turn_queries(action_mask: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """bool [B, T]: action tokens of each episode's last turn that has action tokens."""
    last = _last_turn(action_mask, turn_ids)
    return action_mask & (turn_ids == last) & (last >= 0)


def layer_mass(
    q: jax.Array,
    k: jax.Array,
    queries: jax.Array,
    valid: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """Mean attention probability [B, T] the ``queries`` rows put on each key, one layer.

    q [B, T, N, H], k [B, T, K, H] (N a multiple of K), queries / valid bool [B, T]; heads and
    query rows averaged; a row with no allowed key contributes nothing.
    """
    b, t, n, h = q.shape
    kq = jnp.repeat(k, n // k.shape[2], axis=2)
    logits = jnp.einsum(
        "bink,bjnk->bnij", q.astype(jnp.float32), kq.astype(jnp.float32)
    ) / jnp.sqrt(jnp.float32(h))
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    allowed = (j <= i)[None, None] & valid[:, None, None, :]
    if window is not None:
        allowed &= (i - j < window)[None, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
    has_key = jnp.any(allowed, axis=-1, keepdims=True)
    probs = jnp.where(has_key, jax.nn.softmax(jnp.where(has_key, logits, 0.0), axis=-1), 0.0)
    w = queries.astype(jnp.float32)
    per_query = jnp.einsum("bnij,bi->bj", probs, w) / n
    return per_query / jnp.maximum(w.sum(axis=1, keepdims=True), 1.0)


def attention_credit_mass(
    model: Transformer,
    params,
    tokens: jax.Array,
    valid: jax.Array,
    action_mask: jax.Array,
    turn_ids: jax.Array,
) -> jax.Array:
    """f32 [B, T] attention mass of the final turn's action tokens (module docstring)."""
    cfg = model.cfg
    queries = final_turn_queries(action_mask, turn_ids)
    _, state = model.apply(params, tokens, valid=valid, mutable=["intermediates"])
    flat = traverse_util.flatten_dict(state["intermediates"])
    total = jnp.zeros(tokens.shape, jnp.float32)
    for i, kind in enumerate(cfg.layer_pattern):  # pattern positions; depth is mapped below
        ((q_all, k_all),) = flat[("groups", f"layer_{i}", "attn", "qk")]  # [G, B, T, ., H]
        window = cfg.window if kind == "S" else None
        per_group = jax.lax.map(  # one layer's [B, N, T, T] probabilities live at a time
            lambda qk, w=window: layer_mass(qk[0], qk[1], queries, valid, w), (q_all, k_all)
        )
        total = total + per_group.sum(axis=0)
    last = _last_turn(action_mask, turn_ids)
    return jnp.where((turn_ids == last) & (last >= 0), 0.0, total / cfg.n_layers)
