"""Single-token decode attention over a paged KV cache, with grouped-query heads.

Sequence ``b`` owns pages ``block_tables[b, 0 .. ceil(lengths[b] / page_size) - 1]`` of the
shared page pool; its new token attends to the first ``lengths[b]`` cached tokens, or only the
last ``window`` of them. Pages may be float32/bfloat16, or int8 with one float scale per page
and kv head (dequantised value = int8 * scale). ``lengths[b] == 0`` returns zeros.

An optional per-token ``kv_mask`` (bool [B, max_pages * page_size], by logical position) hides
further keys: evicted tokens, or the tokens whose page lives in another pool. With
``return_lse`` every implementation also returns the log-sum-exp of the visible scores per
(sequence, query head) and the output in float32, so calls over disjoint key sets (a float pool
and an int8 pool) merge exactly with :func:`combine_attention` (a row with nothing visible has
lse = -inf and output 0, and merges as an empty part). :func:`compact_pages` gives each such
call a block table of only the pages holding its keys, so it visits no other pool's pages.

Einsum legend: B batch, K kv heads, G query heads per kv head (N = K * G), H head dim,
S cached token (page-major: page j slot o is token j * page_size + o), T cached (token, kv head)
pair in page-pool order.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import (
    check_gqa,
    default_scale,
    masked_logsumexp,
    masked_softmax,
)
from agentrl_jax.kernels.paged_decode_cpu import paged_decode_attention_cpu
from agentrl_jax.kernels.paged_decode_pallas import paged_decode_attention_pallas
from agentrl_jax.kernels.paged_decode_tpu import paged_decode_attention_pallas_tpu
from agentrl_jax.kernels.select import OpShape, dtype_name, select_impl


def _validate(
    q, k_pages, v_pages, block_tables, lengths, window, k_scales, v_scales, kv_mask=None
) -> int:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D]; got {q.shape=}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages, v_pages must be [P, page_size, Hkv, D]; got {k_pages.shape=} "
            f"{v_pages.shape=}"
        )
    b, n, h = q.shape
    p, _, kh, hd = k_pages.shape
    if hd != h:
        raise ValueError(f"head dims differ: {q.shape=} {k_pages.shape=}")
    g = check_gqa(n, kh)
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, max_pages]; got {block_tables.shape=}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B={b}]; got {lengths.shape=}")
    for name, x in (("block_tables", block_tables), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got {x.dtype=}")
    if window is not None and (not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"{window=} must be None or an int >= 1")
    quantized = k_pages.dtype == jnp.int8
    if quantized != (v_pages.dtype == jnp.int8):
        raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype=} {v_pages.dtype=}")
    if quantized:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None or s.shape != (p, kh):
                shape = None if s is None else s.shape
                raise ValueError(f"int8 pages need {name} of shape [P={p}, Hkv={kh}]; got {shape}")
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"k_scales/v_scales are only for int8 pages; got {k_pages.dtype=}")
    if kv_mask is not None:
        want = (b, block_tables.shape[1] * k_pages.shape[1])
        if kv_mask.shape != want or kv_mask.dtype != jnp.bool_:
            raise ValueError(
                f"kv_mask must be bool [B, max_pages * page_size] = {want}; got "
                f"{kv_mask.shape=} {kv_mask.dtype=}"
            )
    return g


def _mask(pos: jax.Array, lengths: jax.Array, window: int | None) -> jax.Array:
    """[B, S] visibility of cached positions ``pos`` ([B, S] or [S])."""
    lengths = lengths[:, None]
    mask = pos < lengths
    if window is not None:
        mask &= pos >= lengths - window
    return mask


def _finish(out: jax.Array, lse: jax.Array, dtype, return_lse: bool):
    """(out fp32, lse) when ``return_lse``, else out cast to ``dtype``."""
    return (out, lse) if return_lse else out.astype(dtype)


def combine_attention(
    outs: Sequence[jax.Array], lses: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Merges attention over disjoint key sets from their normalised outputs and log-sum-exps.

    ``o = sum_i o_i * exp(lse_i - lse)`` with ``lse = logsumexp_i lse_i``: exactly the softmax
    over the union of the key sets. Parts with lse = -inf (nothing visible) weigh 0; a row that
    sees nothing in any part gets output 0 and lse -inf (no NaN).

    Args:
      outs: outputs [..., D] (any float dtype; merged in float32), one per part.
      lses: float32 log-sum-exps [...], one per part (``return_lse=True``).

    Returns:
      (out float32 [..., D], lse float32 [...]).

    Raises:
      ValueError: if ``outs`` is empty or the parts' counts or shapes differ.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(f"combine_attention needs as many lses as outs (>= 1); got "
                         f"{len(outs)=} {len(lses)=}")  # fmt: skip
    for o, lse in zip(outs, lses, strict=True):
        if o.shape[:-1] != lses[0].shape or lse.shape != lses[0].shape:
            raise ValueError(f"parts must share shapes: {o.shape=} {lse.shape=}")
    lse = jnp.stack([x.astype(jnp.float32) for x in lses])  # [I, ...]
    m = jnp.max(lse, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty parts
    den = jnp.sum(w, axis=0)
    seen = den > 0
    w = w / jnp.where(seen, den, 1.0)
    out = sum(w[i][..., None] * o.astype(jnp.float32) for i, o in enumerate(outs))
    return out, jnp.where(seen, m_safe + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)


def compact_pages(
    block_tables: jax.Array, visible: jax.Array, page_size: int, *, pad_id: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each row's pages holding a visible key, moved to the front in logical order.

    Decode attention over the result (``block_tables=tables[..., :n]``, ``lengths``,
    ``kv_mask=kv_mask[..., :n * page_size]`` for any ``n >= max(pages)``) equals attention over
    the input table with ``kv_mask=visible``: the same keys, in the same order, but a kernel
    visits only ``pages`` page slots (the Pallas kernels stop at ``lengths``; the XLA path
    gathers ``n``). Pages with no visible key (another pool's, fully evicted, past the length)
    are not visited. Positions in the compacted table are not logical positions: apply a
    window to ``visible`` first and call the kernel without one.

    Args:
      block_tables: integer [..., J] page ids by logical page.
      visible: bool [..., J * page_size] keys that may be attended, by logical position
        (callers fold the sequence length and any window in).
      page_size: tokens per page, >= 1.
      pad_id: page id past the pages of a row that has none (a valid id; never read
        unmasked). Rows with pages repeat their first one there: a padded slot that a kernel
        still loads (the XLA path's bucket tail) holds a page the call reads anyway.

    Returns:
      (tables int32 [..., J], lengths int32 [...] = pages * page_size, kv_mask bool
      [..., J * page_size], pages int32 [...]: page slots holding a visible key).

    Raises:
      ValueError: if ``visible`` is not bool [..., J * page_size] or page_size < 1.
    """
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")
    j = block_tables.shape[-1]
    want = (*block_tables.shape[:-1], j * page_size)
    if visible.shape != want or visible.dtype != jnp.bool_:
        raise ValueError(f"visible must be bool {want}; got {visible.shape=} {visible.dtype=}")
    lead = block_tables.shape[:-1]
    by_page = visible.reshape(-1, j, page_size)  # rows flattened: R = prod(lead)
    member = jnp.any(by_page, axis=-1)  # [R, J]
    pages = jnp.sum(member, axis=-1, dtype=jnp.int32)
    # each member page's slot in the compacted table (J: dropped); a scatter is cheaper
    # than sorting on CPU
    dest = jnp.where(member, jnp.cumsum(member, axis=-1, dtype=jnp.int32) - 1, j)
    rows = jnp.arange(member.shape[0])[:, None]
    tables = jnp.full(member.shape, pad_id, jnp.int32)
    tables = tables.at[rows, dest].set(block_tables.reshape(-1, j).astype(jnp.int32), mode="drop")
    inside = jnp.arange(j) < pages[:, None]
    tables = jnp.where(inside, tables, jnp.where(pages[:, None] > 0, tables[:, :1], pad_id))
    mask = jnp.zeros_like(by_page).at[rows, dest].set(by_page, mode="drop")
    tables, pages = tables.reshape(block_tables.shape), pages.reshape(lead)
    return tables, pages * page_size, mask.reshape(want), pages


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """fp32 reference: gathers every page in the block table, dequantises, masks.

    Args:
      q: [B, Hq, D] one query token per sequence.
      k_pages: [P, page_size, Hkv, D] key page pool (float32, bfloat16 or int8).
      v_pages: [P, page_size, Hkv, D] value page pool, same dtype as k_pages.
      block_tables: int32 [B, max_pages] page ids; entries past a sequence's pages are ignored.
      lengths: int32 [B] cached tokens per sequence, 0 .. max_pages * page_size.
      window: if set, attend only to the last ``window`` cached tokens.
      k_scales: [P, Hkv] float scales, required iff pages are int8.
      v_scales: [P, Hkv] float scales, required iff pages are int8.
      kv_mask: optional bool [B, max_pages * page_size]: keys (by logical position) that may
        be attended, on top of ``lengths`` and ``window``.
      softmax_scale: logit scale; default 1/sqrt(D).
      return_lse: also return the log-sum-exp of the visible logits.

    Returns:
      [B, Hq, D] in q.dtype; zeros where no key is visible. With ``return_lse``:
      (out float32 [B, Hq, D], lse float32 [B, Hq], -inf where no key is visible).

    Raises:
      ValueError: on inconsistent shapes/dtypes, missing or superfluous scales, window < 1, a
        kv_mask that is not bool [B, max_pages * page_size].
    """
    g = _validate(q, k_pages, v_pages, block_tables, lengths, window, k_scales, v_scales, kv_mask)
    b, n, h = q.shape
    num_pages, ps, kh, _ = k_pages.shape
    bt = jnp.clip(block_tables, 0, num_pages - 1)
    k = k_pages[bt].astype(jnp.float32)  # [B, max_pages, ps, K, H]
    v = v_pages[bt].astype(jnp.float32)
    if k_scales is not None:
        k = k * k_scales[bt][:, :, None, :, None].astype(jnp.float32)
        v = v * v_scales[bt][:, :, None, :, None].astype(jnp.float32)
    k = k.reshape(b, -1, kh, h)
    v = v.reshape(b, -1, kh, h)
    qg = q.astype(jnp.float32).reshape(b, kh, g, h)
    logits = jnp.einsum("BKGH,BSKH->BKGS", qg, k) * default_scale(h, softmax_scale)
    mask = _mask(jnp.arange(k.shape[1]), lengths, window)
    if kv_mask is not None:
        mask &= kv_mask
    p = masked_softmax(logits, mask[:, None, None, :])
    out = jnp.einsum("BKGS,BSKH->BKGH", p, v).reshape(b, n, h)
    lse = masked_logsumexp(logits, mask[:, None, None, :]).reshape(b, n)
    return _finish(out, lse, q.dtype, return_lse)


def paged_decode_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """XLA implementation: gathers pages (only the window's pages when ``window`` is set).

    Pages are gathered as whole contiguous rows and used in their natural [token, kv head]
    layout: T = S * K columns, every query head scored against every kv head's keys (one plain
    batched matmul, no transpose of the gathered K/V), and the other heads' columns masked out
    of the softmax, so their probabilities are exactly 0 in the value matmul. This costs K times
    the (small) matmul flops of a per-kv-head contraction and saves the gather-transpose copy;
    on CPU it is the faster layout for the few kv heads of the models here. int8 pages are
    multiplied into the logits / probabilities by their per-page scale instead of dequantising
    the gathered values. Shapes as :func:`paged_decode_attention_reference`.
    """
    g = _validate(q, k_pages, v_pages, block_tables, lengths, window, k_scales, v_scales, kv_mask)
    b, n, h = q.shape
    num_pages, ps, kh, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    lengths = lengths.astype(jnp.int32)
    if window is None:
        n_pages = max_pages
        first = jnp.zeros((b,), jnp.int32)
    else:
        n_pages = min(max_pages, -(-window // ps) + 1)
        first = jnp.clip((lengths - window) // ps, 0, max_pages - n_pages)
    page_slots = first[:, None] + jnp.arange(n_pages)  # [B, n_pages]
    bt = jnp.take_along_axis(block_tables.astype(jnp.int32), page_slots, axis=1)
    bt = jnp.clip(bt, 0, num_pages - 1)
    compute = q.dtype
    t = n_pages * ps * kh  # T: (page, slot, kv head) flattened, the pool's own order

    def gather(pages: jax.Array) -> jax.Array:  # [B, T, H], one contiguous row per page
        # bt is clipped above: no out-of-bounds fill (a select per gathered element)
        rows = jnp.take(pages.reshape(num_pages, -1), bt, axis=0, mode="clip")
        return rows.reshape(b, t, h).astype(compute)

    # [B, K, G, n_pages, ps, J]: query head (K, G) against kv head J's key at token (page, slot)
    logits = jnp.einsum("BNH,BTH->BNT", q, gather(k_pages), preferred_element_type=jnp.float32)
    logits = logits.reshape(b, kh, g, n_pages, ps, kh)
    if k_scales is not None:  # one scale per (page, kv head): scale the page's logits
        logits = logits * k_scales[bt].astype(jnp.float32)[:, None, None, :, None, :]
    logits = logits * default_scale(h, softmax_scale)
    pos = (page_slots[:, :, None] * ps + jnp.arange(ps)).reshape(b, n_pages * ps)
    visible = _mask(pos, lengths, window)
    if kv_mask is not None:  # the gathered pages' tokens (pos < max_pages * ps)
        visible &= jnp.take_along_axis(kv_mask, pos, axis=1)
    visible = visible.reshape(b, 1, 1, n_pages, ps, 1)
    own_head = (jnp.arange(kh)[:, None] == jnp.arange(kh)).reshape(1, kh, 1, 1, 1, kh)
    mask = (visible & own_head).reshape(b, kh, 1, t)
    p = masked_softmax(logits.reshape(b, kh, g, t), mask).reshape(logits.shape)
    if v_scales is not None:
        p = p * v_scales[bt].astype(jnp.float32)[:, None, None, :, None, :]
    p = p.reshape(b, n, t).astype(compute)
    out = jnp.einsum("BNT,BTH->BNH", p, gather(v_pages), preferred_element_type=jnp.float32)
    lse = masked_logsumexp(logits.reshape(b, kh, g, t), mask) if return_lse else None
    return _finish(out, None if lse is None else lse.reshape(b, n), q.dtype, return_lse)


def op_shape(q: jax.Array, k_pages: jax.Array, block_tables: jax.Array) -> OpShape:
    """The static facts ``select_impl`` decides on."""
    b, n, h = q.shape
    kh = k_pages.shape[2]
    return OpShape(
        head_dim=h,
        group=n // kh,
        dtype=dtype_name(q),
        batch=b,
        kv_heads=kh,
        page_size=k_pages.shape[1],
        max_pages=block_tables.shape[1],
    )


@functools.partial(
    jax.jit, static_argnames=("window", "softmax_scale", "return_lse", "impl", "interpret")
)
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    interpret: bool | Any = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of one new token per sequence against its paged KV cache.

    Args:
      q: [B, Hq, D] queries (float32 or bfloat16).
      k_pages: [P, page_size, Hkv, D] key page pool: float32, bfloat16, or int8 with scales.
      v_pages: [P, page_size, Hkv, D] value page pool, same dtype as k_pages.
      block_tables: int32 [B, max_pages] page ids owned by each sequence, in token order.
      lengths: int32 [B] cached tokens per sequence, 0 .. max_pages * page_size.
      window: if set (>= 1), attend only to the last ``window`` cached tokens.
      k_scales: [P, Hkv] float dequantisation scales, required iff pages are int8.
      v_scales: [P, Hkv] float dequantisation scales, required iff pages are int8.
      kv_mask: optional bool [B, max_pages * page_size]: which keys (by logical position
        ``slot * page_size + offset``) may be attended, on top of ``lengths`` and ``window``.
      softmax_scale: logit scale; default 1/sqrt(D).
      return_lse: also return the log-sum-exp of the visible logits, for
        :func:`combine_attention`.
      impl: 'xla', 'pallas' (split-K generic kernel gathering pages through the block table:
        Triton on GPU, interpret mode on CPU), 'pallas_tpu' (scalar-prefetch Mosaic kernel:
        the block table drives the page DMAs), 'cpu' (the C++ kernel of
        ``paged_decode_cpu``: pages read in place, no gathered copy; CPU backend), 'reference'
        or 'auto' (``select.TABLE``: the Triton kernel on GPU and the Mosaic one on TPU where
        they fit, else XLA; the C++ kernel on CPU where it builds, else XLA).
      interpret: run the Pallas kernel in interpret mode (CPU testing): True, or for
        'pallas_tpu' also ``pltpu.InterpretParams()`` (TPU semantics).

    Returns:
      [B, Hq, D] in q.dtype; float32 softmax/accumulation; zeros where no key is visible
      (lengths[b] == 0 or all masked). With ``return_lse``: (out float32 [B, Hq, D], lse
      float32 [B, Hq], -inf where no key is visible).

    Raises:
      ValueError: on inconsistent shapes/dtypes, missing or superfluous scales, window < 1, a
        kv_mask that is not bool [B, max_pages * page_size], or an unknown impl.
    """
    _validate(q, k_pages, v_pages, block_tables, lengths, window, k_scales, v_scales, kv_mask)
    impl = select_impl("paged_decode", impl, op_shape(q, k_pages, block_tables))
    kwargs = dict(
        window=window,
        k_scales=k_scales,
        v_scales=v_scales,
        kv_mask=kv_mask,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
    )
    args = (q, k_pages, v_pages, block_tables, lengths)
    if impl in ("pallas", "pallas_tpu"):
        return IMPLEMENTATIONS[impl](*args, interpret=interpret, **kwargs)
    return IMPLEMENTATIONS[impl](*args, **kwargs)


# Every impl of ``select.TABLE['paged_decode']``, by name.
IMPLEMENTATIONS = {
    "cpu": paged_decode_attention_cpu,
    "pallas": paged_decode_attention_pallas,
    "pallas_tpu": paged_decode_attention_pallas_tpu,
    "xla": paged_decode_attention_xla,
    "reference": paged_decode_attention_reference,
}
