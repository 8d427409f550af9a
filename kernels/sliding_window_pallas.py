"""Pallas flash kernels (forward, dq, dkv) for causal sliding-window GQA attention.

The kernels read q, k, v in the op's own ``[B, T, heads, H]`` layout (no transposes around the
call): a program's query tile is ``[block_q, G, H]`` (the G query heads of one kv head for
``block_q`` tokens), flattened to ``[block_q * G, H]`` rows (row r is token r // G), so every
K/V block the tile meets is loaded once for the whole GQA group. K and V of one (batch, kv
head) are addressed as ``[T, H]`` and sliced with ``pl.ds``.

Work: the forward and dq programs loop only over the key blocks the window reaches, and the dkv
programs only over the query blocks that reach their key block (``key_block_range`` /
``query_block_range``). Each range is split into the blocks every (query, key) pair of which is
visible (no mask computed) and the partial blocks at the band's two edges (masked).
``*_visits`` run the kernels in interpret mode with a counter output and return, per program,
how often each block was visited and whether masked, so tests check the visited set against
the band.

Generic Pallas: ``interpret=True`` on CPU; on GPU the Triton lowering (tiles must be powers of
two: a group that is not is padded with zero query heads by the wrapper). Mosaic TPU rejects
the dynamic K/V slices; ``select.select_impl`` never sends TPU calls here.

Einsum legend: B batch, T time, K kv heads, G query heads per kv head, H head dim.
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
    matmul_f32,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    padded_group,
    qk_logits,
)
from jax.experimental import pallas as pl

# Query rows (tokens x heads) per program that the default tiles aim at, per pass.
_ROWS = {"fwd": 128, "dq": 64, "dkv": 64}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tile sizes in tokens (0: derived from the group size, see ``default``).

    Attributes:
      block_q, block_k: query / key tile of the forward.
      block_q_dq, block_k_dq: tiles of the dq pass.
      block_q_dkv, block_k_dkv: tiles of the dk/dv pass.
      num_warps, num_stages: Triton launch parameters of the forward (the backward passes use
        ``num_warps_bwd`` and 2 stages).
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dq: int = 0
    block_k_dq: int = 0
    block_q_dkv: int = 0
    block_k_dkv: int = 0
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            low = 1 if f.name in ("block_q", "block_k", "num_warps", "num_stages") else 0
            if getattr(self, f.name) < low:
                raise ValueError(f"BlockSizes.{f.name}={getattr(self, f.name)} must be >= {low}")

    def resolved(self) -> BlockSizes:
        """Backward tiles default to the forward's."""
        return dataclasses.replace(
            self,
            block_q_dq=self.block_q_dq or self.block_q,
            block_k_dq=self.block_k_dq or self.block_k,
            block_q_dkv=self.block_q_dkv or self.block_q,
            block_k_dkv=self.block_k_dkv or self.block_k,
        )

    @staticmethod
    def default(seq_len: int, group: int, head_dim: int = 128) -> BlockSizes:
        """Power-of-two tiles of ~128 forward / 64 backward query rows and 64 keys; half the
        key rows and two pipeline stages above head_dim 128 (shared memory)."""
        cap = 1 << max(0, (seq_len - 1).bit_length())
        g2 = 1 << max(0, (group - 1).bit_length())
        wide = head_dim > 128
        tok = lambda rows: max(1, min(cap, rows // g2 // (2 if wide else 1)))
        keys = min(32 if wide else 64, cap)
        return BlockSizes(
            block_q=tok(_ROWS["fwd"]),
            block_k=keys,
            block_q_dq=tok(_ROWS["dq"]),
            block_k_dq=keys,
            block_q_dkv=tok(_ROWS["dkv"]),
            block_k_dkv=keys,
            num_stages=2 if wide else 3,
        )

    def tiles(self) -> tuple[int, ...]:
        r = self.resolved()
        return (r.block_q, r.block_k, r.block_q_dq, r.block_k_dq, r.block_q_dkv, r.block_k_dkv)


def key_block_range(iq, bq, bk, window):
    """Key blocks of query block ``iq``: (lo, clean_lo, clean_hi, hi).

    [lo, hi) is every key block the window reaches; inside it, [clean_lo, clean_hi) are the
    blocks all of whose keys every query of the block sees (no mask needed).
    """
    q0 = iq * bq
    lo = jnp.maximum(q0 - window + 1, 0) // bk
    hi = (q0 + bq - 1) // bk + 1
    # Key block j is clean iff j*bk + bk - 1 <= q0 and j*bk >= q0 + bq - window.
    clean_lo = jnp.clip(pl.cdiv(jnp.maximum(q0 + bq - window, 0), bk), lo, hi)
    clean_hi = jnp.clip((q0 + 1) // bk, clean_lo, hi)
    return lo, clean_lo, clean_hi, hi


def query_block_range(jk, bq, bk, window, nq):
    """Query blocks that reach key block ``jk``: (lo, clean_lo, clean_hi, hi) as above."""
    k0 = jk * bk
    lo = k0 // bq
    hi = jnp.minimum((k0 + bk - 1 + window - 1) // bq + 1, nq)
    # Query block i is clean iff i*bq >= k0 + bk - 1 and i*bq + bq - 1 - k0 <= window - 1.
    clean_lo = jnp.clip(pl.cdiv(k0 + bk - 1, bq), lo, hi)
    last = k0 + window - bq  # largest clean first token
    clean_hi = jnp.clip(jnp.where(last >= 0, last // bq + 1, 0), clean_lo, hi)
    return lo, clean_lo, clean_hi, hi


def _band_mask(q_first, k_first, rows, cols, g, window):
    qpos = q_first + jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) // g
    kpos = k_first + jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return (kpos <= qpos) & (kpos > qpos - window)


def _count(vis, j, masked):
    """Instrumentation: records a visit of block ``j`` (1 clean, 2 masked)."""
    if vis:
        vis[0][j] = vis[0][j] + (2 if masked else 1)


def _three_loops(ranges, body, carry):
    """Masked lower edge, clean interior, masked upper edge."""
    lo, clean_lo, clean_hi, hi = ranges
    carry = jax.lax.fori_loop(lo, clean_lo, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(clean_lo, clean_hi, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(clean_hi, hi, functools.partial(body, masked=True), carry)


def _rows(ref, start=None, size=None):
    """[tokens, G, H] (or [tokens, G]) tile -> [tokens * G, ...] rows."""
    x = ref[...] if start is None else ref[pl.ds(start, size)]
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *vis, window, scale, bq, bk, g):
    iq = pl.program_id(2)
    q = _rows(q_ref)
    rows, h = q.shape
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(j, carry, masked):
        _count(vis, j, masked)
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = qk_logits(q, k, scale)
        if masked:
            s = jnp.where(_band_mask(iq * bq, j * bk, rows, bk, g, window), s, -jnp.inf)
        return online_softmax_step(carry, s, v)

    carry = _three_loops(key_block_range(iq, bq, bk, window), body, online_softmax_init(rows, h))
    out, lse = online_softmax_finish(carry)
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(lse_ref.shape)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *vis, window, scale, bq, bk, g
):
    iq = pl.program_id(2)
    q, do, lse, delta = (_rows(r) for r in (q_ref, do_ref, lse_ref, delta_ref))
    rows = q.shape[0]
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(j, dq, masked):
        _count(vis, j, masked)
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        p = jnp.exp(qk_logits(q, k, scale) - lse[:, None])
        if masked:
            p = jnp.where(_band_mask(iq * bq, j * bk, rows, bk, g, window), p, 0.0)
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dq + matmul_f32(ds.astype(k.dtype), k, (1, 0))

    zeros = jnp.zeros(q.shape, jnp.float32)
    dq = _three_loops(key_block_range(iq, bq, bk, window), body, zeros)
    dq_ref[...] = (dq * scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *vis,
    window,
    scale,
    bq,
    bk,
    g,
    nq,
):
    jk = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    rows = bq * g
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(i, carry, masked):
        _count(vis, i, masked)
        dk, dv = carry
        q, do = _rows(q_ref, i * bq, bq), _rows(do_ref, i * bq, bq)
        lse, delta = _rows(lse_ref, i * bq, bq), _rows(delta_ref, i * bq, bq)
        p = jnp.exp(qk_logits(q, k, scale) - lse[:, None])
        if masked:
            p = jnp.where(_band_mask(i * bq, jk * bk, rows, bk, g, window), p, 0.0)
        dv = dv + matmul_f32(p.astype(do.dtype), do, (0, 0))
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dk + matmul_f32(ds.astype(q.dtype), q, (0, 0)), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = _three_loops(query_block_range(jk, bq, bk, window, nq), body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _q_spec(bq, g, h):  # [B, T, N, H] -> the [bq, G, H] tile of kv head n
    return pl.BlockSpec((None, bq, g, h), lambda b, n, i: (b, i, n, 0))


def _row_spec(bq, g):  # [B, T, N] fp32 row statistics
    return pl.BlockSpec((None, bq, g), lambda b, n, i: (b, i, n))


def _seq_spec(t, h):  # [B, T, K, H] -> the whole [T, H] of kv head n
    return pl.BlockSpec((None, t, None, h), lambda b, n, i: (b, 0, n, 0))


def _vis_spec(n):
    return pl.BlockSpec((None, None, None, n), lambda b, n_, i: (b, n_, i, 0))


def _params(interpret, num_warps, num_stages):
    return None if interpret else gpu_compiler_params(num_warps, num_stages)


def _forward(q, k, v, window, scale, bs, interpret, instrument=False):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g, bq, bk = n // kh, bs.block_q, bs.block_k
    nq = t // bq
    out_specs = [_q_spec(bq, g, h), _row_spec(bq, g)]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((b, t, n), jnp.float32),
    ]
    if instrument:
        out_specs.append(_vis_spec(t // bk))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, nq, t // bk), jnp.int32))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, window=window, scale=scale, bq=bq, bk=bk, g=g),
        grid=(b, kh, nq),
        in_specs=[_q_spec(bq, g, h), _seq_spec(t, h), _seq_spec(t, h)],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params(interpret, bs.num_warps, bs.num_stages),
    )(q, k, v)


def _dq(q, k, v, do, lse, delta, window, scale, bs, interpret, instrument=False):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g, bq, bk = n // kh, bs.block_q_dq, bs.block_k_dq
    out_specs, out_shape = _q_spec(bq, g, h), jax.ShapeDtypeStruct(q.shape, q.dtype)
    if instrument:
        out_specs = [out_specs, _vis_spec(t // bk)]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, kh, t // bq, t // bk), jnp.int32)]
    return pl.pallas_call(
        functools.partial(_dq_kernel, window=window, scale=scale, bq=bq, bk=bk, g=g),
        grid=(b, kh, t // bq),
        in_specs=[_q_spec(bq, g, h), _seq_spec(t, h), _seq_spec(t, h), _q_spec(bq, g, h)]
        + [_row_spec(bq, g)] * 2,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params(interpret, bs.num_warps_bwd, 2),
    )(q, k, v, do, lse, delta)


def _dkv(q, k, v, do, lse, delta, window, scale, bs, interpret, instrument=False):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g, bq, bk = n // kh, bs.block_q_dkv, bs.block_k_dkv
    q_all = pl.BlockSpec((None, t, g, h), lambda b_, n_, j: (b_, 0, n_, 0))
    row_all = pl.BlockSpec((None, t, g), lambda b_, n_, j: (b_, 0, n_))
    kv_blk = pl.BlockSpec((None, bk, None, h), lambda b_, n_, j: (b_, j, n_, 0))
    out_specs = [kv_blk, kv_blk]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if instrument:
        out_specs.append(_vis_spec(t // bq))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, t // bk, t // bq), jnp.int32))
    kernel = functools.partial(
        _dkv_kernel, window=window, scale=scale, bq=bq, bk=bk, g=g, nq=t // bq
    )
    return pl.pallas_call(
        kernel,
        grid=(b, kh, t // bk),
        in_specs=[q_all, kv_blk, kv_blk, q_all, row_all, row_all],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params(interpret, bs.num_warps_bwd, 2),
    )(q, k, v, do, lse, delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _swa(q, k, v, window, scale, bs, interpret):
    return _forward(q, k, v, window, scale, bs, interpret)[0]


def _swa_fwd(q, k, v, window, scale, bs, interpret):
    o, lse = _forward(q, k, v, window, scale, bs, interpret)
    return o, (q, k, v, o, lse)


def _swa_bwd(window, scale, bs, interpret, res, do):
    q, k, v, o, lse = res
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, T, N]
    dq = _dq(q, k, v, do, lse, delta, window, scale, bs, interpret)
    dk, dv = _dkv(q, k, v, do, lse, delta, window, scale, bs, interpret)
    return dq, dk, dv


_swa.defvjp(_swa_fwd, _swa_bwd)


def _prepare(q, k, v, block_sizes, interpret):
    """Pads T to the tiles and (on GPU) the group to a power of two; returns the kernel inputs."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    if block_sizes is None:
        block_sizes = BlockSizes.default(t, g, h)
        tiles = block_sizes.tiles()
        pad = -t % max(tiles)
    else:
        tiles = block_sizes.tiles()
        names = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")
        for name, size in zip(names, tiles):
            if t % size:
                raise ValueError(f"seq_len={t} must be a multiple of {name}={size}")
        pad = 0
    bs = block_sizes.resolved()
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    gp = padded_group(g, interpret, min(bs.block_q, bs.block_q_dq, bs.block_q_dkv))
    if gp > g:  # zero query heads, sliced off by the caller (zero cotangent)
        q = q.reshape(b, t + pad, kh, g, h)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0))).reshape(b, t + pad, -1, h)
    return q, k, v, bs, gp


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
      block_sizes: tiles; default ``BlockSizes.default(T, G)`` with T zero-padded to a multiple
        of the largest tile. Given explicitly, T must be a multiple of each.
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
    qp, kp, vp, bs, gp = _prepare(q, k, v, block_sizes, interpret)
    o = _swa(qp, kp, vp, window, scale, bs, interpret)
    if gp > g:
        o = o.reshape(b, -1, kh, gp, h)[:, :, :, :g].reshape(b, -1, n, h)
    return o[:, :t]


def sliding_window_visits(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int,
    block_sizes: BlockSizes,
) -> dict[str, np.ndarray]:
    """Blocks each program of the three kernels visits (interpret mode, instrumented).

    Returns:
      {'fwd', 'dq': int32 [B, K, T/block_q, T/block_k] per query block and key block,
       'dkv': [B, K, T/block_k, T/block_q] per key block and query block}: 0 not visited,
      1 visited without a mask, 2 visited with the band mask (3+ would be a repeat).
    """
    vis = _visits(q, k, v, window, block_sizes)
    return {name: np.asarray(x) for name, x in zip(("fwd", "dq", "dkv"), vis)}


@functools.partial(jax.jit, static_argnums=(3, 4))
def _visits(q, k, v, window, block_sizes):
    scale = default_scale(q.shape[-1], None)
    qp, kp, vp, bs, _ = _prepare(q, k, v, block_sizes, True)
    o, lse, vis_fwd = _forward(qp, kp, vp, window, scale, bs, True, instrument=True)
    do = jnp.ones_like(o)
    delta = jnp.sum(o.astype(jnp.float32), axis=-1)
    _, vis_dq = _dq(qp, kp, vp, do, lse, delta, window, scale, bs, True, instrument=True)
    *_, vis_dkv = _dkv(qp, kp, vp, do, lse, delta, window, scale, bs, True, instrument=True)
    return vis_fwd, vis_dq, vis_dkv
