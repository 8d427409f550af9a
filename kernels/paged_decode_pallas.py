"""Pallas kernel for single-token paged decode attention with GQA and optional int8 pages.

One program per (sequence, kv head): the G query heads of the group form a ``[G, H]`` tile; the
kernel walks only the pages the sequence owns (or, with a window, the pages the window
reaches), ``pages_per_block`` pages per loop iteration (one online-softmax update each),
reading each through the block table. int8 pages are dequantised in the kernel: the per-page,
per-head key scale multiplies the logits and the value scale the values.
Generic Pallas: ``interpret=True`` on CPU, the Triton lowering on GPU (the page pool is
addressed as a whole).

Einsum legend: B batch, K kv heads, G query heads per kv head, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import (
    default_scale,
    gpu_compiler_params,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    padded_group,
    qk_logits,
)
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling: pages handled per loop iteration (unrolled)."""

    pages_per_block: int = 1

    def __post_init__(self):
        if self.pages_per_block < 1:
            raise ValueError(f"BlockSizes.pages_per_block={self.pages_per_block} must be >= 1")


def _kernel(len_ref, bt_ref, q_ref, k_ref, v_ref, *rest, scale, window, ppb, quantized, num_pages):
    if quantized:
        ks_ref, vs_ref, o_ref = rest
    else:
        (o_ref,) = rest
    b, kv_head = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]
    g, h = q.shape
    ps = k_ref.shape[1]
    max_pages = bt_ref.shape[0]
    length = len_ref[b]
    first_tok = 0 if window is None else jnp.maximum(length - window, 0)
    first_page = first_tok // ps
    n_steps = (pl.cdiv(length, ps) - first_page + ppb - 1) // ppb

    def body(step, carry):
        for j in range(ppb):  # static unroll: one online-softmax update per page
            slot = first_page + step * ppb + j
            page = jnp.clip(bt_ref[jnp.minimum(slot, max_pages - 1)], 0, num_pages - 1)
            k = k_ref[pl.ds(page, 1), :, pl.ds(kv_head, 1), :].reshape(ps, h).astype(q.dtype)
            v = v_ref[pl.ds(page, 1), :, pl.ds(kv_head, 1), :].reshape(ps, h)
            s = qk_logits(q, k, scale)
            if quantized:  # dequantise: key scale on the logits, value scale on the values
                s = s * ks_ref[page, kv_head]
                v = v.astype(jnp.float32) * vs_ref[page, kv_head]
            pos = slot * ps + jax.lax.broadcasted_iota(jnp.int32, (g, ps), 1)
            s = jnp.where((pos < length) & (pos >= first_tok), s, -jnp.inf)
            carry = online_softmax_step(carry, s, v.astype(q.dtype))
        return carry

    carry = jax.lax.fori_loop(0, n_steps, body, online_softmax_init(g, h))
    o_ref[...] = online_softmax_finish(carry)[0].astype(o_ref.dtype)


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
    softmax_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Paged decode attention through the Pallas kernel (forward only).

    Args: as ``paged_decode_attention``; ``block_sizes`` sets pages per step (default 1).

    Returns:
      [B, Hq, D] in q.dtype; zeros where lengths[b] == 0.

    Raises:
      ValueError: if block_sizes.pages_per_block exceeds max_pages.
    """
    b, n, h = q.shape
    num_pages, ps, kh, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    g = n // kh
    gp = padded_group(g, interpret)
    bs = block_sizes or BlockSizes()
    if bs.pages_per_block > max_pages:
        raise ValueError(f"pages_per_block={bs.pages_per_block} must be <= {max_pages=}")
    quantized = k_scales is not None
    kernel = functools.partial(
        _kernel,
        scale=default_scale(h, softmax_scale),
        window=window,
        ppb=bs.pages_per_block,
        quantized=quantized,
        num_pages=num_pages,
    )
    full = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)
    in_specs = [
        full(lengths),
        pl.BlockSpec((None, max_pages), lambda i, j: (i, 0)),
        pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),
        full(k_pages),
        full(v_pages),
    ]
    qg = q.reshape(b, kh, g, h)
    if gp > g:  # zero query heads, sliced off below
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    args = [lengths.astype(jnp.int32), block_tables.astype(jnp.int32), qg]
    args += [k_pages, v_pages]
    if quantized:
        in_specs += [full(k_scales), full(v_scales)]
        args += [k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(b, kh),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, gp, h), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, gp, h), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(),
    )(*args)
    return out[:, :, :g].reshape(b, n, h)
