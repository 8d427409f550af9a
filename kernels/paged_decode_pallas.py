"""Pallas kernel for single-token paged decode attention with GQA and optional int8 pages.

Split-K (flash-decoding): one program per (sequence, kv head, split); split ``s`` owns
``pages_per_split`` consecutive page slots of the sequence's visible range (all its pages, or
the pages a window reaches). Each inner step gathers ``pages_per_block`` pages through the block
table into one ``[pages_per_block * page_size, H]`` K/V tile (row-index loads), so a step moves
tens of KiB and many programs keep loads in flight. Splits past the sequence's last page do no
work. The partial results (normalised output and log-sum-exp per split) are combined in XLA.

The G query heads of the kv head form the tile's rows (padded with zero heads to the 16 rows a
Triton dot needs). int8 pages are converted to the query dtype in registers; the per-(page, kv
head) scales act on the logits' columns (key scale) and on the probabilities' columns before
the ``P @ V`` matmul (value scale), so no dequantised tile is ever formed. A per-token key
mask (``kv_mask``, int32 [B, max_pages * page_size] here, by logical position) is loaded with the
same row indices as the tile and ANDed into the visibility. The combine also returns the
log-sum-exp over all splits (``return_lse``).

``paged_decode_visits`` runs the kernel in interpret mode with a counter output and returns
which page slots each program read.

Generic Pallas: ``interpret=True`` on CPU, the Triton lowering on GPU (the page pool is
addressed as ``[pages * page_size, H]`` rows of one kv head).

Einsum legend: B batch, K kv heads, G query heads per kv head, H head dim, S split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from agentrl_jax.kernels.attention_math import (
    default_scale,
    gpu_compiler_params,
    online_softmax_init,
    online_softmax_step,
    padded_group,
    qk_logits,
)
from jax.experimental import pallas as pl

_STEP_ELEMS = 128 * 128  # default K elements gathered per inner step (128 tokens at H 128)
_SPLIT_TOKENS = 2048  # default tokens per split


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling (0: chosen from the page size, see ``resolve``).

    Attributes:
      pages_per_block: pages gathered per inner step.
      pages_per_split: page slots per program (a multiple of pages_per_block).
      num_warps, num_stages: Triton launch parameters.
    """

    pages_per_block: int = 0
    pages_per_split: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("pages_per_block", "pages_per_split"):
            if getattr(self, name) < 0:
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be >= 0")

    def resolve(self, page_size: int, visible_pages: int, head_dim: int = 128) -> tuple[int, int]:
        """(pages_per_block, pages_per_split) for this page size, visible page count and
        head_dim (wider heads gather fewer tokens per step: shared memory).

        Raises:
          ValueError: if pages_per_split is not a multiple of pages_per_block.
        """
        ppb = self.pages_per_block
        if not ppb:  # a power of two, no wider than the visible pages need
            ppb = min(
                max(1, _STEP_ELEMS // head_dim // page_size),
                1 << max(0, (visible_pages - 1).bit_length()),
            )
        pps = self.pages_per_split or max(ppb, _SPLIT_TOKENS // page_size // ppb * ppb)
        if pps % ppb:
            raise ValueError(f"pages_per_split={pps} must be a multiple of pages_per_block={ppb}")
        return ppb, pps


def visible_pages(max_pages: int, page_size: int, window: int | None) -> int:
    """Page slots one sequence can touch: all of them, or those a window can reach."""
    if window is None:
        return max_pages
    return min(max_pages, -(-window // page_size) + 1)


def _kernel(
    len_ref, bt_ref, q_ref, k_ref, v_ref, *rest, scale, window, ppb, pps, ps, quantized, masked
):
    rest = list(rest)
    ks_ref, vs_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
    m_ref = rest.pop(0) if masked else None
    o_ref, lse_ref, *vis = rest
    b, split = pl.program_id(0), pl.program_id(2)
    q = q_ref[...]
    g, h = q.shape
    kt = ppb * ps
    max_pages, num_rows = bt_ref.shape[0], k_ref.shape[0]
    length = len_ref[b]
    first_tok = 0 if window is None else jnp.maximum(length - window, 0)
    lo = first_tok // ps + split * pps  # this split's first page slot
    hi = jnp.minimum(pl.cdiv(length, ps), lo + pps)
    r = jax.lax.broadcasted_iota(jnp.int32, (kt,), 0)
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(step, carry):
        slot = lo + step * ppb + r // ps
        page = jnp.clip(bt_ref[jnp.minimum(slot, max_pages - 1)], 0, num_rows // ps - 1)
        row = page * ps + r % ps
        if vis:
            for j in range(ppb):
                sj = jnp.minimum(lo + step * ppb + j, max_pages)
                live = lo + step * ppb + j < hi
                vis[0][sj] = vis[0][sj] + jnp.where(live, 1, 0)
                vis[0][max_pages] = vis[0][max_pages] + jnp.where(live, 0, 1)
        k = k_ref[row, :].astype(q.dtype)
        v = v_ref[row, :].astype(q.dtype)
        s = qk_logits(q, k, scale)
        v_col = None
        if quantized:  # per-(page, kv head) scales: key on the logits, value on P's columns
            s = s * ks_ref[page][None, :]
            v_col = vs_ref[page]
        pos = slot * ps + r % ps
        visible = (pos < length) & (pos >= first_tok) & (slot < hi)
        if masked:  # the tile's tokens by logical position (clamped: the tail is masked anyway)
            visible &= m_ref[jnp.minimum(pos, m_ref.shape[0] - 1)] != 0
        s = jnp.where(visible[None, :], s, -jnp.inf)
        return online_softmax_step(carry, s, v, v_col)

    n_steps = jnp.maximum(pl.cdiv(hi - lo, ppb), 0)
    m_i, l_i, acc = jax.lax.fori_loop(0, n_steps, body, online_softmax_init(g, h))
    seen = l_i > 0
    l_safe = jnp.where(seen, l_i, 1.0)
    o_ref[...] = acc / l_safe[:, None]
    lse_ref[...] = jnp.where(seen, m_i + jnp.log(l_safe), -jnp.inf)


def _combine(o_part: jax.Array, lse_part: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges per-split results: [B, K, S, G, H] fp32 and [B, K, S, G] -> ([B, K, G, H] fp32,
    lse [B, K, G], -inf where no split saw a key)."""
    m = jnp.max(lse_part, axis=2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_part - m)  # 0 for empty splits
    den = jnp.sum(w, axis=2)
    out = jnp.sum(w[..., None] * o_part, axis=2)
    seen = den > 0
    den = jnp.where(seen, den, 1.0)
    return out / den[..., None], jnp.where(seen, m[:, :, 0] + jnp.log(den), -jnp.inf)


def _call(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    k_scales,
    v_scales,
    kv_mask,
    *,
    window,
    scale,
    block_sizes,
    interpret,
    instrument=False,
):
    b, n, h = q.shape
    num_pages, ps, kh, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    g = n // kh
    gp = padded_group(g, interpret)
    ppb, pps = (block_sizes or BlockSizes()).resolve(ps, visible_pages(max_pages, ps, window), h)
    n_split = -(-visible_pages(max_pages, ps, window) // pps)
    quantized = k_scales is not None
    qg = q.reshape(b, kh, g, h)
    if gp > g:  # zero query heads, sliced off by the caller
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    rows = lambda x: x.reshape(num_pages * ps, kh, h)  # free reshape: token rows of the pool
    pool = pl.BlockSpec((num_pages * ps, None, h), lambda i, n_, s: (0, n_, 0))
    in_specs = [
        pl.BlockSpec(lengths.shape, lambda i, n_, s: (0,)),
        pl.BlockSpec((None, max_pages), lambda i, n_, s: (i, 0)),
        pl.BlockSpec((None, None, gp, h), lambda i, n_, s: (i, n_, 0, 0)),
        pool,
        pool,
    ]
    args = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg]
    args += [rows(k_pages), rows(v_pages)]
    if quantized:
        in_specs += [pl.BlockSpec((num_pages, None), lambda i, n_, s: (0, n_))] * 2
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    if kv_mask is not None:  # int32: Triton loads of bool refs are not portable
        in_specs.append(pl.BlockSpec((None, max_pages * ps), lambda i, n_, s: (i, 0)))
        args.append(kv_mask.astype(jnp.int32))
    out_specs = [
        pl.BlockSpec((None, None, None, gp, h), lambda i, n_, s: (i, n_, s, 0, 0)),
        pl.BlockSpec((None, None, None, gp), lambda i, n_, s: (i, n_, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, kh, n_split, gp, h), jnp.float32),
        jax.ShapeDtypeStruct((b, kh, n_split, gp), jnp.float32),
    ]
    if instrument:
        out_specs.append(
            pl.BlockSpec((None, None, None, max_pages + 1), lambda i, n_, s: (i, n_, s, 0))
        )
        out_shape.append(jax.ShapeDtypeStruct((b, kh, n_split, max_pages + 1), jnp.int32))
    bsz = block_sizes or BlockSizes()
    kernel = functools.partial(
        _kernel,
        scale=scale,
        window=window,
        ppb=ppb,
        pps=pps,
        ps=ps,
        quantized=quantized,
        masked=kv_mask is not None,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, n_split),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(bsz.num_warps, bsz.num_stages),
    )(*args)
    return outs, g


def paged_decode_attention_pallas(
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
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Paged decode attention through the split-K Pallas kernel (forward only).

    Args: as ``paged_decode_attention``; ``block_sizes`` sets the pages per step and per split
      (default: 128 tokens per step at head_dim 128, 2048 per split).

    Returns:
      [B, Hq, D] in q.dtype; zeros where no key is visible. With ``return_lse``: (out float32
      [B, Hq, D], lse float32 [B, Hq], -inf where no key is visible).

    Raises:
      ValueError: if explicit block sizes are inconsistent.
    """
    b, n, h = q.shape
    scale = default_scale(h, softmax_scale)
    (o_part, lse_part), g = _call(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        k_scales,
        v_scales,
        kv_mask,
        window=window,
        scale=scale,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    out, lse = _combine(o_part, lse_part)
    out = out[:, :, :g].reshape(b, n, h)
    if return_lse:
        return out, lse[:, :, :g].reshape(b, n)
    return out.astype(q.dtype)


def paged_decode_visits(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
) -> np.ndarray:
    """Page slots each program reads (interpret mode, instrumented).

    Returns:
      int32 [B, K, splits, max_pages + 1]: reads of each page slot of the sequence's block
      table, and in the last column the slots gathered past the split's last live page (the
      masked tail of its last step).
    """
    args = (q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    return np.asarray(_visits(*args, window, block_sizes))


@functools.partial(jax.jit, static_argnums=(7, 8))
def _visits(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, window, block_sizes):
    (_, _, vis), _ = _call(
        q,
        k_pages,
        v_pages,
        block_tables,
        lengths,
        k_scales,
        v_scales,
        None,
        window=window,
        scale=default_scale(q.shape[-1], None),
        block_sizes=block_sizes,
        interpret=True,
        instrument=True,
    )
    return vis
