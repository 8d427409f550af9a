"""Paged-pool helpers of the chunked attention path: int8 page updates and the decode kernel.

Legend: B batch, S key time, P pages, L page size, K kv heads, H head dim, N query heads,
G query heads per kv head.

See ``model.attention``'s module docstring for the KV compression hooks (``meta['int8_at']``)
and the decode-kernel path these functions implement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.kv_quant import fake_quant_pages
from agentrl_jax.precision import DTypePolicy

_NEVER = jnp.iinfo(jnp.int32).max  # int8_at of a token never compressed


def int8_page_update(
    pool_k: jax.Array,
    pool_v: jax.Array,
    tables: jax.Array,
    int8_at: jax.Array,
    lengths: jax.Array,
    new_len: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Applies the int8 decisions that take effect in this chunk to the paged pools in place.

    A token ``p`` with ``lengths[b] <= int8_at[b, p] < new_len[b]`` (its decision position lies
    in this chunk) makes its logical page be re-quantised: every token of that page with
    ``int8_at < new_len`` (old and new int8 tokens) is replaced by its int8 round trip with the
    page's scale (``kv_quant.fake_quant_pages``); other pages are untouched. Exactly one chunk of
    a sequence contains a given position, so each decision is applied once, in the rollout as in
    the trainer's chunked pass (which is what makes replay bitwise). Skipped (``lax.cond``) when
    no decision falls in the chunk.

    Args:
      pool_k, pool_v: [P, L, K, H] pools (after this chunk's keys were written).
      tables: int32 [B, max_pages] block tables (-1: no page; never written).
      int8_at: int32 [B, S] with S = max_pages * L; int32 max = never int8.
      lengths, new_len: int32 [B] tokens cached before / after this chunk.

    Returns:
      The updated (pool_k, pool_v).
    """
    n_pages, page = pool_k.shape[:2]
    b, s = int8_at.shape
    now = (int8_at >= lengths[:, None]) & (int8_at < new_len[:, None])

    def update(pools):
        mark = int8_at < new_len[:, None]
        hit = jnp.repeat(jnp.any(now.reshape(b, s // page, page), axis=2), page, axis=1)
        page_ids = jnp.repeat(tables, page, axis=1)  # [B, S]
        dst = jnp.where(mark & hit & (page_ids >= 0), page_ids, n_pages)  # n_pages: dropped
        slot = jnp.broadcast_to(jnp.arange(s) % page, (b, s))
        safe = jnp.maximum(tables, 0)
        out = []
        for pool in pools:
            x = pool[safe].reshape(b, s, *pool.shape[2:])
            out.append(pool.at[dst, slot].set(fake_quant_pages(x, mark, page), mode="drop"))
        return tuple(out)

    return jax.lax.cond(jnp.any(now), update, lambda pools: pools, (pool_k, pool_v))


def _int8_at(meta: dict, policy: DTypePolicy, s: int, page: int) -> jax.Array | None:
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


def _sparse_decode(q, pool_k, pool_v, tables, idx, positions, new_len, cfg, policy):
    """One-token sparse attention over the selected blocks through the paged decode kernel.

    q [B, 1, N, H]; pools [P, L, K, H]; tables int32 [B, max_pages]; idx int32 [B, 1, K, n_sel]
    selected blocks (-1 unused; the own block always selected); positions, new_len int32 [B, 1],
    [B]. Returns [B, 1, N, H] in the compute dtype. See the module docstring.
    """
    b, _, n, h = q.shape
    n_pages, page = pool_k.shape[:2]
    bs, kh = cfg.sparse_block_size, cfg.n_kv_heads
    per_page = page // bs
    sel = idx[:, 0]  # [B, K, n_sel]
    big = jnp.iinfo(jnp.int32).max
    sel = jnp.sort(jnp.where(sel < 0, big, sel), axis=-1)  # ascending, unused last
    used = sel != big
    sel = jnp.where(used, sel, 0)
    page_ids = jnp.take_along_axis(
        tables[:, None, :], jnp.clip(sel // per_page, 0, tables.shape[1] - 1), axis=2
    )
    blocks = jnp.where(used, jnp.maximum(page_ids, 0) * per_page + sel % per_page, 0)
    own = positions[:, 0] // bs  # [B]
    n_used = jnp.sum(used, axis=-1)  # [B, K]
    vlen = (n_used - 1) * bs + (new_len - own * bs)[:, None]
    vlen = jnp.clip(vlen, 0, sel.shape[-1] * bs).astype(jnp.int32)
    kb = pool_k.reshape(n_pages * per_page, bs, kh, h)  # pages of one key block (free reshape)
    vb = pool_v.reshape(n_pages * per_page, bs, kh, h)
    qg = q[:, 0].reshape(b, kh, n // kh, h)

    def one_head(qk, kp, vp, bt, ln):  # [B, G, H], [Pb, bs, H] x2, [B, n_sel], [B]
        return kernels.paged_decode_attention(
            qk, kp[:, :, None], vp[:, :, None], bt, ln, impl=policy.kernel_impl
        )

    out = jax.vmap(one_head, in_axes=(1, 2, 2, 1, 1), out_axes=1)(qg, kb, vb, blocks, vlen)
    return out.reshape(b, 1, n, h).astype(policy.compute)


def page_buckets(max_pages: int, ratio: float = 1.25) -> tuple[int, ...]:
    """Static page counts the decode kernel path is compiled for: ``max_pages`` and smaller
    ones, each about ``ratio`` below the next, down to 1 (ascending)."""
    sizes, n = {max_pages}, max_pages
    while n > 1:
        n = max(1, min(n - 1, int(n / ratio)))
        sizes.add(n)
    return tuple(sorted(sizes))


def over_live_pages(fn, tables: jax.Array, new_len: jax.Array, page: int):
    """``fn(n)`` for the smallest bucket ``n`` (:func:`page_buckets`) holding every slot's pages.

    ``fn(n)`` may read only the first ``n`` block-table entries: pages past every slot's length
    are masked anyway, so decode cost follows the longest live slot instead of ``max_len``. One
    ``lax.switch`` branch per bucket (all compiled; the one taken is picked on device).
    """
    sizes = page_buckets(tables.shape[1])
    live = jnp.clip(-(-jnp.max(new_len) // page), 1, sizes[-1])
    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), live.astype(jnp.int32))
    return jax.lax.switch(index, [lambda n=n: fn(n) for n in sizes])
