"""The cached (chunk) path of paged ``F``/``D`` layers: write, int8, and the ways to attend.

Legend: B batch, C chunk rows, S key positions (J pages of L tokens), P pages (all pattern
groups' pools as one flat pool), K kv heads, N query heads, H head dim, M gathered keys.

:func:`paged_chunk` runs one chunk of an ``F`` or ``D`` layer against its page pool:
  1. the chunk's keys and values are written into their pages (rows without a page dropped);
  2. int8 decisions taking effect in the chunk re-quantise their pages, and pages that are
     then all int8 get their codes and scales in the int8 pool when they have an int8 page
     (``model.paged``); reads take those pages from the int8 pool, dequantised (same values);
  3. with ``sparse_gather`` (F layers) the means of the key blocks the chunk writes are updated
     (``model.sparse_blocks``);
  4. attention by the path ``model.dispatch.attention_path`` picks (its table), one of
     * the decode kernel (``decode_kernel``, one row): D layers over the live pages
       (``decode_dense``), F layers over their selected blocks (``decode_sparse``, or
       ``decode_gathered`` scored on the block means; ``model.paged.sparse_decode``). With an
       int8 pool, one call on the float pool and one on the int8 pool (its scales), merged by
       log-sum-exp (``model.paged.two_pool_decode``); each call gets a block table of only its
       own pool's pages (blocks for F) that hold a visible key, in logical order, with a
       per-token key mask over them (``model.paged.pool_call``), so neither reads the other
       pool's pages nor fully evicted ones; the eviction ``keep`` mask joins those key masks.
       Excluded
       (chunk path): the attention-mass accumulator (the kernel returns no probabilities) and
       sink logits (the kernel has no sink term);
     * ``gathered`` (F with ``sparse_gather``): only the selected blocks are read;
     * ``live_dense`` (D, non-parity policies, no mass tracking): the live pages gathered and
       masked;
     * ``masked``: the whole context is gathered and masked (F: to its selected blocks).
F layers select blocks with ``select_blocks`` over the gathered keys, or with ``sparse_gather``
from the stored block means; ``replay`` (int32 [B, C, K, n]) replaces the selection. With
``record`` the selection comes back in the layer cache under ``"blocks"`` [B, C, K, n_sel].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.dispatch import AttentionCall, attention_path, kernel_impl
from agentrl_jax.model.paged import (
    Int8Pool,
    int8_decisions,
    int8_page_update,
    int8_pages_read,
    over_live_pages,
    pool_call,
    read_pages,
    read_tokens,
    sparse_decode,
    two_pool_decode,
)
from agentrl_jax.model.select import select_blocks
from agentrl_jax.model.sinks import masked_attention
from agentrl_jax.model.sparse_blocks import (
    gathered_attention,
    gathered_mask,
    gathered_mass,
    score_blocks,
    update_block_means,
)
from agentrl_jax.precision import DTypePolicy

INT8_KEYS = ("k8", "v8", "ks", "vs")  # a paged layer cache's int8 pool entries


def fit_blocks(blocks: jax.Array, n_sel: int) -> jax.Array:
    """Block indices [..., m] cut or padded (with -1, unused) to width ``n_sel``."""
    m = blocks.shape[-1]
    if m >= n_sel:
        return blocks[..., :n_sel]
    return jnp.pad(blocks, [(0, 0)] * (blocks.ndim - 1) + [(0, n_sel - m)], constant_values=-1)


@dataclasses.dataclass
class _Chunk:
    """What the ways to attend share: the flat pools (``[G, P, ...]`` -> ``[G * P, ...]``),
    block tables in flat ids, the chunk's rows and the layer's options and kind."""

    q: jax.Array
    positions: jax.Array
    valid: jax.Array
    new_len: jax.Array
    meta: dict
    cache: dict
    group: jax.Array
    cfg: ModelConfig
    policy: DTypePolicy
    record: bool
    kind: str
    k: jax.Array = None
    v: jax.Array = None
    int8: Int8Pool | None = None
    use8: jax.Array | None = None  # bool [B, J]: pages read from the int8 pool
    kmean: jax.Array | None = None  # f32 [B, K, J_blocks, H] block means (sparse_gather)
    extra: dict = dataclasses.field(default_factory=dict)  # further cache entries to return

    def __post_init__(self):
        shape = self.cache["k"].shape  # [G, P, L, K, H]
        self.n_pages, self.page = shape[1:3]
        self.k = self.cache["k"].reshape(-1, *shape[2:])
        self.v = self.cache["v"].reshape(-1, *shape[2:])
        self.raw = self.meta["block_tables"]
        self.tables = jnp.where(self.raw >= 0, self.raw + self.group * self.n_pages, -1)
        self.s = self.tables.shape[1] * self.page
        if "k8" in self.cache:
            if "int8_tables" not in self.meta:
                raise ValueError("a cache with an int8 pool needs meta['int8_tables']")
            n8 = self.cache["k8"].shape[1]
            raw8 = self.meta["int8_tables"]
            flat = [self.cache[key].reshape(-1, *self.cache[key].shape[2:]) for key in INT8_KEYS]
            self.int8 = Int8Pool(*flat, tables=jnp.where(raw8 >= 0, raw8 + self.group * n8, -1))

    @property
    def keep(self) -> jax.Array | None:
        return self.meta.get("keep")

    def visible(self, n: int | None = None) -> jax.Array:
        """bool [B, n * page] (default all S): keys of the first ``n`` pages this chunk may
        attend: cached (position < ``new_len``) and, under eviction replay, still held."""
        s = self.s if n is None else n * self.page
        vis = jnp.arange(s)[None, :] < self.new_len[:, None]
        return vis if self.keep is None else vis & self.keep[:, :s]

    def result(self, out: jax.Array, blocks: jax.Array | None = None, **more):
        """(out in the compute dtype, the stacked layer cache with ``more`` entries)."""
        shape = self.cache["k"].shape
        new = {"k": self.k.reshape(shape), "v": self.v.reshape(shape), **self.extra, **more}
        if self.int8 is not None:
            for key, a in zip(INT8_KEYS, self.int8[:4], strict=True):
                new[key] = a.reshape(self.cache[key].shape)
        if self.record and blocks is not None:
            new["blocks"] = blocks
        return out.astype(self.policy.compute), new

    def read_context(self, n: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Keys and values of every position of every sequence (of the first ``n`` pages):
        [B, S, K, H] each."""
        safe = jnp.maximum(self.raw[:, :n], 0) + self.group * self.n_pages
        if self.int8 is None:
            return read_pages(self.k, safe), read_pages(self.v, safe)
        safe8 = jnp.maximum(self.int8.tables[:, :n], 0)
        i8, use8 = self.int8, self.use8[:, :n]
        return (
            read_pages(self.k, safe, i8.k, i8.ks, safe8, use8),
            read_pages(self.v, safe, i8.v, i8.vs, safe8, use8),
        )

    def int8_parts(self) -> tuple[Int8Pool, jax.Array] | None:
        """The int8 pool and ``use8`` (``model.paged.sparse_decode``), or None without an
        int8 pool."""
        return None if self.int8 is None else (self.int8, self.use8)

    def read_at(self, pos: jax.Array, heads: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values at positions int32 [B, ...] of kv heads ``heads`` (broadcastable):
        [B, ..., H] each."""
        if self.int8 is None:
            return tuple(read_tokens(p, self.tables, pos, heads) for p in (self.k, self.v))
        i8, which = self.int8, (self.int8.tables, self.use8)
        return (
            read_tokens(self.k, self.tables, pos, heads, i8.k, i8.ks, which),
            read_tokens(self.v, self.tables, pos, heads, i8.v, i8.vs, which),
        )


def paged_chunk(
    q: jax.Array,
    kd: jax.Array,
    vd: jax.Array,
    positions: jax.Array,
    cache: dict,
    meta: dict,
    valid: jax.Array,
    new_len: jax.Array,
    group: jax.Array,
    *,
    cfg: ModelConfig,
    policy: DTypePolicy,
    kind: str,
    decode_kernel: bool = False,
    sinks: jax.Array | None = None,
    replay: jax.Array | None = None,
    record: bool = False,
) -> tuple[jax.Array, dict]:
    """One chunk of a paged layer (module docstring).

    Args:
      q: [B, C, N, H] queries; kd, vd: [B, C, K, H] keys and values in the pool dtype.
      positions: int32 [B, C]; valid: bool [B, C] real rows; new_len: int32 [B].
      cache: the stacked layer cache ([G, ...] buffers: ``k``, ``v``, optional int8 pool
        ``k8 v8 ks vs``, ``kmean``, ``mass``).
      meta: ``lengths``, ``block_tables`` and optional ``int8_tables``, ``keep``, ``int8_at``.
      group: int32 scalar, this layer's entry of the stacked buffers.
      cfg, policy, kind: the layer's model config, dtype policy and kind ('F' or 'D').
      decode_kernel: use the paged decode kernel where it applies.
      sinks: optional [N] sink logits (masked path only).
      replay: optional int32 [B, C, K, n] block selection to use (F layers).
      record: return the F selection under ``"blocks"``.

    Returns:
      (out [B, C, N, H] in the compute dtype, the new stacked layer cache).

    Raises:
      ValueError: an int8 pool without ``int8_tables`` or ``int8_at`` in ``meta``; an F layer
        of a ``sparse_gather`` model without ``kmean`` in ``cache``.
    """
    call = AttentionCall(
        kind,
        cached=True,
        one_row=decode_kernel and q.shape[1] == 1,
        sinks=sinks is not None,
        tracks_mass="mass" in cache,
        sparse_gather=cfg.sparse_gather,
        parity=policy.parity,
    )
    path = attention_path(call)
    means = kind == "F" and cfg.sparse_gather  # the block means are kept up to date
    if means and "kmean" not in cache:
        raise ValueError("an F layer of a sparse_gather model needs cache['kmean']")
    ch = _Chunk(q, positions, valid, new_len, meta, cache, group, cfg, policy, record, kind)
    _write(ch, kd, vd, means)
    n_sel = min(cfg.sparse_topk_blocks, -(-ch.s // cfg.sparse_block_size))
    return _PATHS[path](ch, n_sel, sinks, replay)


def _write(ch: _Chunk, kd: jax.Array, vd: jax.Array, means: bool) -> None:
    """Steps 1-3: the rows' keys and values, the int8 decisions, the block means (``means``)."""
    lengths, positions, valid, new_len = ch.meta["lengths"], ch.positions, ch.valid, ch.new_len
    page_of = jnp.take_along_axis(
        ch.tables, jnp.clip(positions // ch.page, 0, ch.tables.shape[1] - 1), axis=1
    )
    page_of = jnp.where(valid & (page_of >= 0), page_of, ch.k.shape[0])  # invalid -> dropped
    slot = positions % ch.page
    ch.k = ch.k.at[page_of, slot].set(kd, mode="drop")
    ch.v = ch.v.at[page_of, slot].set(vd, mode="drop")
    int8_at = int8_decisions(ch.meta, ch.policy, ch.s, ch.page)
    if int8_at is not None and ch.int8 is None:  # int8 KV: decisions of this chunk, in place
        ch.k, ch.v = int8_page_update(ch.k, ch.v, ch.tables, int8_at, lengths, new_len)
    elif int8_at is not None:
        ch.k, ch.v, ch.int8 = int8_page_update(
            ch.k, ch.v, ch.tables, int8_at, lengths, new_len, ch.int8
        )
        ch.use8 = int8_pages_read(ch.int8, int8_at, new_len)
    elif ch.int8 is not None:
        raise ValueError("a cache with an int8 pool needs meta['int8_at']")
    if means:
        heads = jnp.arange(ch.k.shape[2])[None, None, :]

        def read_keys(pos):  # [B, X] -> [B, X, K, H] from the float pool
            return read_tokens(ch.k, ch.tables, pos[:, :, None], heads)

        kmean = update_block_means(
            ch.cache["kmean"][ch.group],
            read_keys,
            positions,
            valid,
            new_len,
            ch.cfg.sparse_block_size,
        )
        ch.kmean = kmean
        ch.extra["kmean"] = ch.cache["kmean"].at[ch.group].set(kmean)


def _score(ch: _Chunk, n_sel: int) -> jax.Array:
    """Selection from the stored block means: int32 [B, C, K, n_sel]."""
    b, bs = ch.q.shape[0], ch.cfg.sparse_block_size
    visible = jnp.any(ch.visible().reshape(b, ch.s // bs, bs), axis=2)
    return score_blocks(ch.q, ch.kmean, ch.positions, visible, block_size=bs, n_sel=n_sel)


def _stored_blocks(ch: _Chunk, n_sel: int, replay: jax.Array | None) -> jax.Array:
    """The selection of an F layer with block means: ``replay`` or scored on the means."""
    return fit_blocks(replay if replay is not None else _score(ch, n_sel), n_sel)


def _decode_gathered(ch: _Chunk, n_sel: int, sinks, replay):
    """F with ``sparse_gather``, one row: blocks from the means, the decode kernel over them."""
    blocks = _stored_blocks(ch, n_sel, replay)
    out = sparse_decode(
        ch.q, ch.k, ch.v, ch.tables, blocks, ch.positions, ch.new_len, ch.cfg, ch.policy,
        keep=ch.keep, int8=ch.int8_parts(),
    )  # fmt: skip
    return ch.result(out, blocks)


def _gathered(ch: _Chunk, n_sel: int, sinks, replay):
    """F with ``sparse_gather``: attention over the selected blocks' keys only."""
    blocks = _stored_blocks(ch, n_sel, replay)
    pos, mask = gathered_mask(blocks, ch.positions, ch.new_len, ch.keep, ch.cfg.sparse_block_size)
    keys, vals = ch.read_at(pos, jnp.arange(blocks.shape[2])[None, None, :, None])
    out, p = gathered_attention(ch.q, keys, vals, mask, ch.policy)
    if "mass" not in ch.cache:
        return ch.result(out, blocks)
    got = gathered_mass(p, pos, ch.valid, ch.s)
    return ch.result(out, blocks, mass=ch.cache["mass"].at[ch.group].add(got))


def _decode_dense(ch: _Chunk, n_sel: int, sinks, replay):
    """D through the decode kernel."""
    return ch.result(_kernel_dense(ch)[:, None])


def _kernel_dense(ch: _Chunk) -> jax.Array:
    """D through the decode kernel: [B, N, H]. Without an int8 pool or ``keep``, one call over
    the first live pages; else one call per pool merged by log-sum-exp, each over only the
    pages of its pool that hold a visible key (``model.paged.pool_call``)."""
    q, lens, page = ch.q[:, 0], ch.new_len, ch.page
    impl = ch.policy.kernel_choice("paged_decode")
    shape = kernels.paged_decode_op_shape(q, ch.k, ch.tables)
    # the C++ kernel stops at each row's length by itself: no page buckets
    bucketed = kernel_impl(ch.policy, "paged_decode", shape) != "cpu"

    def kernel(k, v, scales, lse):  # (tables, lengths, kv_mask) -> the kernel on one pool
        return lambda t, ln, m: kernels.paged_decode_attention(
            q, k, v, t, ln, k_scales=scales[0], v_scales=scales[1], kv_mask=m, return_lse=lse,
            impl=impl,
        )  # fmt: skip

    if ch.int8 is None and ch.keep is None:  # every live page is visible: no key mask
        run = kernel(ch.k, ch.v, (None, None), False)
        fn = lambda n: run(ch.tables[:, :n], lens, None)  # noqa: E731
        return over_live_pages(fn, ch.tables, lens, page, bucketed)
    visible = ch.visible()

    def attend(k, v, tables, scales):
        return lambda vis, lse: pool_call(kernel(k, v, scales, lse), tables, vis, page, bucketed)

    attend_float = attend(ch.k, ch.v, ch.tables, (None, None))
    if ch.int8 is None:
        return two_pool_decode(attend_float, None, visible, None)
    i8 = ch.int8
    attend_int8 = attend(i8.k, i8.v, i8.tables, (i8.ks, i8.vs))
    return two_pool_decode(attend_float, attend_int8, visible, jnp.repeat(ch.use8, page, axis=1))


def _decode_sparse(ch: _Chunk, n_sel: int, sinks, replay: jax.Array | None):
    """F through the decode kernel: ``select_blocks`` on the live pages' keys (or ``replay``),
    then the kernel over the selected blocks (each pool's call over its own blocks only)."""
    cfg, q = ch.cfg, ch.q

    def select(n):  # over the first n pages: the live ones
        keys = ch.read_context(n)[0]
        idx = select_blocks(
            q,
            keys,
            block_size=cfg.sparse_block_size,
            topk_blocks=cfg.sparse_topk_blocks,
            q_positions=ch.positions,
            k_valid=ch.visible(n),
        )
        return fit_blocks(idx, n_sel)  # fewer blocks than the full width: unused (-1)

    if replay is not None:
        idx = fit_blocks(replay, n_sel)
    else:
        idx = over_live_pages(select, ch.tables, ch.new_len, ch.page)
    out = sparse_decode(
        q, ch.k, ch.v, ch.tables, idx, ch.positions, ch.new_len, cfg, ch.policy,
        keep=ch.keep, int8=ch.int8_parts(),
    )  # fmt: skip
    return ch.result(out, idx)


# Page buckets of a dense prefill chunk's keys (``_live_dense``): each bucket is one branch of
# a ``lax.switch`` compiled into every layer, so they are coarse (powers of two).
PREFILL_BUCKET_RATIO = 2.0


def _live_dense(ch: _Chunk, n_sel: int, sinks, replay):
    """D, masked, over the live pages only. A chunk's keys end at the longest slot's length, so
    attention costs follow the context held rather than ``max_len`` (a prefill into a large
    cache). Another key count sums in another order, so parity policies, whose trainer pass
    must match bitwise, keep the whole width (``_masked``)."""

    def attend(n):
        keys, vals = ch.read_context(n)
        kpos = jnp.arange(n * ch.page)
        mask = ch.visible(n)[:, None, :] & (kpos[None, None, :] <= ch.positions[:, :, None])
        b, c = ch.q.shape[:2]
        mask = jnp.broadcast_to(mask[:, :, None, :], (b, c, ch.cfg.n_kv_heads, n * ch.page))
        return masked_attention(ch.q, keys, vals, mask, ch.policy, sinks=sinks)

    out = over_live_pages(attend, ch.raw, ch.new_len, ch.page, ratio=PREFILL_BUCKET_RATIO)
    return ch.result(out)


def _masked(ch: _Chunk, n_sel: int, sinks, replay):
    """The whole context gathered and masked (F: to the selected blocks); optionally the
    attention mass each position receives."""
    cfg, q, positions, kind = ch.cfg, ch.q, ch.positions, ch.kind
    b, c = q.shape[:2]
    keys, vals = ch.read_context()
    kpos = jnp.arange(ch.s)
    k_valid = ch.visible()  # eviction replay: only keys still held
    mask = k_valid[:, None, :] & (kpos[None, None, :] <= positions[:, :, None])  # [B,C,S]
    mask = jnp.broadcast_to(mask[:, :, None, :], (b, c, cfg.n_kv_heads, ch.s))
    idx = None
    if kind == "F":
        if replay is not None:
            idx = fit_blocks(replay, n_sel)
        else:
            idx = select_blocks(
                q,
                keys,
                block_size=cfg.sparse_block_size,
                topk_blocks=cfg.sparse_topk_blocks,
                q_positions=positions,
                k_valid=k_valid,
            )
        kblock = kpos // cfg.sparse_block_size
        sel = jnp.any(idx[..., None] == kblock, axis=-2)  # [B, C, K, S]
        mask = mask & sel
    if "mass" not in ch.cache:
        return ch.result(masked_attention(q, keys, vals, mask, ch.policy, sinks=sinks), idx)
    # rollout KV eviction: accumulate the attention mass each cached position receives
    # from valid queries (mean over heads); same numbers as without it
    out, p = masked_attention(q, keys, vals, mask, ch.policy, return_probs=True, sinks=sinks)
    w = ch.valid.astype(jnp.float32)[:, :, None, None, None]
    got = jnp.sum(p.astype(jnp.float32) * w, axis=(1, 2, 3)) / (p.shape[2] * p.shape[3])
    return ch.result(out, idx, mass=ch.cache["mass"].at[ch.group].add(got))


# ``model.dispatch.PATHS``' cached paths of F/D layers: (chunk, n_sel, sinks, replay) -> result.
_PATHS = {
    "decode_dense": _decode_dense,
    "decode_gathered": _decode_gathered,
    "gathered": _gathered,
    "decode_sparse": _decode_sparse,
    "live_dense": _live_dense,
    "masked": _masked,
}
