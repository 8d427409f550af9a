"""Block-sparse attention: selection helpers, the fp32 reference and the XLA implementation.

The op (``block_sparse.block_sparse_attention``) and its kernels share what is here.

Each query token and kv head selects up to ``n_sel`` key blocks of ``block_size`` tokens
(shared by the query heads of that kv head's group); ``-1`` marks an unused slot. Causality
still applies: key ``s`` is never seen by query ``t < s``, including inside the query's own
block. Selections are sets: out-of-range entries count as unused and a repeated block counts
once. Queries and keys share positions (self-attention, S == T).

Einsum legend: B batch, T query time, S key time, K kv heads, G query heads per kv head
(N = K * G query heads), H head dim, L selection slot, P position inside a key block.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import check_gqa, default_scale, masked_softmax
from agentrl_jax.kernels.chunked_causal import chunked_causal_attention

# Gathered key elements per scan step of the XLA path (bounds its memory).
_XLA_GATHER_ELEMS = 1 << 23
# The XLA path computes dense masked logits for sequences up to this many times the keys a
# query gathers and at most _XLA_DENSE_MAX_T long (the probabilities kept for the backward pass
# grow as T^2). On the 2-core CPU, value and gradient at 8 selected blocks of 8 keys: dense
# 25 / 42 / 49 ms against gathered 139 / 147 / 59 ms at T = 192 / 512 / 1024 (1536 / 1536 /
# 1024 tokens), 246 against 178 ms at T = 2048.
_XLA_DENSE_FACTOR = 16
_XLA_DENSE_MAX_T = 4096


def validate(q, k, v, block_indices, block_size, query_block=1) -> int:
    """Checks the op's inputs; returns the GQA group size G."""
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
    """The selection as a sorted set: distinct valid ids ascending, then -1.

    Out-of-range ids (< 0 or >= num_blocks) and repeats count as unused. Two sorts of each row
    (O(n_sel log n_sel)), so per-token selections of hundreds of blocks stay cheap.

    Args:
      block_indices: [..., n_sel] integer block ids, -1 for unused.
      num_blocks: number of key blocks; valid ids are 0 .. num_blocks - 1.

    Returns:
      int32 [..., n_sel].
    """
    big = jnp.iinfo(jnp.int32).max
    idx = block_indices.astype(jnp.int32)
    idx = jnp.sort(jnp.where((idx >= 0) & (idx < num_blocks), idx, big), axis=-1)
    dup = jnp.concatenate([jnp.zeros_like(idx[..., :1], bool), idx[..., 1:] == idx[..., :-1]], -1)
    idx = jnp.sort(jnp.where(dup, big, idx), axis=-1)
    return jnp.where(idx == big, -1, idx)


def compact_selection(idx: jax.Array, block_size: int, query_block: int):
    """Used blocks first, the tail repeating the last used one; per-row counts.

    Args:
      idx: int32 [B, K, groups, L] selection as ``normalize_block_indices`` returns it (sorted,
        -1 last), one row per query group.
      block_size, query_block: as the op. A block is used iff selected and not entirely after
        the group's last token; since rows are sorted, the used blocks are a prefix.

    Returns:
      (blocks int32 [B, K, groups, L], counts int32 [B, K, groups, 2]): ``counts[..., 0]`` the
      used blocks, ``counts[..., 1]`` how many of them every token of the group sees whole
      (they end at or before the group's first token: no causal mask needed). Rows with no
      used block hold block 0.
    """
    n_sel = idx.shape[-1]
    first_tok = (jnp.arange(idx.shape[2]) * query_block)[:, None]
    used = (idx >= 0) & (idx * block_size <= first_tok + query_block - 1)
    whole = (idx >= 0) & (idx * block_size + block_size - 1 <= first_tok)
    count = jnp.sum(used, axis=-1, dtype=jnp.int32)
    n_whole = jnp.sum(whole, axis=-1, dtype=jnp.int32)
    last = jnp.take_along_axis(idx, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    last = jnp.where(count[..., None] > 0, last, 0)
    blocks = jnp.where(jnp.arange(n_sel) < count[..., None], idx, last)
    return blocks.astype(jnp.int32), jnp.stack([count, n_whole], axis=-1)


def inverse_selection(sel: jax.Array, cnt: jax.Array, num_blocks: int):
    """Per (batch, kv head): the query groups that used each block, grouped by block.

    Args:
      sel, cnt: compacted selection [B, K, groups, L] and counts [B, K, groups, 2].
      num_blocks: key blocks.

    Returns:
      (groups int32 [B, K, groups * L], offsets int32 [B, K, num_blocks + 1]): the groups that
      used block j are ``groups[offsets[j]:offsets[j + 1]]``, ascending.
    """
    b, kh, ng, n_sel = sel.shape
    flat = jnp.where(jnp.arange(n_sel) < cnt[..., :1], sel, num_blocks).reshape(b, kh, -1)
    order = jnp.argsort(flat, axis=-1, stable=True)
    ordered = jnp.take_along_axis(flat, order, axis=-1)
    edges = jnp.arange(num_blocks + 1, dtype=flat.dtype)
    offsets = jax.vmap(jax.vmap(lambda f: jnp.searchsorted(f, edges, side="left")))(ordered)
    return (order // n_sel).astype(jnp.int32), offsets.astype(jnp.int32)


def block_sparse_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    q_positions: jax.Array | None = None,
) -> jax.Array:
    """Dense fp32 reference: builds the full [T, S] mask from the selected blocks.

    Args:
      q: [B, T, Hq, D] queries.
      k: [B, S, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, S, Hkv, D] values.
      block_indices: int [B, T, Hkv, n_sel] selected key blocks, -1 = unused slot.
      block_size: tokens per key block (the last block may be partial).
      softmax_scale: logit scale; default 1/sqrt(D).
      q_positions: optional int [T] absolute positions of the query rows (some rows of a
        longer sequence, checked against the whole key sequence); default 0 .. T-1 with S == T.

    Returns:
      [B, T, Hq, D] in q.dtype; rows with no visible key are zero.

    Raises:
      ValueError: on inconsistent shapes or block_size < 1.
    """
    if q_positions is None:
        g = validate(q, k, v, block_indices, block_size)
        q_positions = jnp.arange(q.shape[1])
    else:
        g = check_gqa(q.shape[2], k.shape[2])
        if q_positions.shape != (q.shape[1],) or block_indices.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"q_positions must be [T={q.shape[1]}] and block_indices [B, T, ...]; got "
                f"{q_positions.shape=} {block_indices.shape=}"
            )
    b, t, n, h = q.shape
    s = k.shape[1]
    nblk = -(-s // block_size)
    scale = default_scale(h, softmax_scale)
    qg = q.astype(jnp.float32).reshape(b, t, n // g, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * scale
    # Chosen blocks as a [B, T, K, nblk] set (scatter: O(n_sel + nblk) per row), then per key.
    idx = block_indices.astype(jnp.int32)
    idx = jnp.where((idx >= 0) & (idx < nblk), idx, nblk)
    bi, ti, ki, _ = jnp.indices(idx.shape, sparse=True)
    chosen = jnp.zeros(idx.shape[:3] + (nblk,), bool).at[bi, ti, ki, idx].set(True, mode="drop")
    kpos = jnp.arange(s)
    chosen = chosen[..., kpos // block_size]  # [B, T, K, S]
    mask = chosen.transpose(0, 2, 1, 3) & (kpos[None, :] <= q_positions[:, None])  # [B, K, T, S]
    p = masked_softmax(logits, mask[:, :, None])
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def selected_blocks(block_indices: jax.Array, num_blocks: int, query_block: int = 1):
    """The selection as a set per query row: bool [B, T, K, num_blocks].

    Row t reads the selection of its group's first token (``t // query_block * query_block``);
    -1, out-of-range ids and repeats as in :func:`normalize_block_indices`.
    """
    b, t, kh, _ = block_indices.shape
    idx = block_indices.astype(jnp.int32)[:, ::query_block]
    idx = jnp.repeat(idx, query_block, axis=1)[:, :t]
    idx = jnp.where((idx >= 0) & (idx < num_blocks), idx, num_blocks)  # dropped below
    bi, ti, ki, _ = jnp.indices(idx.shape, sparse=True)
    return jnp.zeros((b, t, kh, num_blocks), bool).at[bi, ti, ki, idx].set(True, mode="drop")


def uses_dense_form(seq_len: int, n_sel: int, block_size: int, query_block: int = 1) -> bool:
    """Whether :func:`block_sparse_attention_xla` computes dense masked logits at this shape."""
    return seq_len <= min(_XLA_DENSE_MAX_T, _XLA_DENSE_FACTOR * n_sel * block_size / query_block)


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
    """XLA implementation: dense masked logits at short sequences, else gathered blocks.

    Where the sequence is at most ``_XLA_DENSE_FACTOR`` times the keys a query gathers
    (``n_sel * block_size / query_block``) and at most ``_XLA_DENSE_MAX_T`` long
    (:func:`uses_dense_form`), copying each query's blocks costs more than computing the
    logits it skips: the selection becomes a key mask of
    ``chunked_causal.chunked_causal_attention`` (query chunks against the keys up to their end,
    hand-written backward pass). Otherwise :func:`block_sparse_attention_xla_gather`. Shapes as
    :func:`block_sparse_attention_reference`.
    """
    validate(q, k, v, block_indices, block_size, query_block)
    t, bs, qb = q.shape[1], block_size, query_block
    if not uses_dense_form(t, block_indices.shape[-1], bs, qb):
        return block_sparse_attention_xla_gather(
            q, k, v, block_indices, block_size=bs, softmax_scale=softmax_scale, query_block=qb
        )
    scale = default_scale(q.shape[-1], softmax_scale)
    blocks = selected_blocks(block_indices, -(-t // bs), qb)
    return chunked_causal_attention(q, k, v, blocks, scale, bs)


def block_sparse_attention_xla_gather(
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
    g = validate(q, k, v, block_indices, block_size, query_block)
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
