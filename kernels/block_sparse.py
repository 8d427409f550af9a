"""Block-sparse causal attention with grouped-query heads and per-token block selection.

Each query token and kv head selects up to ``n_sel`` key blocks of ``block_size`` tokens
(shared by the query heads of that kv head's group); ``-1`` marks an unused slot. Causality
still applies: key ``s`` is never seen by query ``t < s``, including inside the query's own
block. Selections are sets: out-of-range entries count as unused and a repeated block counts
once. Queries and keys share positions (self-attention, S == T).

Einsum legend: B batch, T query time, S key time, K kv heads, G query heads per kv head
(N = K * G query heads), H head dim, L selection slot, P position inside a key block.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import (
    check_gqa,
    default_scale,
    masked_softmax,
    resolve_impl,
)

# Gathered key elements per scan step of the XLA path (bounds its memory).
_XLA_GATHER_ELEMS = 1 << 23


def _validate(q, k, v, block_indices, block_size, query_block=1) -> int:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4; got {q.shape=}, {k.shape=}, {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
    b, t, n, h = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != h:
        raise ValueError(f"k must be [B={b}, T={t}, Hkv, D={h}]; got {k.shape=}")
    g = check_gqa(n, k.shape[2])
    if block_indices.ndim != 4 or block_indices.shape[:3] != (b, t, k.shape[2]):
        raise ValueError(
            f"block_indices must be [B={b}, T={t}, Hkv={k.shape[2]}, n_sel]; "
            f"got {block_indices.shape=}"
        )
    if not jnp.issubdtype(block_indices.dtype, jnp.integer):
        raise ValueError(f"block_indices must be an integer array; got {block_indices.dtype=}")
    if not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"{block_size=} must be an int >= 1")
    if not isinstance(query_block, numbers.Integral) or query_block < 1:
        raise ValueError(f"{query_block=} must be an int >= 1")
    return g


def normalize_block_indices(block_indices: jax.Array, num_blocks: int) -> jax.Array:
    """Returns int32 indices with out-of-range and repeated entries replaced by -1.

    Args:
      block_indices: [..., n_sel] integer block ids, -1 for unused.
      num_blocks: number of key blocks; valid ids are 0 .. num_blocks - 1.
    """
    idx = block_indices.astype(jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < num_blocks), idx, -1)
    n_sel = idx.shape[-1]
    earlier = jnp.tril(jnp.ones((n_sel, n_sel), bool), k=-1)  # [slot, earlier slot]
    dup = jnp.any((idx[..., :, None] == idx[..., None, :]) & earlier, axis=-1)
    return jnp.where(dup, -1, idx)


def block_sparse_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
) -> jax.Array:
    """Dense fp32 reference: builds the full [T, S] mask from the selected blocks.

    Args:
      q: [B, T, Hq, D] queries.
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, T, Hkv, D] values.
      block_indices: int [B, T, Hkv, n_sel] selected key blocks, -1 = unused slot.
      block_size: tokens per key block (the last block may be partial).
      softmax_scale: logit scale; default 1/sqrt(D).

    Returns:
      [B, T, Hq, D] in q.dtype; rows with no visible key are zero.

    Raises:
      ValueError: on inconsistent shapes or block_size < 1.
    """
    g = _validate(q, k, v, block_indices, block_size)
    b, t, n, h = q.shape
    scale = default_scale(h, softmax_scale)
    qg = q.astype(jnp.float32).reshape(b, t, n // g, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * scale
    pos = jnp.arange(t)
    chosen = jnp.any(block_indices[..., None] == (pos // block_size), axis=3)  # [B, T, K, S]
    mask = chosen.transpose(0, 2, 1, 3) & (pos[None, :] <= pos[:, None])  # [B, K, T, S]
    p = masked_softmax(logits, mask[:, :, None])
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def block_sparse_attention_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
) -> jax.Array:
    """Gathered-block XLA implementation; differentiable by autodiff.

    Each group of ``query_block`` queries gathers its selected key/value blocks (read from the
    group's first token) and attends to them only, so the work is proportional to the selected
    context. Groups are processed in chunks (``lax.map``) to bound the gathered memory. Shapes
    as :func:`block_sparse_attention_reference`.
    """
    g = _validate(q, k, v, block_indices, block_size, query_block)
    b, t, n, h = q.shape
    kh, n_sel, bs, qb = n // g, block_indices.shape[-1], block_size, query_block
    scale = default_scale(h, softmax_scale)
    nblk = -(-t // bs)
    idx = normalize_block_indices(block_indices, nblk)[:, ::qb]  # [B, groups, K, L]
    kpad = nblk * bs - t
    if kpad:
        k, v = (jnp.pad(x, ((0, 0), (0, kpad), (0, 0), (0, 0))) for x in (k, v))
    kb = k.reshape(b, nblk, bs, kh, h).transpose(0, 3, 1, 2, 4)  # [B, K, nblk, P, H]
    vb = v.reshape(b, nblk, bs, kh, h).transpose(0, 3, 1, 2, 4)

    groups = idx.shape[1]
    gc = max(1, min(groups, _XLA_GATHER_ELEMS // max(1, b * kh * n_sel * bs * h)))
    nchunk = -(-groups // gc)
    qpad = nchunk * gc * qb - t
    qg = q.reshape(b, t, kh, g, h)
    if qpad:
        qg = jnp.pad(qg, ((0, 0), (0, qpad), (0, 0), (0, 0), (0, 0)))
    idx = jnp.pad(idx, ((0, 0), (0, nchunk * gc - groups), (0, 0), (0, 0)), constant_values=-1)
    qs = qg.reshape(b, nchunk, gc, qb, kh, g, h).swapaxes(0, 1)
    ids = idx.reshape(b, nchunk, gc, kh, n_sel).swapaxes(0, 1)
    first = (jnp.arange(nchunk * gc) * qb).reshape(nchunk, gc)  # first token of each group

    def chunk(args):
        qc, ic, f = args  # [B, C, Q, K, G, H], [B, C, K, L], [C]
        icT = ic.transpose(0, 2, 1, 3)  # [B, K, C, L]
        gidx = jnp.maximum(icT, 0).reshape(b, kh, gc * n_sel, 1, 1)
        kg = jnp.take_along_axis(kb, gidx, axis=2).reshape(b, kh, gc, n_sel * bs, h)
        vg = jnp.take_along_axis(vb, gidx, axis=2).reshape(b, kh, gc, n_sel * bs, h)
        logits = jnp.einsum("BCQKGH,BKCSH->BKCQGS", qc, kg, preferred_element_type=jnp.float32)
        kpos = (icT[..., None] * bs + jnp.arange(bs)).reshape(b, kh, gc, 1, 1, n_sel * bs)
        valid = jnp.repeat(icT >= 0, bs, axis=-1).reshape(kpos.shape)
        qpos = (f[:, None] + jnp.arange(qb))[None, None, :, :, None, None]
        p = masked_softmax(logits * scale, valid & (kpos <= qpos))
        return jnp.einsum(
            "BKCQGS,BKCSH->BCQKGH", p.astype(vg.dtype), vg, preferred_element_type=jnp.float32
        )

    if nchunk == 1:
        out = chunk((qs[0], ids[0], first[0]))[None]
    else:
        out = jax.lax.map(chunk, (qs, ids, first))
    out = out.swapaxes(0, 1).reshape(b, nchunk * gc * qb, n, h)[:, :t]
    return out.astype(q.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_size", "softmax_scale", "query_block", "impl", "interpret")
)
def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
    impl: str = "auto",
    interpret: bool | Any = False,
) -> jax.Array:
    """Block-sparse causal attention; the block selection is shared by each GQA group.

    Args:
      q: [B, T, Hq, D] queries (float32 or bfloat16).
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, T, Hkv, D] values.
      block_indices: int32 [B, T, Hkv, n_sel] key blocks each query token attends to for each
        kv head; -1 = unused slot; out-of-range ids count as unused, repeats count once.
      block_size: tokens per key block (block j holds keys j*block_size .. (j+1)*block_size-1).
      softmax_scale: logit scale; default 1/sqrt(D).
      query_block: the caller's promise that the selection is the same for every aligned group
        of ``query_block`` tokens (tokens i*query_block ..); the fast impls then read each
        group's first row and process the group as one tile (bigger matmuls, K/V read once per
        group). 1 (default): per-token selection. The reference ignores it.
      impl: 'xla', 'pallas' (generic kernels, K/V of the sequence in one block), 'pallas_tpu'
        (scalar-prefetch Mosaic forward: the selection drives the K/V block DMAs; backward
        through the XLA path) or 'auto' ('pallas_tpu' on TPU, 'xla' there when query_block * G
        or block_size is not a multiple of 8; 'pallas' on GPU; 'xla' on CPU).
      interpret: run the Pallas kernel in interpret mode (CPU testing): True, or for
        'pallas_tpu' also ``pltpu.InterpretParams()`` (TPU semantics).

    Returns:
      [B, T, Hq, D] in q.dtype; float32 softmax/accumulation; a query whose selected blocks hold
      no key <= t returns zeros.

    Raises:
      ValueError: on inconsistent shapes, block_size or query_block < 1, or an unknown impl.
    """
    requested, impl = impl, resolve_impl(impl, has_tpu_variant=True)
    kw = dict(block_size=block_size, softmax_scale=softmax_scale, query_block=query_block)
    if requested == "auto" and impl == "pallas_tpu" and not interpret:
        from agentrl_jax.kernels.block_sparse_tpu import tpu_tiles_ok

        g = _validate(q, k, v, block_indices, block_size, query_block)
        t = q.shape[1]
        groups, nblk = -(-t // query_block), -(-t // block_size)
        if not tpu_tiles_ok(query_block * g, groups, block_size, nblk):
            impl = "xla"  # tiles the TPU cannot block (e.g. query_block * G < 8)
    if impl == "xla":
        return block_sparse_attention_xla(q, k, v, block_indices, **kw)
    _validate(q, k, v, block_indices, block_size, query_block)
    if impl == "pallas_tpu":
        from agentrl_jax.kernels.block_sparse_tpu import block_sparse_attention_pallas_tpu

        return block_sparse_attention_pallas_tpu(q, k, v, block_indices, interpret=interpret, **kw)
    from agentrl_jax.kernels.block_sparse_pallas import block_sparse_attention_pallas

    return block_sparse_attention_pallas(q, k, v, block_indices, interpret=interpret, **kw)
