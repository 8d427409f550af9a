"""Sparse-attention block selection (MoBA-style mean pooling) and its coverage measure.

Legend: B batch, T query time, S key time, N query heads, K kv heads, G query heads per kv
head, H head dim, J key blocks.

Each key block is summarised by the mean of its (RoPE-rotated) keys; a query's GQA group scores
block j with the group-mean query dotted with that mean key (no extra parameters, one [T, J]
product per KV head instead of [T, S]). Blocks after the query's own block are excluded
(causal), the own block is always kept, and the top ``sparse_topk_tokens / sparse_block_size``
blocks are selected; ties go to the lower block index. Selection is not differentiated.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_BIG = 1e30


def select_blocks(
    q: jax.Array,
    k: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    q_positions: jax.Array,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Chooses key blocks per query and KV group (see module docstring).

    Args:
      q: [B, T, N, H] queries (after RoPE).
      k: [B, S, K, H] keys at absolute positions ``0..S-1`` (after RoPE).
      block_size: key block size; S is padded up to a multiple of it.
      topk_blocks: blocks kept per query (own block included).
      q_positions: int32 [B, T] absolute positions of the queries.
      k_valid: optional bool [B, S]; invalid keys do not contribute to block means.

    Returns:
      int32 [B, T, K, n_sel] block indices, ``-1`` for unused slots; n_sel = min(topk, J).
    """
    b, s, n_kv, h = k.shape
    n_q = q.shape[2]
    n_blocks = -(-s // block_size)
    pad = n_blocks * block_size - s
    valid = jnp.ones((b, s), bool) if k_valid is None else k_valid
    k32 = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
    kb = k32.reshape(b, n_blocks, block_size, n_kv, h)
    vb = valid.reshape(b, n_blocks, block_size).astype(jnp.float32)
    count = jnp.sum(vb, axis=2)  # [B, J]
    kmean = jnp.einsum("BJLKH,BJL->BJKH", kb, vb) / jnp.maximum(count, 1.0)[..., None, None]
    qg = q.astype(jnp.float32).reshape(b, q.shape[1], n_kv, n_q // n_kv, h).mean(axis=3)
    score = jnp.einsum("BTKH,BJKH->BTKJ", qg, kmean)
    j = jnp.arange(n_blocks)
    qblock = (q_positions // block_size)[:, :, None, None]
    allowed = (j <= qblock) & (count[:, None, None, :] > 0)
    score = jnp.where(allowed, score, -jnp.inf)
    score = jnp.where(j == qblock, _BIG, score)
    n_sel = min(topk_blocks, n_blocks)
    vals, idx = jax.lax.top_k(score, n_sel)
    idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
    return jax.lax.stop_gradient(idx)


def sparse_coverage(
    q: jax.Array, k: jax.Array, block_indices: jax.Array, *, block_size: int
) -> jax.Array:
    """Share of dense causal attention probability mass inside the selected blocks.

    q [B,T,N,H], k [B,T,K,H], block_indices [B,T,K,n_sel] -> float32 [B, T, N] in [0, 1].
    """
    b, t, n_q, h = q.shape
    n_kv = k.shape[2]
    g = n_q // n_kv
    logits = jnp.einsum(
        "BTKGH,BSKH->BTKGS",
        q.astype(jnp.float32).reshape(b, t, n_kv, g, h),
        k.astype(jnp.float32),
    ) / math.sqrt(h)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, S]
    logits = jnp.where(causal[None, :, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    kblock = jnp.arange(t) // block_size  # [S]
    sel = jnp.any(block_indices[..., None] == kblock, axis=-2)  # [B, T, K, S]
    mass = jnp.sum(jnp.where(sel[:, :, :, None, :], probs, 0.0), axis=-1)
    return mass.reshape(b, t, n_q)
