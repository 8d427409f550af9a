"""Pallas flash kernels (forward, dq, dkv) for block-sparse causal GQA attention.

One program handles one group of ``query_block`` tokens (1: a single token) and one kv head:
the tokens' G query heads form a ``[query_block * G, H]`` tile (row r is token r // G) that
meets each selected key block in a single step, so a selected block is read once per GQA group
(the selection is shared by the group). The dkv kernel runs per key block over the inverse
selection (the query groups that picked that block), built in XLA by a sort.
Generic Pallas: ``interpret=True`` on CPU, the Triton lowering on GPU.

Einsum legend: B batch, T time, K kv heads, G query heads per kv head, H head dim,
L selection slot, P position inside a key block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import (
    default_scale,
    gpu_compiler_params,
    matmul_f32,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    padded_group,
    qk_logits,
)
from agentrl_jax.kernels.block_sparse import normalize_block_indices
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tile sizes: ``block_kv`` is the key block (must equal the op's block_size)."""

    block_kv: int = 64

    def __post_init__(self):
        if self.block_kv < 1:
            raise ValueError(f"BlockSizes.block_kv={self.block_kv} must be >= 1")


def _causal(first, blk, rows, g, bs):
    """Row r (token first + r // g) may see key blk * bs + c iff the key is not later."""
    qpos = first + jax.lax.broadcasted_iota(jnp.int32, (rows, bs), 0) // g
    kpos = blk * bs + jax.lax.broadcasted_iota(jnp.int32, (rows, bs), 1)
    return kpos <= qpos


def _fwd_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, lse_ref, *, scale, bs, n_sel, qb, g):
    first = pl.program_id(2) * qb
    q = q_ref[...]
    rows, h = q.shape

    def body(i, carry):
        blk = idx_ref[i]

        def update(carry):
            k = k_ref[pl.ds(blk * bs, bs), :]
            v = v_ref[pl.ds(blk * bs, bs), :]
            mask = _causal(first, blk, rows, g, bs)
            return online_softmax_step(carry, jnp.where(mask, qk_logits(q, k, scale), -jnp.inf), v)

        # Unused slots and blocks entirely after the group's last token: no K/V read.
        use = (blk >= 0) & (blk * bs <= first + qb - 1)
        return jax.lax.cond(use, update, lambda c: c, carry)

    carry = jax.lax.fori_loop(0, n_sel, body, online_softmax_init(rows, h))
    out, lse = online_softmax_finish(carry)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(
    q_ref, k_ref, v_ref, idx_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, bs, n_sel, qb, g
):
    first = pl.program_id(2) * qb
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    rows = q.shape[0]

    def body(i, dq):
        blk = idx_ref[i]

        def update(dq):
            k = k_ref[pl.ds(blk * bs, bs), :]
            v = v_ref[pl.ds(blk * bs, bs), :]
            p = jnp.exp(qk_logits(q, k, scale) - lse[:, None])
            p = jnp.where(_causal(first, blk, rows, g, bs), p, 0.0)
            ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
            return dq + matmul_f32(ds.astype(k.dtype), k, (1, 0))

        use = (blk >= 0) & (blk * bs <= first + qb - 1)
        return jax.lax.cond(use, update, lambda d: d, dq)

    dq = jax.lax.fori_loop(0, n_sel, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    grp_ref,
    off_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    bs,
    qb,
    g,
):
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    rows = qb * g

    def body(e, carry):
        dk, dv = carry
        grp = grp_ref[e]
        q = q_ref[pl.ds(grp * rows, rows), :]
        do = do_ref[pl.ds(grp * rows, rows), :]
        lse = lse_ref[pl.ds(grp * rows, rows)]
        delta = delta_ref[pl.ds(grp * rows, rows)]
        p = jnp.exp(qk_logits(q, k, scale) - lse[:, None])
        p = jnp.where(_causal(grp * qb, j, rows, g, bs), p, 0.0)
        dv = dv + matmul_f32(p.astype(do.dtype), do, (0, 0))
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dk + matmul_f32(ds.astype(q.dtype), q, (0, 0)), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(off_ref[j], off_ref[j + 1], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(tq, s, rows, h, n_sel):
    """BlockSpecs: q-like [B, K, Tq*G, H] (rows = qb*G per group), kv [B, K, S, H],
    idx [B, K, groups, L], row stats [B, K, Tq*G]."""
    return dict(
        q_grp=pl.BlockSpec((None, None, rows, h), lambda b, n, i: (b, n, i, 0)),
        row_grp=pl.BlockSpec((None, None, rows), lambda b, n, i: (b, n, i)),
        idx_grp=pl.BlockSpec((None, None, None, n_sel), lambda b, n, i: (b, n, i, 0)),
        kv_all=pl.BlockSpec((None, None, s, h), lambda b, n, i: (b, n, 0, 0)),
        q_all=pl.BlockSpec((None, None, tq, h), lambda b, n, j: (b, n, 0, 0)),
        row_all=pl.BlockSpec((None, None, tq), lambda b, n, j: (b, n, 0)),
    )


def _forward(q, k, v, idx, scale, bs, qb, interpret):
    b, kh, tqg, h = q.shape
    groups, n_sel = idx.shape[2], idx.shape[3]
    rows = tqg // groups
    sp = _specs(tqg, k.shape[2], rows, h, n_sel)
    kernel = functools.partial(_fwd_kernel, scale=scale, bs=bs, n_sel=n_sel, qb=qb, g=rows // qb)
    return pl.pallas_call(
        kernel,
        grid=(b, kh, groups),
        in_specs=[sp["q_grp"], sp["kv_all"], sp["kv_all"], sp["idx_grp"]],
        out_specs=[sp["q_grp"], sp["row_grp"]],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, kh, tqg), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(),
    )(q, k, v, idx)


def _inverse_selection(idx, nblk):
    """Per (batch, kv head): query groups sorted by the block they selected, and offsets.

    Returns groups [B, K, groups*L] (the groups that selected block j are
    groups[offsets[j]:offsets[j+1]]) and offsets [B, K, nblk + 1]; unused slots sort last.
    """
    b, kh, ng, n_sel = idx.shape
    flat = jnp.where(idx >= 0, idx, nblk).reshape(b, kh, ng * n_sel)
    order = jnp.argsort(flat, axis=-1, stable=True)
    groups = (order // n_sel).astype(jnp.int32)
    counts = jax.vmap(jax.vmap(lambda f: jnp.bincount(f, length=nblk + 1)))(flat)
    offsets = jnp.concatenate(
        [jnp.zeros((b, kh, 1), jnp.int32), jnp.cumsum(counts[..., :nblk], -1).astype(jnp.int32)],
        axis=-1,
    )
    return groups, offsets


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _bsa(q, k, v, idx, scale, bs, qb, interpret):
    return _forward(q, k, v, idx, scale, bs, qb, interpret)[0]


def _bsa_fwd(q, k, v, idx, scale, bs, qb, interpret):
    o, lse = _forward(q, k, v, idx, scale, bs, qb, interpret)
    return o, (q, k, v, idx, o, lse)


def _bsa_bwd(scale, bs, qb, interpret, res, do):
    q, k, v, idx, o, lse = res
    b, kh, tqg, h = q.shape
    s = k.shape[2]
    groups, n_sel = idx.shape[2], idx.shape[3]
    rows, nblk = tqg // groups, s // bs
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    sp = _specs(tqg, s, rows, h, n_sel)
    kw = dict(scale=scale, bs=bs, qb=qb, g=rows // qb)
    params = None if interpret else gpu_compiler_params()
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, n_sel=n_sel, **kw),
        grid=(b, kh, groups),
        in_specs=[sp["q_grp"], sp["kv_all"], sp["kv_all"], sp["idx_grp"], sp["q_grp"]]
        + [sp["row_grp"]] * 2,
        out_specs=sp["q_grp"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=params,
    )(q, k, v, idx, do, lse, delta)
    grp, offsets = _inverse_selection(idx, nblk)
    kv_blk = pl.BlockSpec((None, None, bs, h), lambda b_, n, j: (b_, n, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, **kw),
        grid=(b, kh, nblk),
        in_specs=[
            sp["q_all"],
            kv_blk,
            kv_blk,
            pl.BlockSpec((None, None, groups * n_sel), lambda b_, n, j: (b_, n, 0)),
            pl.BlockSpec((None, None, nblk + 1), lambda b_, n, j: (b_, n, 0)),
            sp["q_all"],
            sp["row_all"],
            sp["row_all"],
        ],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        # Each step loads a whole query group (qb * g rows of q and dO): two pipeline stages
        # asked for 322 KB of shared memory at head_dim 128 on an H200 (227 KB available).
        compiler_params=None if interpret else gpu_compiler_params(num_stages=1),
    )(q, k, v, grp, offsets, do, lse, delta)
    return dq, dk, dv, None


_bsa.defvjp(_bsa_fwd, _bsa_bwd)


def block_sparse_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """Block-sparse attention through the Pallas kernels; differentiable in q, k, v.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; block_indices: int [B, T, Hkv, n_sel]
        (see ``block_sparse_attention``); keys are zero-padded to a multiple of block_size,
        queries to a multiple of query_block.
      block_size: key block size (the kernels' ``BlockSizes.block_kv``).
      softmax_scale: logit scale; default 1/sqrt(D).
      query_block: tokens per query tile, sharing the selection of the tile's first token.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      [B, T, Hq, D] in q.dtype; zeros for queries with no visible key.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    bs = BlockSizes(block_kv=block_size).block_kv
    qb = query_block
    scale = default_scale(h, softmax_scale)
    nblk = -(-t // bs)
    idx = normalize_block_indices(block_indices[:, ::qb], nblk).transpose(0, 2, 1, 3)
    idx = jax.lax.stop_gradient(idx)  # [B, K, groups, L]
    groups = idx.shape[2]
    kpad = nblk * bs - t
    if kpad:
        k, v = (jnp.pad(x, ((0, 0), (0, kpad), (0, 0), (0, 0))) for x in (k, v))
    qp = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4)  # [B, K, T, G, H]
    gp = padded_group(g, interpret, qb)
    qpad = groups * qb - t
    if gp > g or qpad:  # zero query heads / tokens, sliced off below (zero cotangent)
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, qpad), (0, gp - g), (0, 0)))
    qp = qp.reshape(b, kh, groups * qb * gp, h)
    kp, vp = (x.transpose(0, 2, 1, 3) for x in (k, v))
    o = _bsa(qp, kp, vp, idx, scale, bs, qb, interpret)
    o = o.reshape(b, kh, groups * qb, gp, h)[:, :, :t, :g]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
