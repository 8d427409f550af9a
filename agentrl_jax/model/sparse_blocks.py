"""Sparse full attention that reads only its selected key blocks from the page pools.

Legend: B batch, C chunk rows, S key positions (cache capacity), J key blocks (S / bs),
K kv heads, G query heads per kv head, N query heads, H head dim, n selected blocks per row and
kv head, M gathered keys per row and kv head (n * bs), bs the sparse block size.

With ``ModelConfig.sparse_gather`` the cached (chunk) path of an ``F`` layer, i.e. prefill,
decode and the trainer's chunked parity pass, does not gather the whole context and mask it:
  1. each sequence keeps the mean key of every block (``kmean`` f32 [B, K, J, H], a per-slot
     cache entry): after a chunk's keys are written, the blocks its rows fall in are re-averaged
     from the float pool (:func:`update_block_means`), so scoring reads J means, not S keys;
  2. a query's GQA group scores blocks with its group-mean query against those means, causally,
     its own block always kept, blocks without a visible key excluded, top ``n`` by score, ties
     to the lower block (:func:`score_blocks`; ``select_blocks``'s scorer on stored means);
  3. only the selected blocks' keys and values are read from the pools (float pages, or int8
     pages dequantised: ``model.paged.read_tokens``) and attended (:func:`gathered_attention`).
The selected indices ([B, C, K, n], -1 unused, in top-k order) are returned so the rollout
records them per layer and token; given back as ``replay`` they replace step 2, which is how the
trainer's pass reproduces the rollout's selection exactly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.precision import DTypePolicy

_BIG = 1e30  # the own block's score: always selected


def block_positions(blocks: jax.Array, block_size: int) -> jax.Array:
    """Key positions of ``blocks`` int32 [..., n] -> int32 [..., n * bs] (-1 blocks give
    negative positions, which callers mask)."""
    pos = blocks[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    return pos.reshape(*blocks.shape[:-1], -1)


def update_block_means(
    kmean: jax.Array,
    read_keys,
    positions: jax.Array,
    valid: jax.Array,
    new_len: jax.Array,
    block_size: int,
) -> jax.Array:
    """Re-averages the blocks the chunk's valid rows fall in.

    Args:
      kmean: f32 [B, K, J, H] block means (head-major: scoring reads each head's means as one
        [J, H] matrix, no transposed copy).
      read_keys: ``read_keys(pos int32 [B, X]) -> [B, X, K, H]`` keys of the float pool at
        absolute positions (after this chunk's write).
      positions: int32 [B, C] positions of the chunk's rows.
      valid: bool [B, C] real rows.
      new_len: int32 [B] tokens cached after the chunk.
      block_size: bs.

    Returns:
      f32 [B, K, J, H]: each touched block's mean over its positions below ``new_len``.
    """
    b, c = positions.shape
    n_kv, n_blocks = kmean.shape[1:3]
    blk = positions // block_size  # [B, C]
    pos = block_positions(blk, block_size)  # [B, C * bs]
    keys = read_keys(jnp.clip(pos, 0, n_blocks * block_size - 1)).astype(jnp.float32)
    keys = keys.reshape(b, c, block_size, *keys.shape[2:])
    w = (pos < new_len[:, None]).reshape(b, c, block_size).astype(jnp.float32)
    count = jnp.sum(w, axis=2)  # [B, C]
    mean = jnp.einsum("BCLKH,BCL->BCKH", keys, w) / jnp.maximum(count, 1.0)[..., None, None]
    dst = jnp.where(valid, blk, n_blocks)  # invalid rows dropped
    bidx = jnp.arange(b)[:, None, None]
    return kmean.at[bidx, jnp.arange(n_kv), dst[..., None]].set(mean, mode="drop")


def score_blocks(
    q: jax.Array,
    kmean: jax.Array,
    positions: jax.Array,
    block_visible: jax.Array,
    *,
    block_size: int,
    n_sel: int,
) -> jax.Array:
    """Top ``n_sel`` key blocks per row and KV group from the stored block means.

    Args:
      q: [B, C, N, H] queries (after RoPE).
      kmean: f32 [B, K, J, H] block means.
      positions: int32 [B, C] query positions.
      block_visible: bool [B, J] blocks holding at least one visible key.
      block_size: bs.
      n_sel: blocks kept (<= J).

    Returns:
      int32 [B, C, K, n_sel] block indices in descending score order (the own block first),
      -1 for unused slots.
    """
    b, c, n_q, h = q.shape
    n_kv = kmean.shape[1]
    qg = q.astype(jnp.float32).reshape(b, c, n_kv, n_q // n_kv, h).mean(axis=3)
    score = jnp.einsum("BCKH,BKJH->BCKJ", qg, kmean)
    j = jnp.arange(kmean.shape[2])
    qblock = (positions // block_size)[:, :, None, None]
    allowed = (j <= qblock) & block_visible[:, None, None, :]
    score = jnp.where(allowed, score, -jnp.inf)
    score = jnp.where(j == qblock, _BIG, score)
    vals, idx = jax.lax.top_k(score, n_sel)
    return jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)


def gathered_mask(
    blocks: jax.Array,
    positions: jax.Array,
    new_len: jax.Array,
    keep: jax.Array | None,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Gathered key positions and their visibility.

    blocks int32 [B, C, K, n]; positions int32 [B, C]; new_len int32 [B]; keep optional bool
    [B, S] (eviction) -> (pos int32 [B, C, K, M] clipped to [0, S), mask bool [B, C, K, M]:
    a used block's key at or before the query and below ``new_len``, not evicted).
    """
    b = blocks.shape[0]
    pos = block_positions(blocks, block_size)  # [B, C, K, M]
    used = jnp.repeat(blocks >= 0, block_size, axis=-1)
    mask = used & (pos <= positions[:, :, None, None]) & (pos < new_len[:, None, None, None])
    pos = jnp.maximum(pos, 0)
    if keep is not None:
        bidx = jnp.arange(b)[:, None, None, None]
        mask = mask & keep[bidx, jnp.minimum(pos, keep.shape[1] - 1)]
    return pos, mask


def gathered_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    policy: DTypePolicy,
) -> tuple[jax.Array, jax.Array]:
    """Attention of each row over its own gathered keys; a row with no visible key gives 0.

    The same arithmetic as ``model.sinks.masked_attention`` (compute-dtype products with
    ``policy.attn`` logits, max-shifted softmax, ``policy.accum`` output), with keys per row.

    Args:
      q: [B, C, N, H]; k, v: [B, C, K, M, H] gathered keys and values; mask: bool [B, C, K, M].
      policy: dtype policy.

    Returns:
      (out [B, C, N, H] in the compute dtype, probabilities [B, C, K, G, M] in the attention
      dtype).
    """
    b, c, n_q, h = q.shape
    n_kv = k.shape[2]
    qg = q.reshape(b, c, n_kv, n_q // n_kv, h)
    logits = jnp.einsum(
        "BCKGH,BCKMH->BCKGM",
        qg.astype(policy.compute),
        k.astype(policy.compute),
        preferred_element_type=policy.attn,
    ) * jnp.asarray(1.0 / math.sqrt(h), policy.attn)
    m = mask[:, :, :, None, :]
    logits = jnp.where(m, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(m, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum(
        "BCKGM,BCKMH->BCKGH",
        p.astype(policy.compute),
        v.astype(policy.compute),
        preferred_element_type=policy.accum,
    )
    return out.reshape(b, c, n_q, h).astype(policy.compute), p


def gathered_mass(p: jax.Array, pos: jax.Array, valid: jax.Array, n_keys: int) -> jax.Array:
    """Attention mass per key position from gathered probabilities (mean over query heads).

    p [B, C, K, G, M]; pos int32 [B, C, K, M]; valid bool [B, C] rows that count; n_keys S ->
    f32 [B, S]: the sum over valid rows of each position's probability, divided by K * G.
    """
    b, c, n_kv, g, m = p.shape
    w = jnp.sum(p.astype(jnp.float32), axis=3) * valid.astype(jnp.float32)[:, :, None, None]
    w = w / (n_kv * g)
    bidx = jnp.broadcast_to(jnp.arange(b)[:, None, None, None], pos.shape)
    return jnp.zeros((b, n_keys), jnp.float32).at[bidx, pos].add(w)


def sparse_attention_reference(q, k, v, blocks, positions, key_valid, block_size):
    """float64 numpy reference of the gathered path: each row attends, per kv group, to the keys
    of its selected blocks that are causal and valid.

    q [B, C, N, H]; k, v [B, S, K, H] (absolute positions); blocks [B, C, K, n] (-1 unused);
    positions [B, C]; key_valid bool [B, S] -> [B, C, N, H] float64.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    blocks, positions, key_valid = map(np.asarray, (blocks, positions, key_valid))
    b, c, n, h = q.shape
    s, n_kv = k.shape[1], k.shape[2]
    g = n // n_kv
    out = np.zeros((b, c, n, h))
    for i in range(b):
        for r in range(c):
            for kk in range(n_kv):
                sel = {int(x) for x in blocks[i, r, kk] if x >= 0}
                keys = [
                    p
                    for p in range(s)
                    if p // block_size in sel and p <= positions[i, r] and key_valid[i, p]
                ]
                if not keys:
                    continue
                for hh in range(kk * g, (kk + 1) * g):
                    logits = k[i, keys, kk] @ q[i, r, hh] / math.sqrt(h)
                    w = np.exp(logits - logits.max())
                    out[i, r, hh] = (w / w.sum()) @ v[i, keys, kk]
    return out
