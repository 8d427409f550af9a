"""TPU-shaped Pallas kernel for paged decode attention: the block table drives the DMAs.

The lengths and the (flattened) block table are scalar-prefetched into SMEM and read by the
BlockSpec index maps, so the Mosaic pipeline copies exactly the pages a sequence owns (with a
window, only the pages the window reaches) from HBM into VMEM, double-buffered, instead of the
kernel gathering from a pool held in VMEM. Grid ``(B, steps)``; step ``s`` of sequence ``b``
handles ``pages_per_block`` page slots. Slots past a sequence's last page map to that last page:
the block index does not change, so the pipeline issues no copy and the kernel skips the step.

One whole page ``[page_size, Hkv, D]`` is one contiguous block in HBM; it is read as
``[page_size * Hkv, D]`` (a free reshape of the pool in the wrapper), so the block's last two
dims are the full array dims and every page size / head count is a legal TPU block. All ``Hq``
query rows meet the page in one ``[Hq, D] x [page_size * Hkv, D]`` matmul and a block-diagonal
mask keeps the pairs of a query head with its own kv head: the MXU does ``Hkv`` times the
needed FLOPs, which decode (memory bound) does not notice, and no in-kernel reshape or strided
load is needed. int8 pages are cast to the query dtype in the kernel; since only same-head
pairs survive the mask, the per-(page, kv head) scales are applied per query row: the key scale
to the logits, the value scale to ``P @ V``. Scales travel as ``[1, Hkv]`` VMEM blocks of the
``[P, 1, Hkv]``-reshaped scale arrays (they are too many for SMEM in a large pool).

A per-token key mask (``kv_mask``) travels as int32 ``[B, max_pages, 1, C]`` (each token's
entry repeated over the kv heads in the column order, in the wrapper), one ``[1, C]`` block per
page slot, indexed by the slot rather than the pool page. A second output holds the
log-sum-exp per query row (``return_lse``).

The prefetched block table (``B * max_pages`` int32) must fit in SMEM (1 MiB per core from
TPU v4 on; 64 sequences x 2048 pages is 512 KiB): split larger batches.

Masks use precomputed integer tables (column -> token offset, row/column -> kv head) passed as
constant blocks: Mosaic has no vector integer division.

Einsum legend: B batch, N query heads (K kv heads x G), H head dim, C page column
(page slot o of kv head k is column o * K + k).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from agentrl_jax.kernels.attention_math import (
    default_scale,
    online_softmax_update_cols,
    qk_logits,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling: page slots per grid step (each one a separately DMA'd block)."""

    pages_per_block: int = 1

    def __post_init__(self):
        if self.pages_per_block < 1:
            raise ValueError(f"BlockSizes.pages_per_block={self.pages_per_block} must be >= 1")


def _visible_pages(max_pages: int, page_size: int, window: int | None) -> int:
    """Page slots one sequence can touch: all of them, or those a window can reach."""
    if window is None:
        return max_pages
    return min(max_pages, -(-window // page_size) + 1)


def _first_page(length, page_size, window):
    return 0 if window is None else jnp.maximum(length - window, 0) // page_size


def _slot_index(b, slot, len_ref, *, page_size, window, max_pages):
    """Block-table slot of step slot ``slot`` (relative to the first visible page) of sequence
    ``b``; slots past the last owned page map to the last one (no new DMA)."""
    length = len_ref[b]
    first = _first_page(length, page_size, window)
    last = jnp.maximum((length + page_size - 1) // page_size - 1, first)
    return jnp.minimum(jnp.minimum(first + slot, last), max_pages - 1)


def _page_index(b, slot, len_ref, bt_ref, *, page_size, window, max_pages, num_pages):
    """Pool page of step slot ``slot`` of sequence ``b`` (:func:`_slot_index`); empty sequences
    and junk table entries are clamped into the pool (their page is fetched, never used)."""
    slot = _slot_index(b, slot, len_ref, page_size=page_size, window=window, max_pages=max_pages)
    return jnp.clip(bt_ref[b * max_pages + slot], 0, num_pages - 1)


def _kernel(len_ref, bt_ref, *refs, scale, window, ppb, page_size, quantized, masked):
    q_ref, col_tok_ref, same_head_ref, head_onehot_ref = refs[:4]
    k_refs, v_refs = refs[4 : 4 + ppb], refs[4 + ppb : 4 + 2 * ppb]
    rest = refs[4 + 2 * ppb :]
    if quantized:
        ks_refs, vs_refs, rest = rest[:ppb], rest[ppb : 2 * ppb], rest[2 * ppb :]
    if masked:
        mask_refs, rest = rest[:ppb], rest[ppb:]
    o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    b, step = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    first_tok = 0 if window is None else jnp.maximum(length - window, 0)
    first = _first_page(length, page_size, window)

    @pl.when(step == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    q = q_ref[...]
    for j in range(ppb):  # static unroll: one online-softmax update per page
        slot = first + step * ppb + j

        @pl.when(slot * page_size < length)
        def _update(j=j, slot=slot):
            k = k_refs[j][...].astype(q.dtype)  # [C, H]
            v = v_refs[j][...].astype(q.dtype)
            s = qk_logits(q, k, scale)  # [N, C]
            if quantized:  # per query row: the scale of the row's own kv head
                s = s * jnp.sum(head_onehot_ref[...] * ks_refs[j][...], axis=1, keepdims=True)
            pos = slot * page_size + col_tok_ref[...]  # [1, C]
            visible = (same_head_ref[...] != 0) & (pos < length) & (pos >= first_tok)
            if masked:
                visible &= mask_refs[j][...] != 0  # [1, C]
            s = jnp.where(visible, s, -jnp.inf)
            v_scale = None
            if quantized:
                v_scale = jnp.sum(head_onehot_ref[...] * vs_refs[j][...], axis=1, keepdims=True)
            m_sc[...], l_sc[...], acc_sc[...] = online_softmax_update_cols(
                m_sc[...], l_sc[...], acc_sc[...], s, v, v_scale
            )

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():
        l_i = l_sc[...]
        seen = l_i > 0
        l_safe = jnp.where(seen, l_i, 1.0)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)  # rows that saw no key: zeros
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(l_safe), -jnp.inf)


def _tpu_compiler_params(interpret):
    if interpret:
        return None
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def paged_decode_attention_pallas_tpu(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Paged decode attention through the scalar-prefetch TPU kernel (forward only).

    Args: as ``paged_decode_attention`` (inputs already validated there); ``block_sizes`` sets
      the page slots per grid step (default 1); ``interpret``: False (compile with Mosaic, TPU
      only), True (generic interpreter) or ``pltpu.InterpretParams()`` (TPU semantics on CPU:
      simulated DMAs, SMEM/VMEM, out-of-bounds checks, NaN-filled scratch).

    Returns:
      [B, Hq, D] in q.dtype; zeros where no key is visible. With ``return_lse``: (out float32
      [B, Hq, D], lse float32 [B, Hq], -inf where no key is visible).

    Raises:
      ValueError: if block_sizes.pages_per_block exceeds the visited page slots, or if
        ``interpret`` is False on a backend other than TPU.
    """
    if not interpret and jax.default_backend() != "tpu":
        raise ValueError(
            f"the pallas_tpu kernel compiles only on TPU (backend={jax.default_backend()!r}); "
            "pass interpret=True or pltpu.InterpretParams() elsewhere"
        )
    b, n, h = q.shape
    num_pages, ps, kh, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    g = n // kh
    bs = block_sizes or BlockSizes()
    ppb = bs.pages_per_block
    visible = _visible_pages(max_pages, ps, window)
    if ppb > visible:
        raise ValueError(f"pages_per_block={ppb} must be <= {visible=} page slots")
    steps = -(-visible // ppb)
    quantized = k_scales is not None
    cols = ps * kh
    # Static mask tables (numpy: no vector integer division in Mosaic).
    col = np.arange(cols)
    row_head = np.arange(n)[:, None] // g  # [N, 1]
    col_tok = (col // kh)[None, :].astype(np.int32)  # [1, C]
    same_head = (row_head == (col % kh)[None, :]).astype(np.int32)  # [N, C]
    row_onehot = (row_head == np.arange(kh)[None, :]).astype(np.float32)  # [N, K]

    page = functools.partial(
        _page_index, page_size=ps, window=window, max_pages=max_pages, num_pages=num_pages
    )
    const = lambda shape: pl.BlockSpec(shape, lambda i, s, *_: (0,) * len(shape))
    per_seq = pl.BlockSpec((None, n, h), lambda i, s, *_: (i, 0, 0))

    def paged(block, j):  # page slot s * ppb + j of sequence i, looked up in the block table
        def index_map(i, s, len_ref, bt_ref):
            return (page(i, s * ppb + j, len_ref, bt_ref), 0, 0)

        return pl.BlockSpec((None, *block), index_map)

    kv_specs = [paged((cols, h), j) for j in range(ppb)]
    in_specs = [per_seq, const((1, cols)), const((n, cols)), const((n, kh)), *kv_specs, *kv_specs]
    kp, vp = (x.reshape(num_pages, cols, h) for x in (k_pages, v_pages))  # free reshapes
    args = [q, jnp.asarray(col_tok), jnp.asarray(same_head), jnp.asarray(row_onehot)]
    args += [kp] * ppb + [vp] * ppb
    if quantized:
        sc_specs = [paged((1, kh), j) for j in range(ppb)]
        in_specs += sc_specs + sc_specs
        ks, vs = (x.astype(jnp.float32).reshape(num_pages, 1, kh) for x in (k_scales, v_scales))
        args += [ks] * ppb + [vs] * ppb
    if kv_mask is not None:  # [B, S] -> [B, max_pages, 1, C]: column o * K + k is token o

        def slot_spec(j):
            def index_map(i, s, len_ref, bt_ref):
                slot = _slot_index(
                    i, s * ppb + j, len_ref, page_size=ps, window=window, max_pages=max_pages
                )
                return (i, slot, 0, 0)

            return pl.BlockSpec((None, None, 1, cols), index_map)

        in_specs += [slot_spec(j) for j in range(ppb)]
        cols_mask = jnp.repeat(kv_mask.astype(jnp.int32).reshape(b, max_pages, 1, ps), kh, axis=3)
        args += [cols_mask] * ppb
    kernel = functools.partial(
        _kernel,
        scale=default_scale(h, softmax_scale),
        window=window,
        ppb=ppb,
        page_size=ps,
        quantized=quantized,
        masked=kv_mask is not None,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, steps),
        in_specs=in_specs,
        out_specs=[per_seq, pl.BlockSpec((None, n, 1), lambda i, s, *_: (i, 0, 0))],
        scratch_shapes=[
            pltpu.VMEM((n, 1), jnp.float32),
            pltpu.VMEM((n, 1), jnp.float32),
            pltpu.VMEM((n, h), jnp.float32),
        ],
    )
    out_dtype = jnp.float32 if return_lse else q.dtype
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((b, n, h), out_dtype),
            jax.ShapeDtypeStruct((b, n, 1), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_tpu_compiler_params(interpret),
    )(lengths.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), *args)
    return (out, lse[:, :, 0]) if return_lse else out
