"""TPU-shaped Pallas forward kernel for block-sparse causal GQA attention (scalar prefetch).

Grid ``(B, Hkv, groups, n_sel)``: one query group (``query_block`` tokens x G query heads, a
``[query_block * G, D]`` tile, row r is token r // G) meets its selected key blocks one grid
step each. The selection is compacted in XLA before the call (used blocks first, each row's
count alongside) and scalar-prefetched into SMEM; the K/V BlockSpec index maps read it, so the
Mosaic pipeline DMAs exactly the selected ``[block_size, D]`` key/value blocks into VMEM,
double-buffered. Slots past a row's count repeat its last used block: the block index does not
change, so no copy is issued and the kernel skips the step. Unused (-1), out-of-range,
repeated and causally-future blocks count as unused. The online-softmax state (m, l, acc) lives
in fp32 VMEM scratch across the ``n_sel`` axis ('arbitrary'); the other axes are 'parallel'.

Backward: the custom_vjp reuses the XLA path (``jax.vjp`` of ``block_sparse_attention_xla``,
which recomputes the forward from the same selection): it compiles on every backend and its
memory is proportional to the selected context, where the generic Pallas dq/dkv kernels hold a
sequence's whole K/V in one block and would not fit TPU VMEM at long context.

TPU block constraints (last two block dims multiples of (8, 128) or the full dims): the q/out
tile is ``[query_block * G, D]`` of ``[groups * query_block * G, D]`` and the K/V block
``[block_size, D]`` of ``[S, D]``; D is always a full dim, so a compiled (non-interpret) call
needs ``query_block * G % 8 == 0`` (or a single group) and ``block_size % 8 == 0`` (or one
block), checked before the call. Interpret mode accepts any size. The prefetched selection
(``B * Hkv * groups * n_sel`` int32) must fit in SMEM (1 MiB per core from TPU v4 on): at
long context use a larger ``query_block`` or split the call over batch / heads.

Einsum legend: B batch, K kv heads, G query heads per kv head, H head dim, L selection slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from agentrl_jax.kernels.attention_math import (
    default_scale,
    online_softmax_update_cols,
    qk_logits,
)
from agentrl_jax.kernels.block_sparse_xla import (
    block_sparse_attention_xla,
    compact_selection,
    normalize_block_indices,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(
    blk_ref, cnt_ref, q_ref, k_ref, v_ref, row_tok_ref, o_ref, m_sc, l_sc, acc_sc, *, scale, bs, qb
):
    b, n, i, sl = (pl.program_id(a) for a in range(4))
    n_sel = pl.num_programs(3)
    row = (b * pl.num_programs(1) + n) * pl.num_programs(2) + i

    @pl.when(sl == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(sl < cnt_ref[row])
    def _update():
        blk = blk_ref[row * n_sel + sl]
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        # Causal inside the block: key blk*bs + c is visible to token i*qb + row_tok[r].
        kpos = blk * bs + jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        s = jnp.where(kpos <= i * qb + row_tok_ref[...], qk_logits(q, k, scale), -jnp.inf)
        m_sc[...], l_sc[...], acc_sc[...] = online_softmax_update_cols(
            m_sc[...], l_sc[...], acc_sc[...], s, v
        )

    @pl.when(sl == n_sel - 1)
    def _finish():
        l_i = l_sc[...]
        o_ref[...] = (acc_sc[...] / jnp.where(l_i > 0, l_i, 1.0)).astype(o_ref.dtype)


def kv_block_index(b, n, i, sl, blk_ref, cnt_ref, *, kv_heads, groups, n_sel):
    """K/V BlockSpec index map at grid point (b, n, i, sl): the compacted selection's block.

    Consecutive grid steps that map to the same block issue no copy, so the DMAs of one query
    group are its used blocks (``tests/kernels/test_tpu_dmas_kernel.py`` counts them).
    """
    del cnt_ref
    return (b, n, blk_ref[((b * kv_heads + n) * groups + i) * n_sel + sl], 0)


def _check_tpu_tiles(rows, groups, bs, nblk):
    if rows % 8 and groups > 1:
        raise ValueError(
            f"query_block * G = {rows} must be a multiple of 8 for the compiled TPU kernel "
            "(TPU block tiling); use interpret mode or a larger query_block"
        )
    if bs % 8 and nblk > 1:
        raise ValueError(f"block_size={bs} must be a multiple of 8 for the compiled TPU kernel")


def _forward(q, k, v, idx, scale, bs, qb, interpret):
    """q [B, K, groups*qb*G, H], k/v [B, K, nblk*bs, H], idx [B, K, groups, L] -> out like q."""
    b, kh, tqg, h = q.shape
    groups, n_sel = idx.shape[2], idx.shape[3]
    rows = tqg // groups
    nblk = k.shape[2] // bs
    if not interpret:
        _check_tpu_tiles(rows, groups, bs, nblk)
    blocks, counts = compact_selection(idx, bs, qb)
    counts = counts[..., 0]
    row_tok = jnp.asarray((np.arange(rows) // (rows // qb))[:, None].astype(np.int32))
    q_spec = pl.BlockSpec((None, None, rows, h), lambda b_, n, i, sl, *_: (b_, n, i, 0))

    kv_index = functools.partial(kv_block_index, kv_heads=kh, groups=groups, n_sel=n_sel)
    kv_spec = pl.BlockSpec((None, None, bs, h), kv_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, kh, groups, n_sel),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((rows, 1), lambda *_: (0, 0)),
        ],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, h), jnp.float32),
        ],
    )
    params = None
    if not interpret:
        semantics = ("parallel", "parallel", "parallel", "arbitrary")
        params = pltpu.CompilerParams(dimension_semantics=semantics)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, bs=bs, qb=qb),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=params,
    )(blocks.reshape(-1), counts.reshape(-1), q, k, v, row_tok)


def _forward_bthd(q, k, v, block_indices, bs, scale, qb, interpret):
    """[B, T, N, H] layout in and out; the kernel's [B, K, rows, H] layout inside."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    nblk = -(-t // bs)
    idx = normalize_block_indices(block_indices[:, ::qb], nblk).transpose(0, 2, 1, 3)
    groups = idx.shape[2]
    kpad = nblk * bs - t
    if kpad:
        k, v = (jnp.pad(x, ((0, 0), (0, kpad), (0, 0), (0, 0))) for x in (k, v))
    qp = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H]
    qpad = groups * qb - t
    if qpad:
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, qpad), (0, 0), (0, 0)))
    qp = qp.reshape(b, kh, groups * qb * g, h)
    kp, vp = (x.transpose(0, 2, 1, 3) for x in (k, v))
    o = _forward(qp, kp, vp, idx, scale, bs, qb, interpret)
    o = o.reshape(b, kh, groups * qb, g, h)[:, :, :t]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _bsa_tpu(q, k, v, block_indices, bs, scale, qb, interpret):
    return _forward_bthd(q, k, v, block_indices, bs, scale, qb, interpret)


def _bsa_tpu_fwd(q, k, v, block_indices, bs, scale, qb, interpret):
    out = _forward_bthd(q, k, v, block_indices, bs, scale, qb, interpret)
    return out, (q, k, v, block_indices)


def _bsa_tpu_bwd(bs, scale, qb, interpret, res, do):
    q, k, v, block_indices = res
    xla = functools.partial(
        block_sparse_attention_xla,
        block_indices=block_indices,
        block_size=bs,
        softmax_scale=scale,
        query_block=qb,
    )
    _, vjp = jax.vjp(xla, q, k, v)
    return (*vjp(do), None)


_bsa_tpu.defvjp(_bsa_tpu_fwd, _bsa_tpu_bwd)


def block_sparse_attention_pallas_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:
    """Block-sparse attention: scalar-prefetch TPU forward, XLA backward; differentiable in q,k,v.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; block_indices: int [B, T, Hkv, n_sel] (see
        ``block_sparse_attention``; already validated there). Keys are zero-padded to a
        multiple of block_size, queries to a multiple of query_block.
      block_size: key block size (the K/V BlockSpec's block rows).
      softmax_scale: logit scale; default 1/sqrt(D).
      query_block: tokens per query tile, sharing the selection of the tile's first token.
      interpret: False (compile with Mosaic, TPU only), True (generic interpreter) or
        ``pltpu.InterpretParams()`` (TPU semantics on CPU).

    Returns:
      [B, T, Hq, D] in q.dtype; zeros for queries with no visible key.

    Raises:
      ValueError: compiled (interpret False) on a backend other than TPU, or with tiles the TPU
        cannot block (see the module docstring).
    """
    if not interpret and jax.default_backend() != "tpu":
        raise ValueError(
            f"the pallas_tpu kernel compiles only on TPU (backend={jax.default_backend()!r}); "
            "pass interpret=True or pltpu.InterpretParams() elsewhere"
        )
    scale = default_scale(q.shape[-1], softmax_scale)
    idx = jax.lax.stop_gradient(block_indices.astype(jnp.int32))
    return _bsa_tpu(q, k, v, idx, block_size, scale, query_block, interpret)
