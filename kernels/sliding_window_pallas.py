"""Pallas flash kernels (forward, dq, dkv) for causal sliding-window GQA attention.

Layout inside the kernels: the query heads of one kv head are packed into rows, so a query
block is ``[block_q * G, H]`` (row r is token ``r // G``) and every K/V block is read once per
GQA group. Each program loops only over the key blocks its window reaches (forward, dq) or the
query blocks that reach it (dkv). Generic Pallas: runs with ``interpret=True`` on CPU; on GPU it
lowers through Triton (K/V of one (batch, kv head) are addressed as a
whole and sliced with ``pl.ds``).

Einsum legend: B batch, T time, K kv heads, G query heads per kv head, H head dim.
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
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tile sizes (tokens) of the sliding-window kernels."""

    block_q: int = 64
    block_k: int = 64

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)} must be >= 1")


def _band_mask(q_first, k_first, rows, cols, g, window):
    qpos = q_first + jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) // g
    kpos = k_first + jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return (kpos <= qpos) & (kpos > qpos - window)


def _key_range(iq, bq, bk, window):
    """Key blocks [lo, hi) that query block iq's window reaches."""
    q_first = iq * bq
    lo = jnp.maximum(q_first - window + 1, 0) // bk
    return lo, (q_first + bq - 1) // bk + 1


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, window, scale, bq, bk, g):
    iq = pl.program_id(2)
    q = q_ref[...]
    rows, h = q.shape

    def body(j, carry):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        mask = _band_mask(iq * bq, j * bk, rows, bk, g, window)
        s = jnp.where(mask, qk_logits(q, k, scale), -jnp.inf)
        return online_softmax_step(carry, s, v)

    lo, hi = _key_range(iq, bq, bk, window)
    out, lse = online_softmax_finish(jax.lax.fori_loop(lo, hi, body, online_softmax_init(rows, h)))
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _probs(q, k, lse, mask, scale):
    return jnp.where(mask, jnp.exp(qk_logits(q, k, scale) - lse[:, None]), 0.0)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, window, scale, bq, bk, g
):
    iq = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    rows = q.shape[0]

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        p = _probs(q, k, lse, _band_mask(iq * bq, j * bk, rows, bk, g, window), scale)
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dq + matmul_f32(ds.astype(k.dtype), k, (1, 0))

    lo, hi = _key_range(iq, bq, bk, window)
    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, window, scale, bq, bk, g, nq
):
    jk = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    rows = bq * g

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * rows, rows), :]
        do = do_ref[pl.ds(i * rows, rows), :]
        lse = lse_ref[pl.ds(i * rows, rows)]
        delta = delta_ref[pl.ds(i * rows, rows)]
        p = _probs(q, k, lse, _band_mask(i * bq, jk * bk, rows, bk, g, window), scale)
        dv = dv + matmul_f32(p.astype(do.dtype), do, (0, 0))
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dk + matmul_f32(ds.astype(q.dtype), q, (0, 0)), dv

    lo = (jk * bk) // bq
    hi = jnp.minimum(((jk + 1) * bk - 1 + window - 1) // bq + 1, nq)
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(t, g, h, bq, bk):
    """BlockSpecs on the packed layout: q-like [B, K, T*G, H], kv [B, K, T, H], rows [B, K, T*G]."""
    q_blk = pl.BlockSpec((None, None, bq * g, h), lambda b, n, i: (b, n, i, 0))
    row_blk = pl.BlockSpec((None, None, bq * g), lambda b, n, i: (b, n, i))
    kv_all = pl.BlockSpec((None, None, t, h), lambda b, n, i: (b, n, 0, 0))
    kv_blk = pl.BlockSpec((None, None, bk, h), lambda b, n, j: (b, n, j, 0))
    q_all = pl.BlockSpec((None, None, t * g, h), lambda b, n, j: (b, n, 0, 0))
    row_all = pl.BlockSpec((None, None, t * g), lambda b, n, j: (b, n, 0))
    return q_blk, row_blk, kv_all, kv_blk, q_all, row_all


def _forward(q, k, v, window, scale, bs, interpret):
    b, kh, tg, h = q.shape
    t = k.shape[2]
    g = tg // t
    q_blk, row_blk, kv_all, _, _, _ = _specs(t, g, h, bs.block_q, bs.block_k)
    kernel = functools.partial(
        _fwd_kernel, window=window, scale=scale, bq=bs.block_q, bk=bs.block_k, g=g
    )
    return pl.pallas_call(
        kernel,
        grid=(b, kh, t // bs.block_q),
        in_specs=[q_blk, kv_all, kv_all],
        out_specs=[q_blk, row_blk],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, kh, tg), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(),
    )(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _swa(q, k, v, window, scale, bs, interpret):
    return _forward(q, k, v, window, scale, bs, interpret)[0]


def _swa_fwd(q, k, v, window, scale, bs, interpret):
    o, lse = _forward(q, k, v, window, scale, bs, interpret)
    return o, (q, k, v, o, lse)


def _swa_bwd(window, scale, bs, interpret, res, do):
    q, k, v, o, lse = res
    b, kh, tg, h = q.shape
    t = k.shape[2]
    g, bq, bk = tg // t, bs.block_q, bs.block_k
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    q_blk, row_blk, kv_all, kv_blk, q_all, row_all = _specs(t, g, h, bq, bk)
    kw = dict(window=window, scale=scale, bq=bq, bk=bk, g=g)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **kw),
        grid=(b, kh, t // bq),
        in_specs=[q_blk, kv_all, kv_all, q_blk, row_blk, row_blk],
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(),
    )(q, k, v, do, lse, delta)
    # dk/dv hold all query rows of a band in flight: with bq * g rows of q and dO per step
    # (256 x 128 bf16 at g=4, head_dim 128) Triton asked for 322 KB of shared memory on an H200
    # (227 KB available), so this pass steps through queries in blocks of <= 64 rows.
    bq_kv = bq
    while bq_kv * g > 64 and bq_kv % 2 == 0:
        bq_kv //= 2
    kw_kv = dict(kw, bq=bq_kv)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, nq=t // bq_kv, **kw_kv),
        grid=(b, kh, t // bk),
        in_specs=[q_all, kv_blk, kv_blk, q_all, row_all, row_all],
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        compiler_params=None if interpret else gpu_compiler_params(),
    )(q, k, v, do, lse, delta)
    return dq, dk, dv


_swa.defvjp(_swa_fwd, _swa_bwd)


def sliding_window_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int,
    softmax_scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Sliding-window attention through the Pallas kernels; differentiable (custom_vjp).

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] (see ``sliding_window_attention``).
      window: keys per query, >= 1.
      softmax_scale: logit scale; default 1/sqrt(D).
      block_sizes: tile sizes; default 64 (or the power of two >= T if shorter), with T
        zero-padded to a multiple.
        Given explicitly, T must be a multiple of both.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      [B, T, Hq, D] in q.dtype.

    Raises:
      ValueError: if explicit block sizes do not divide T.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    scale = default_scale(h, softmax_scale)
    if block_sizes is None:
        blk = min(64, 1 << (t - 1).bit_length())  # powers of two (Triton tiles)
        block_sizes = BlockSizes(block_q=blk, block_k=blk)
        pad = -t % blk
    else:
        for name in ("block_q", "block_k"):
            if t % getattr(block_sizes, name):
                raise ValueError(
                    f"seq_len={t} must be a multiple of {name}={getattr(block_sizes, name)}"
                )
        pad = 0
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    tp = t + pad
    qp = q.reshape(b, tp, kh, g, h).transpose(0, 2, 1, 3, 4)
    gp = padded_group(g, interpret, block_sizes.block_q)  # power-of-two row tiles on GPU
    if gp > g:  # zero query heads, sliced off below (zero cotangent)
        qp = jnp.pad(qp, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)))
    qp = qp.reshape(b, kh, tp * gp, h)
    kp, vp = (x.transpose(0, 2, 1, 3) for x in (k, v))
    o = _swa(qp, kp, vp, window, scale, block_sizes, interpret)
    o = o.reshape(b, kh, tp, gp, h)[:, :, :t, :g]
    return o.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
