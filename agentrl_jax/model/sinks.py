"""Masked dense attention, with the learned attention sinks of gpt-oss.

Legend: B batch, C query time (chunk), S key time, N query heads, K kv heads, G query heads per
kv head, H head dim.

A sink is one learned logit per query head that joins every row's softmax as an extra key with
no value: ``p_s = exp(l_s - m) / (exp(sink - m) + sum_s' exp(l_s' - m))``; the mass the sink
takes is dropped, so a row can attend to "nothing" in part. The attention kernels
(``agentrl_jax.kernels``) have no sink and return no log-sum-exp, so layers with sinks run this
XLA path in every mode: teacher-forced (:func:`sink_attention`, an explicit causal / window
mask over the whole sequence, O(T^2) memory), chunked prefill against the paged or ring cache
and decode (``model.attention`` passes ``sinks`` to :func:`masked_attention` and never routes
a sink layer to the paged decode kernel).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.precision import DTypePolicy


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    policy: DTypePolicy,
    *,
    return_probs: bool = False,
    sinks: jax.Array | None = None,
):
    """Dense attention with an explicit mask; a row with no visible key returns zeros.

    q [B,C,N,H]; k, v [B,S,K,H]; mask bool [B,C,K,S] (shared by a KV group) -> [B,C,N,H];
    with ``return_probs`` also the probabilities [B,C,K,G,S] (attention dtype). ``sinks``
    (optional [N] logits, ``model.sinks``) join every row's softmax as one extra key whose
    probability is dropped; a row with no visible key then still returns zeros.
    """
    b, c, n_q, h = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(b, c, n_kv, n_q // n_kv, h)
    logits = jnp.einsum(
        "BCKGH,BSKH->BCKGS",
        qg.astype(policy.compute),
        k.astype(policy.compute),
        preferred_element_type=policy.attn,
    ) * jnp.asarray(1.0 / math.sqrt(h), policy.attn)
    m = mask[:, :, :, None, :]
    logits = jnp.where(m, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    if sinks is not None:
        sink = sinks.astype(policy.attn).reshape(1, 1, n_kv, n_q // n_kv, 1)
        row_max = jnp.maximum(row_max, sink)
    p = jnp.where(m, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum(
        "BCKGS,BSKH->BCKGH",
        p.astype(policy.compute),
        v.astype(policy.compute),
        preferred_element_type=policy.accum,
    )
    out = out.reshape(b, c, n_q, h).astype(policy.compute)
    return (out, p) if return_probs else out


def sink_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    sinks: jax.Array,
    *,
    window: int,
    policy: DTypePolicy,
) -> jax.Array:
    """Teacher-forced causal attention over the last ``window`` keys with sinks.

    Args:
      q: [B, T, N, H] at positions 0..T-1; k, v: [B, T, K, H].
      sinks: [N] sink logits.
      window: keys ``t - window + 1 .. t`` are visible (``window >= T``: full causal).
      policy: dtype policy (logits and softmax in ``policy.attn``).

    Returns:
      [B, T, N, H] in the compute dtype.
    """
    b, t = q.shape[:2]
    pos = jnp.arange(t)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)  # [T, S]
    mask = jnp.broadcast_to(mask[None, :, None, :], (b, t, k.shape[2], t))
    return masked_attention(q, k, v, mask, policy, sinks=sinks)


def sink_attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray, window: int
) -> np.ndarray:
    """float64 numpy attention with sinks, written as the reference formula (for tests):
    concatenate the sink to each row's logits, softmax, drop the sink's column.

    q [B, T, N, H]; k, v [B, T, K, H]; sinks [N] -> [B, T, N, H].
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    g = n // k.shape[2]
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    logits = np.einsum("BTNH,BSNH->BNTS", q, kk) / math.sqrt(h)
    pos = np.arange(t)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    logits = np.where(visible, logits, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (b, n, t, 1))
    full = np.concatenate([logits, sink], axis=-1)
    full = np.exp(full - full.max(axis=-1, keepdims=True))
    probs = (full / full.sum(axis=-1, keepdims=True))[..., :-1]
    return np.einsum("BNTS,BSNH->BTNH", probs, vv)
