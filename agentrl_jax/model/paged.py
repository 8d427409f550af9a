"""Paged-pool helpers of the chunked attention path: int8 pages, pool reads, the decode kernel.

Legend: B batch, S key time, P pages, P8 int8 pages, L page size, K kv heads, H head dim,
N query heads, G query heads per kv head, J logical pages per sequence (max_pages).

int8 pages (``model.attention`` module docstring): a logical page whose tokens are all int8
(their ``int8_at`` decisions in effect) and which has an int8 page assigned
(``int8_tables[b, j] >= 0``) is read from the int8 pool: codes int8 [P8, L, K, H] and one f32
scale per (page, kv head) for keys and for values. The dequantised value
``(codes.f32 * scale).astype(float dtype)`` is bitwise the value ``kv_quant.fake_quant_pages``
leaves in the float page, so where a page is read from (its float page, or its int8 page once
the float page is freed) never changes a number. Pages partly int8 keep their float page (the
int8 tokens' dequantised values in it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.dispatch import kernel_impl
from agentrl_jax.model.kv_quant import fake_quant_pages, quantize_pages
from agentrl_jax.precision import DTypePolicy

_NEVER = jnp.iinfo(jnp.int32).max  # int8_at of a token never compressed


class Int8Pool(NamedTuple):
    """One paged layer's int8 pool in flat page ids (stacked groups flattened).

    Attributes:
      k, v: int8 [P8, L, K, H] codes.
      ks, vs: f32 [P8, K] scales.
      tables: int32 [B, J] int8 page of each logical page (-1: none), flat ids.
    """

    k: jax.Array
    v: jax.Array
    ks: jax.Array
    vs: jax.Array
    tables: jax.Array


def int8_page_update(
    pool_k: jax.Array,
    pool_v: jax.Array,
    tables: jax.Array,
    int8_at: jax.Array,
    lengths: jax.Array,
    new_len: jax.Array,
    int8: Int8Pool | None = None,
) -> tuple:
    """Applies the int8 decisions that take effect in this chunk to the paged pools in place.

    A token ``p`` with ``lengths[b] <= int8_at[b, p] < new_len[b]`` (its decision position lies
    in this chunk) makes its logical page be re-quantised: every token of that page with
    ``int8_at < new_len`` (old and new int8 tokens) is replaced by its int8 round trip with the
    page's scale (``kv_quant.fake_quant_pages``); other pages are untouched. Exactly one chunk of
    a sequence contains a given position, so each decision is applied once, in the rollout as in
    the trainer's chunked pass (which is what makes replay bitwise). A re-quantised page whose
    tokens are now all int8 and which has an int8 page also gets its codes and scales written
    there (``int8``). Skipped (``lax.cond``) when no decision falls in the chunk.

    Args:
      pool_k, pool_v: [P, L, K, H] pools (after this chunk's keys were written).
      tables: int32 [B, J] block tables (-1: no page; never written).
      int8_at: int32 [B, S] with S = J * L; int32 max = never int8.
      lengths, new_len: int32 [B] tokens cached before / after this chunk.
      int8: the layer's int8 pool, or None (float pages only).

    Returns:
      The updated (pool_k, pool_v), and the updated int8 pool when ``int8`` is given.
    """
    n_pages, page = pool_k.shape[:2]
    b, s = int8_at.shape
    now = (int8_at >= lengths[:, None]) & (int8_at < new_len[:, None])

    def update(pools):
        pool_k, pool_v, int8 = pools
        mark = int8_at < new_len[:, None]
        hit_page = jnp.any(now.reshape(b, s // page, page), axis=2)  # [B, J]
        hit = jnp.repeat(hit_page, page, axis=1)
        page_ids = jnp.repeat(tables, page, axis=1)  # [B, S]
        dst = jnp.where(mark & hit & (page_ids >= 0), page_ids, n_pages)  # n_pages: dropped
        slot = jnp.broadcast_to(jnp.arange(s) % page, (b, s))
        safe = jnp.maximum(tables, 0)
        out, xs = [], []
        for pool in (pool_k, pool_v):
            x = pool[safe].reshape(b, s, *pool.shape[2:])
            xs.append(x)
            out.append(pool.at[dst, slot].set(fake_quant_pages(x, mark, page), mode="drop"))
        if int8 is not None:
            full = jnp.all(mark.reshape(b, s // page, page), axis=2)
            dst8 = jnp.where(hit_page & full & (int8.tables >= 0), int8.tables, int8.k.shape[0])
            new = []
            for x in xs:
                codes, scale = quantize_pages(x, mark, page)
                new.append(codes.reshape(b, s // page, page, *x.shape[2:]))
                new.append(scale)
            k8, ks, v8, vs = new
            int8 = int8._replace(
                k=int8.k.at[dst8].set(k8, mode="drop"),
                v=int8.v.at[dst8].set(v8, mode="drop"),
                ks=int8.ks.at[dst8].set(ks, mode="drop"),
                vs=int8.vs.at[dst8].set(vs, mode="drop"),
            )
        return (*out, int8)

    new = jax.lax.cond(jnp.any(now), update, lambda pools: pools, (pool_k, pool_v, int8))
    return new[:2] if int8 is None else new


def int8_pages_read(int8: Int8Pool, int8_at: jax.Array, new_len: jax.Array) -> jax.Array:
    """bool [B, J]: logical pages read from the int8 pool in this chunk (an int8 page assigned
    and every token's int8 decision in effect by ``new_len``). int8_at int32 [B, J * L]."""
    b, s = int8_at.shape
    page = s // int8.tables.shape[1]
    full = jnp.all((int8_at < new_len[:, None]).reshape(b, s // page, page), axis=2)
    return full & (int8.tables >= 0)


def read_pages(
    pool: jax.Array,
    safe: jax.Array,
    codes: jax.Array | None = None,
    scales: jax.Array | None = None,
    safe8: jax.Array | None = None,
    use8: jax.Array | None = None,
) -> jax.Array:
    """Every position of the given pages: pool [P, L, K, H], safe int32 [B, J] (valid flat page
    ids) -> [B, J * L, K, H]; with ``codes`` int8 [P8, L, K, H], ``scales`` f32 [P8, K],
    ``safe8`` int32 [B, J] and ``use8`` bool [B, J] the pages marked in ``use8`` come from the
    int8 pool, dequantised to ``pool.dtype``."""
    b, j = safe.shape
    x = pool[safe]
    if codes is not None:
        deq = (codes[safe8].astype(jnp.float32) * scales[safe8][:, :, None, :, None]).astype(
            pool.dtype
        )
        x = jnp.where(use8[:, :, None, None, None], deq, x)
    return x.reshape(b, j * pool.shape[1], *pool.shape[2:])


def read_tokens(
    pool: jax.Array,
    tables: jax.Array,
    pos: jax.Array,
    heads: jax.Array,
    codes: jax.Array | None = None,
    scales: jax.Array | None = None,
    int8: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One kv head's K or V at absolute positions.

    Args:
      pool: [P, L, K, H] float pool.
      tables: int32 [B, J] flat page ids (-1: none; such positions must be masked by callers).
      pos: int32 [B, ...] positions in [0, J * L).
      heads: int32 broadcastable to ``pos``: the kv head read at each position.
      codes, scales: the int8 pool (int8 [P8, L, K, H], f32 [P8, K]) or None.
      int8: (int8 tables int32 [B, J], pages read from int8 bool [B, J]) with ``codes``.

    Returns:
      [B, ..., H] in ``pool.dtype``.
    """
    page_size = pool.shape[1]
    bidx = jnp.arange(pos.shape[0]).reshape(-1, *([1] * (pos.ndim - 1)))
    page, slot = pos // page_size, pos % page_size
    x = pool[jnp.maximum(tables[bidx, page], 0), slot, heads]
    if codes is not None:
        tables8, use8 = int8
        p8 = jnp.maximum(tables8[bidx, page], 0)
        deq = (codes[p8, slot, heads].astype(jnp.float32) * scales[p8, heads][..., None]).astype(
            pool.dtype
        )
        x = jnp.where(use8[bidx, page][..., None], deq, x)
    return x


def int8_decisions(meta: dict, policy: DTypePolicy, s: int, page: int) -> jax.Array | None:
    """int32 [B, S] int8 decision positions of a paged layer, or None when nothing is int8.

    Recorded decisions come in ``meta['int8_at']``; a ``kv_cache_dtype='int8'`` policy adds one
    for every token: its page's end (a page is quantised once the next page starts).
    """
    i8 = meta.get("int8_at")
    if i8 is not None and i8.shape[1] < s:
        i8 = jnp.pad(i8, ((0, 0), (0, s - i8.shape[1])), constant_values=_NEVER)
    if policy.kv_cache_dtype == "int8":
        page_end = ((jnp.arange(s) // page + 1) * page).astype(jnp.int32)[None, :]
        i8 = page_end if i8 is None else jnp.minimum(i8, page_end)
        i8 = jnp.broadcast_to(i8, (meta["lengths"].shape[0], s))
    return i8


POOL_BUCKET_RATIO = 2.0  # page-count buckets of the compacted per-pool calls (pool_call)


def pool_call(call, tables: jax.Array, visible: jax.Array, page: int, bucketed: bool = True):
    """``call(tables, lengths, kv_mask)`` of the paged decode kernel over only the pages of
    ``tables`` (int32 [..., J]) that hold a key of ``visible`` (bool [..., J * page]).

    The pages are compacted to the front (``kernels.compact_pages``) and the call gets the
    first ``n`` of them, ``n`` the smallest bucket (:func:`page_buckets`, each about half the
    next: one compiled kernel call per bucket and pool, and buckets 1.25x apart compiled about
    twice as long for the same decode time) holding every row's: the kernel reads one pool's
    pages only, and the XLA path gathers ``n`` pages, not J. ``bucketed`` false: one call
    over all J (the C++ kernel stops at each row's length by itself).
    """
    t, lengths, mask, pages = kernels.compact_pages(tables, visible, page)
    fn = lambda n: call(t[..., :n], lengths, mask[..., : n * page])  # noqa: E731
    if not bucketed:
        return fn(tables.shape[-1])
    return over_page_buckets(fn, pages, tables.shape[-1], POOL_BUCKET_RATIO)


def two_pool_decode(attend_float, attend_int8, visible: jax.Array | None, use8: jax.Array | None):
    """Decode attention over a float pool and an int8 pool, merged by log-sum-exp.

    ``attend_float(visible, return_lse)`` / ``attend_int8(...)`` call the paged decode kernel
    on one pool for the keys of a per-token mask (bool [..., S]; :func:`pool_call` reads only
    the pages holding them). Without an int8 pool (``attend_int8`` None) one float call with
    ``visible``; else the float call gets the visible tokens of pages not in ``use8`` (bool
    [..., S], per token), the int8 call those in it, and ``kernels.combine_attention`` merges
    them (the softmax over the union). Returns the output (float32 when merged).
    """
    if attend_int8 is None:
        return attend_float(visible, False)
    visible = jnp.ones_like(use8) if visible is None else visible
    f_out, f_lse = attend_float(visible & ~use8, True)
    i_out, i_lse = attend_int8(visible & use8, True)
    return kernels.combine_attention([f_out, i_out], [f_lse, i_lse])[0]


def sparse_decode(
    q, pool_k, pool_v, tables, idx, positions, new_len, cfg, policy, keep=None, int8=None
):
    """One-token sparse attention over the selected blocks through the paged decode kernel.

    q [B, 1, N, H]; pools [P, L, K, H]; tables int32 [B, max_pages]; idx int32 [B, 1, K, n_sel]
    selected blocks (-1 unused; the own block always selected); positions, new_len int32 [B, 1],
    [B]; keep: optional bool [B, max_pages * L] keys still held (eviction); int8: optional
    (Int8Pool with tables [B, max_pages], use8 bool [B, max_pages]): pages read from the int8
    pool (:func:`two_pool_decode`). Each pool's call visits only its own selected blocks that
    hold a visible key (:func:`pool_call`, blocks of ``sparse_block_size`` tokens as pages);
    without either, one call over the first used blocks (bucketed by their count).
    Returns [B, 1, N, H] in the compute dtype. See the module docstring.
    """
    b, _, n, h = q.shape
    page = pool_k.shape[1]
    bs, kh = cfg.sparse_block_size, cfg.n_kv_heads
    per_page = page // bs
    sel = idx[:, 0]  # [B, K, n_sel]
    big = jnp.iinfo(jnp.int32).max
    sel = jnp.sort(jnp.where(sel < 0, big, sel), axis=-1)  # ascending, unused last
    used = sel != big
    sel = jnp.where(used, sel, 0)
    slot = jnp.clip(sel // per_page, 0, tables.shape[1] - 1)  # [B, K, n_sel] logical page

    def block_ids(t):  # block (of bs tokens) of each selected block in a pool with tables t
        page_ids = jnp.take_along_axis(t[:, None, :], slot, axis=2)
        return jnp.where(used, jnp.maximum(page_ids, 0) * per_page + sel % per_page, 0)

    own = positions[:, 0] // bs  # [B]
    n_used = jnp.sum(used, axis=-1)  # [B, K]
    vlen = (n_used - 1) * bs + (new_len - own * bs)[:, None]
    vlen = jnp.clip(vlen, 0, sel.shape[-1] * bs).astype(jnp.int32)
    qg = q[:, 0].reshape(b, kh, n // kh, h)
    vshape = (b, kh, sel.shape[-1] * bs)  # the virtual sequence: selected blocks in order
    visible = jnp.arange(vshape[2]) < vlen[..., None]  # [B, K, n_sel * bs]
    if keep is not None:
        vpos = (sel[..., None] * bs + jnp.arange(bs)).reshape(vshape)
        visible &= jnp.take_along_axis(keep[:, None, :], vpos, axis=2)
    use8 = None
    if int8 is not None:
        use8 = jnp.repeat(jnp.take_along_axis(int8[1][:, None, :], slot, axis=2), bs, axis=2)

    impl = policy.kernel_choice("paged_decode")
    native = kernel_impl(
        policy, "paged_decode", kernels.paged_decode_op_shape(q[:, 0], pool_k, tables)
    ) == "cpu"  # fmt: skip

    def attend(pk, pv, bt, scales):  # the kernel per kv head over one pool viewed as blocks
        blocks_of = lambda x: x.reshape(x.shape[0] * per_page, bs, kh, h)  # noqa: E731 (free)
        kb, vb = blocks_of(pk), blocks_of(pv)
        sc = None if scales is None else [jnp.repeat(x, per_page, axis=0) for x in scales]
        if native:  # the C++ kernel takes a block table per kv head: one call, no buckets
            kw = {} if sc is None else dict(k_scales=sc[0], v_scales=sc[1])

            def run_native(t, ln, m, return_lse):  # [B, K, n], [B, K], [B, K, n * bs]
                return kernels.paged_decode_attention_cpu(
                    q[:, 0], kb, vb, t, ln, kv_mask=m, return_lse=return_lse, **kw
                )

            if keep is None and int8 is None:  # the used blocks lead, in order: no key mask
                return lambda vis, return_lse: run_native(block_ids(bt), vlen, None, return_lse)

            def call_native(vis, return_lse):
                fn = lambda t, ln, m: run_native(t, ln, m, return_lse)  # noqa: E731
                return pool_call(fn, block_ids(bt), vis, bs, bucketed=False)

            return call_native

        def run(t, ln, m, return_lse):  # blocks [B, K, n], lengths [B, K], mask [B, K, n * bs]
            def one_head(qk, kp, vp, bt, ln, m, s):  # [B, G, H], [Pb, bs, H] x2, [B, n] ...
                kw = {} if s is None else dict(k_scales=s[0][:, None], v_scales=s[1][:, None])
                return kernels.paged_decode_attention(
                    qk, kp[:, :, None], vp[:, :, None], bt, ln, kv_mask=m,
                    return_lse=return_lse, impl=impl, **kw,
                )  # fmt: skip

            args = (qg, kb, vb, t, ln, m, sc)
            axes = (1, 2, 2, 1, 1, None if m is None else 1, None if sc is None else 1)
            shape = kernels.paged_decode_op_shape(qg[:, 0], kb[:, :, :1], t[:, 0])
            if kernel_impl(policy, "paged_decode", shape) != "xla":
                return jax.vmap(one_head, in_axes=axes, out_axes=1)(*args)

            # XLA: one call per kv head (unrolled at trace time). Under vmap XLA CPU gathered
            # all heads' blocks into one batched operand and copied the keys transposed for a
            # batched matmul; per head it gathers plain [n * bs, H] rows.
            def of_head(i):  # head i's arguments: vmap's in_axes applied by hand
                index = lambda a, x: jax.tree.map(lambda y: y.take(i, a), x)  # noqa: E731
                return jax.tree.map(index, axes, args)

            heads = [one_head(*of_head(i)) for i in range(kh)]
            return jax.tree.map(lambda *per_head: jnp.stack(per_head, axis=1), *heads)

        if keep is None and int8 is None:  # the used blocks lead, in order: no key mask
            ids = block_ids(bt)
            fn = lambda n: run(ids[..., :n], vlen, None, False)  # noqa: E731
            return lambda vis, return_lse: over_page_buckets(fn, n_used, ids.shape[-1])

        def call(vis, return_lse):
            fn = lambda t, ln, m: run(t, ln, m, return_lse)  # noqa: E731
            return pool_call(fn, block_ids(bt), vis, bs)

        return call

    attend_int8 = None
    if int8 is not None:
        pool8 = int8[0]
        attend_int8 = attend(pool8.k, pool8.v, pool8.tables, (pool8.ks, pool8.vs))
    out = two_pool_decode(attend(pool_k, pool_v, tables, None), attend_int8, visible, use8)
    return out.reshape(b, 1, n, h).astype(policy.compute)


def page_buckets(max_pages: int, ratio: float = 1.25) -> tuple[int, ...]:
    """Static page counts the decode kernel path is compiled for: ``max_pages`` and smaller
    ones, each about ``ratio`` below the next, down to 1 (ascending)."""
    sizes, n = {max_pages}, max_pages
    while n > 1:
        n = max(1, min(n - 1, int(n / ratio)))
        sizes.add(n)
    return tuple(sorted(sizes))


def over_page_buckets(fn, pages: jax.Array, max_pages: int, ratio: float = 1.25):
    """``fn(n)`` for the smallest bucket ``n`` (:func:`page_buckets` of ``max_pages`` and
    ``ratio``) >= every entry of ``pages`` (int32 [...]). One ``lax.switch`` branch per bucket
    (all compiled; the one taken is picked on device)."""
    sizes = page_buckets(max_pages, ratio)
    live = jnp.clip(jnp.max(pages), 1, sizes[-1])
    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), live.astype(jnp.int32))
    return jax.lax.switch(index, [lambda n=n: fn(n) for n in sizes])


def over_live_pages(
    fn,
    tables: jax.Array,
    new_len: jax.Array,
    page: int,
    bucketed: bool = True,
    ratio: float = 1.25,
):
    """``fn(n)`` for the smallest bucket ``n`` (:func:`page_buckets` with ``ratio``) holding
    every slot's pages.

    ``fn(n)`` may read only the first ``n`` block-table entries: pages past every slot's length
    are masked anyway, so decode cost follows the longest live slot instead of ``max_len``.
    ``bucketed`` false: ``fn`` of the whole table (a kernel that stops at the lengths itself).
    """
    if not bucketed:
        return fn(tables.shape[1])
    return over_page_buckets(fn, -(-new_len // page), tables.shape[1], ratio)
