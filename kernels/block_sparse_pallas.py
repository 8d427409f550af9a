"""Pallas flash kernels (forward, dq, dkv) for block-sparse causal GQA attention.

Selection: normalised in XLA to a sorted set per query group and compacted
(``block_sparse_xla.compact_selection``): the used blocks (selected, not after the group's last
token) form a prefix of each row, ascending, so the blocks every token of the group sees whole
come first and the ones that need the causal mask last.

Forward / dq: one program per tile of ``query_tile`` tokens (inside one query group) and kv
head; the tile's G query heads form ``[query_tile * G, H]`` rows read straight from the
``[B, T, heads, H]`` layout. Each inner step gathers ``keys_per_step / block_size`` selected
blocks into one ``[keys_per_step, H]`` K/V tile (row-index loads), so small blocks (e.g. 8
tokens) still feed full-size matmuls, and the loop runs ``ceil(count / blocks_per_step)``
steps: only the used blocks are read, the masked tail of the last step repeats the last block.
Steps made only of wholly visible blocks skip the mask.

dkv: one program per key block and kv head over the inverse selection (the query groups that
used that block, built in XLA by a sort), ``query_tile`` tokens at a time. Triton dots need
>= 16 rows, so for blocks smaller than that the program loads a ``dkv_keys``-row key tile
starting at its block and masks the columns past it (keys are zero-padded at the end).

``block_sparse_visits`` runs the kernels in interpret mode with a counter output and returns
which blocks (and query groups) each program visited.

Generic Pallas: ``interpret=True`` on CPU, the Triton lowering on GPU (power-of-two tiles: the
wrapper pads the group with zero query heads where needed).

Einsum legend: B batch, T time, K kv heads, G query heads per kv head, H head dim,
L selection slot.
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
from agentrl_jax.kernels.block_sparse_xla import (
    compact_selection,
    inverse_selection,
    normalize_block_indices,
)
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiles (0: chosen by ``resolve``).

    Attributes:
      keys_per_step: key rows gathered per forward / dq step (a multiple of block_size).
      query_tile: tokens per program (divides query_block).
      dkv_keys: key rows of a dkv program's tile (>= block_size; larger only pads).
      num_warps, num_stages: Triton launch parameters.
    """

    keys_per_step: int = 0
    query_tile: int = 0
    dkv_keys: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def resolve(self, block_size: int, query_block: int, group: int, interpret: bool):
        """Concrete (keys_per_step, query_tile, dkv_keys) for these shapes.

        Raises:
          ValueError: if an explicit tile does not fit the block size / query block.
        """
        kt = self.keys_per_step or max(block_size, 64)
        if kt % block_size:
            raise ValueError(f"keys_per_step={kt} must be a multiple of {block_size=}")
        g2 = group if interpret else 1 << max(0, (group - 1).bit_length())
        qt = self.query_tile or min(query_block & -query_block, max(1, 128 // g2))
        if query_block % qt:
            raise ValueError(f"{query_block=} must be a multiple of query_tile={qt}")
        ktd = self.dkv_keys or (block_size if interpret else max(block_size, 16))
        if ktd < block_size:
            raise ValueError(f"dkv_keys={ktd} must be >= {block_size=}")
        return kt, qt, ktd


def _rows(ref, start=None, size=None):
    """[tokens, G, H] (or [tokens, G]) tile -> [tokens * G, ...] rows."""
    x = ref[...] if start is None else ref[pl.ds(start, size)]
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _gather(sel_ref, step, bs, kt):
    """Selection slots and key positions of the ``kt`` key rows of one step."""
    r = jax.lax.broadcasted_iota(jnp.int32, (kt,), 0)
    slot = step * (kt // bs) + r // bs
    blk = sel_ref[jnp.minimum(slot, sel_ref.shape[0] - 1)]
    return slot, blk * bs + r % bs


def _count_slots(vis, sel_ref, step, bps, count, masked):
    """Instrumentation: visit of each slot's block (1 clean, 2 masked); last entry counts
    slots loaded past ``count`` (the tail of the last step)."""
    if not vis:
        return
    ref, n_sel = vis[0], sel_ref.shape[0]
    for j in range(bps):
        slot = step * bps + j
        blk = sel_ref[jnp.minimum(slot, n_sel - 1)]
        live = slot < count
        ref[blk] = ref[blk] + jnp.where(live, 2 if masked else 1, 0)
        ref[ref.shape[0] - 1] = ref[ref.shape[0] - 1] + jnp.where(live, 0, 1)


def _selected_loop(body, cnt_ref, bps, carry):
    """Clean steps (all blocks seen whole), then the masked ones, up to the used count."""
    count, n_whole = cnt_ref[0], cnt_ref[1]
    n_steps = pl.cdiv(count, bps)
    n_clean = jnp.minimum(n_whole // bps, n_steps)
    carry = jax.lax.fori_loop(0, n_clean, functools.partial(body, masked=False), carry)
    return jax.lax.fori_loop(n_clean, n_steps, functools.partial(body, masked=True), carry), count


def _fwd_kernel(q_ref, k_ref, v_ref, sel_ref, cnt_ref, o_ref, lse_ref, *vis, scale, bs, kt, qt, g):
    first = pl.program_id(2) * qt
    q = _rows(q_ref)
    rows, h = q.shape
    count = cnt_ref[0]
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(step, carry, masked):
        _count_slots(vis, sel_ref, step, kt // bs, count, masked)
        slot, kpos = _gather(sel_ref, step, bs, kt)
        k, v = k_ref[kpos, :], v_ref[kpos, :]
        s = qk_logits(q, k, scale)
        if masked:
            qpos = first + jax.lax.broadcasted_iota(jnp.int32, (rows, kt), 0) // g
            s = jnp.where((slot < count)[None, :] & (kpos[None, :] <= qpos), s, -jnp.inf)
        return online_softmax_step(carry, s, v)

    carry, _ = _selected_loop(body, cnt_ref, kt // bs, online_softmax_init(rows, h))
    out, lse = online_softmax_finish(carry)
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = lse.reshape(lse_ref.shape)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    sel_ref,
    cnt_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *vis,
    scale,
    bs,
    kt,
    qt,
    g,
):
    first = pl.program_id(2) * qt
    q, do, lse, delta = (_rows(r) for r in (q_ref, do_ref, lse_ref, delta_ref))
    rows = q.shape[0]
    count = cnt_ref[0]
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def body(step, dq, masked):
        _count_slots(vis, sel_ref, step, kt // bs, count, masked)
        slot, kpos = _gather(sel_ref, step, bs, kt)
        k, v = k_ref[kpos, :], v_ref[kpos, :]
        p = jnp.exp(qk_logits(q, k, scale) - lse[:, None])
        if masked:
            qpos = first + jax.lax.broadcasted_iota(jnp.int32, (rows, kt), 0) // g
            p = jnp.where((slot < count)[None, :] & (kpos[None, :] <= qpos), p, 0.0)
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dq + matmul_f32(ds.astype(k.dtype), k, (1, 0))

    dq, _ = _selected_loop(body, cnt_ref, kt // bs, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


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
    *vis,
    scale,
    bs,
    ktd,
    qb,
    qt,
    g,
):
    j = pl.program_id(2)
    k, v = k_ref[pl.ds(j * bs, ktd), :], v_ref[pl.ds(j * bs, ktd), :]
    rows = qt * g
    kpos = j * bs + jax.lax.broadcasted_iota(jnp.int32, (rows, ktd), 1)
    if vis:
        vis[0][...] = jnp.zeros(vis[0].shape, jnp.int32)

    def tile(u, carry, grp):
        dk, dv = carry
        t0 = grp * qb + u * qt
        q, do = _rows(q_ref, t0, qt), _rows(do_ref, t0, qt)
        lse, delta = _rows(lse_ref, t0, qt), _rows(delta_ref, t0, qt)
        qpos = t0 + jax.lax.broadcasted_iota(jnp.int32, (rows, ktd), 0) // g
        visible = kpos <= qpos
        if ktd > bs:  # columns past this block belong to the next one
            visible &= kpos < (j + 1) * bs
        p = jnp.where(visible, jnp.exp(qk_logits(q, k, scale) - lse[:, None]), 0.0)
        dv = dv + matmul_f32(p.astype(do.dtype), do, (0, 0))
        ds = p * (matmul_f32(do, v, (1, 1)) - delta[:, None])
        return dk + matmul_f32(ds.astype(q.dtype), q, (0, 0)), dv

    def entry(e, carry):
        grp = grp_ref[e]
        if vis:
            vis[0][grp] = vis[0][grp] + 1
        return jax.lax.fori_loop(0, qb // qt, functools.partial(tile, grp=grp), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(off_ref[j], off_ref[j + 1], entry, (zeros, zeros))
    dk_ref[...] = (dk * scale).reshape(dk_ref.shape).astype(dk_ref.dtype)
    dv_ref[...] = dv.reshape(dv_ref.shape).astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static configuration of one call (hashable: a custom_vjp nondiff argument)."""

    scale: float
    bs: int
    qb: int
    kt: int
    qt: int
    ktd: int
    num_warps: int
    num_stages: int
    interpret: bool


def _tile_specs(st, g, h, n_sel):
    """Per-tile specs of the forward / dq grid (B, K, tiles)."""
    per_group = st.qb // st.qt
    return dict(
        q=pl.BlockSpec((None, st.qt, g, h), lambda b, n, p: (b, p, n, 0)),
        row=pl.BlockSpec((None, st.qt, g), lambda b, n, p: (b, p, n)),
        sel=pl.BlockSpec((None, None, None, n_sel), lambda b, n, p: (b, n, p // per_group, 0)),
        cnt=pl.BlockSpec((None, None, None, 2), lambda b, n, p: (b, n, p // per_group, 0)),
    )


def _call(kernel, st, grid, in_specs, out_specs, out_shape, *args):
    params = None if st.interpret else gpu_compiler_params(st.num_warps, st.num_stages)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=st.interpret,
        compiler_params=params,
    )(*args)


def _forward(q, k, v, sel, cnt, st, instrument=False):
    b, tq, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g, n_sel = n // kh, sel.shape[-1]
    sp = _tile_specs(st, g, h, n_sel)
    kv = pl.BlockSpec((None, s_len, None, h), lambda b_, n_, p: (b_, 0, n_, 0))
    out_specs = [sp["q"], sp["row"]]
    out_shape = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((b, tq, n), jnp.float32),
    ]
    if instrument:
        nv = s_len // st.bs + 1
        out_specs.append(pl.BlockSpec((None, None, None, nv), lambda b_, n_, p: (b_, n_, p, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, tq // st.qt, nv), jnp.int32))
    kernel = functools.partial(_fwd_kernel, scale=st.scale, bs=st.bs, kt=st.kt, qt=st.qt, g=g)
    in_specs = [sp["q"], kv, kv, sp["sel"], sp["cnt"]]
    grid = (b, kh, tq // st.qt)
    return _call(kernel, st, grid, in_specs, out_specs, out_shape, q, k, v, sel, cnt)


def _dq(q, k, v, sel, cnt, do, lse, delta, st, instrument=False):
    b, tq, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g, n_sel = n // kh, sel.shape[-1]
    sp = _tile_specs(st, g, h, n_sel)
    kv = pl.BlockSpec((None, s_len, None, h), lambda b_, n_, p: (b_, 0, n_, 0))
    out_specs, out_shape = sp["q"], jax.ShapeDtypeStruct(q.shape, q.dtype)
    if instrument:
        nv = s_len // st.bs + 1
        vis = pl.BlockSpec((None, None, None, nv), lambda b_, n_, p: (b_, n_, p, 0))
        out_specs = [out_specs, vis]
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, kh, tq // st.qt, nv), jnp.int32)]
    kernel = functools.partial(_dq_kernel, scale=st.scale, bs=st.bs, kt=st.kt, qt=st.qt, g=g)
    in_specs = [sp["q"], kv, kv, sp["sel"], sp["cnt"], sp["q"], sp["row"], sp["row"]]
    grid = (b, kh, tq // st.qt)
    args = (q, k, v, sel, cnt, do, lse, delta)
    return _call(kernel, st, grid, in_specs, out_specs, out_shape, *args)


def _dkv(q, k, v, sel, cnt, do, lse, delta, st, instrument=False):
    b, tq, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g, ng = n // kh, sel.shape[2]
    nblk = (s_len - (st.ktd - st.bs)) // st.bs
    grp, off = inverse_selection(sel, cnt, nblk)
    q_all = pl.BlockSpec((None, tq, g, h), lambda b_, n_, j: (b_, 0, n_, 0))
    row_all = pl.BlockSpec((None, tq, g), lambda b_, n_, j: (b_, 0, n_))
    kv = pl.BlockSpec((None, s_len, None, h), lambda b_, n_, j: (b_, 0, n_, 0))
    grp_spec = pl.BlockSpec((None, None, grp.shape[-1]), lambda b_, n_, j: (b_, n_, 0))
    off_spec = pl.BlockSpec((None, None, nblk + 1), lambda b_, n_, j: (b_, n_, 0))
    if st.ktd == st.bs:  # dK/dV straight into the [B, S, K, H] layout
        blk = pl.BlockSpec((None, st.bs, None, h), lambda b_, n_, j: (b_, j, n_, 0))
        shape = (b, nblk * st.bs, kh, h)
    else:  # padded tiles, cut to the block below
        blk = pl.BlockSpec((None, None, None, st.ktd, h), lambda b_, n_, j: (b_, n_, j, 0, 0))
        shape = (b, kh, nblk, st.ktd, h)
    out_specs = [blk, blk]
    out_shape = [jax.ShapeDtypeStruct(shape, k.dtype), jax.ShapeDtypeStruct(shape, v.dtype)]
    if instrument:
        out_specs.append(pl.BlockSpec((None, None, None, ng), lambda b_, n_, j: (b_, n_, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kh, nblk, ng), jnp.int32))
    kernel = functools.partial(
        _dkv_kernel, scale=st.scale, bs=st.bs, ktd=st.ktd, qb=st.qb, qt=st.qt, g=g
    )
    in_specs = [q_all, kv, kv, grp_spec, off_spec, q_all, row_all, row_all]
    args = (q, k, v, grp, off, do, lse, delta)
    outs = _call(kernel, st, (b, kh, nblk), in_specs, out_specs, out_shape, *args)
    if st.ktd == st.bs:
        return outs
    dk, dv = (
        jnp.pad(
            x[:, :, :, : st.bs].reshape(b, kh, nblk * st.bs, h).transpose(0, 2, 1, 3),
            ((0, 0), (0, s_len - nblk * st.bs), (0, 0), (0, 0)),
        )
        for x in outs[:2]
    )
    return (dk, dv, *outs[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _bsa(q, k, v, sel, cnt, st):
    return _forward(q, k, v, sel, cnt, st)[0]


def _bsa_fwd(q, k, v, sel, cnt, st):
    o, lse = _forward(q, k, v, sel, cnt, st)
    return o, (q, k, v, sel, cnt, o, lse)


def _bsa_bwd(st, res, do):
    q, k, v, sel, cnt, o, lse = res
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dq = _dq(q, k, v, sel, cnt, do, lse, delta, st)
    dk, dv = _dkv(q, k, v, sel, cnt, do, lse, delta, st)
    return dq, dk, dv, None, None


_bsa.defvjp(_bsa_fwd, _bsa_bwd)


def _prepare(
    q, k, v, block_indices, block_size, softmax_scale, query_block, block_sizes, interpret
):
    b, t, n, h = q.shape
    kh = k.shape[2]
    g, bs, qb = n // kh, block_size, query_block
    kt, qt, ktd = (block_sizes or BlockSizes()).resolve(bs, qb, g, interpret)
    bsz = block_sizes or BlockSizes()
    st = _Static(
        default_scale(h, softmax_scale),
        bs,
        qb,
        kt,
        qt,
        ktd,
        bsz.num_warps,
        bsz.num_stages,
        bool(interpret),
    )
    nblk = -(-t // bs)
    idx = normalize_block_indices(block_indices[:, ::qb], nblk).transpose(0, 2, 1, 3)
    sel, cnt = jax.lax.stop_gradient(compact_selection(idx, bs, qb))  # [B, K, groups, L]
    groups = idx.shape[2]
    kpad = nblk * bs + (ktd - bs) - t
    if kpad:
        k, v = (jnp.pad(x, ((0, 0), (0, kpad), (0, 0), (0, 0))) for x in (k, v))
    gp = padded_group(g, interpret, qt)
    qpad = groups * qb - t
    if gp > g or qpad:  # zero query heads / tokens, sliced off below (zero cotangent)
        q = q.reshape(b, t, kh, g, h)
        q = jnp.pad(q, ((0, 0), (0, qpad), (0, 0), (0, gp - g), (0, 0))).reshape(b, t + qpad, -1, h)
    return q, k, v, sel, cnt, st, gp


def block_sparse_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Block-sparse attention through the Pallas kernels; differentiable in q, k, v.

    Args:
      q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; block_indices: int [B, T, Hkv, n_sel]
        (see ``block_sparse_attention``); keys are zero-padded to whole blocks, queries to a
        multiple of query_block.
      block_size: key block size.
      softmax_scale: logit scale; default 1/sqrt(D).
      query_block: tokens sharing the selection of the group's first token.
      block_sizes: kernel tiles (``BlockSizes``); default chosen from the shapes.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      [B, T, Hq, D] in q.dtype; zeros for queries with no visible key.

    Raises:
      ValueError: if explicit tiles do not fit block_size / query_block.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    args = (block_size, softmax_scale, query_block, block_sizes, interpret)
    qp, kp, vp, sel, cnt, st, gp = _prepare(q, k, v, block_indices, *args)
    o = _bsa(qp, kp, vp, sel, cnt, st)
    o = o.reshape(b, -1, kh, gp, h)[:, :t, :, :g]
    return o.reshape(b, t, n, h)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _visits(q, k, v, block_indices, block_size, query_block, block_sizes):
    args = (block_size, None, query_block, block_sizes, True)
    qp, kp, vp, sel, cnt, st, _ = _prepare(q, k, v, block_indices, *args)
    o, lse, vis_fwd = _forward(qp, kp, vp, sel, cnt, st, instrument=True)
    do = jnp.ones_like(o)
    delta = jnp.sum(o.astype(jnp.float32), axis=-1)
    _, vis_dq = _dq(qp, kp, vp, sel, cnt, do, lse, delta, st, instrument=True)
    *_, vis_dkv = _dkv(qp, kp, vp, sel, cnt, do, lse, delta, st, instrument=True)
    return vis_fwd, vis_dq, vis_dkv


def block_sparse_visits(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    query_block: int = 1,
    block_sizes: BlockSizes | None = None,
) -> dict[str, np.ndarray]:
    """What each program of the three kernels visits (interpret mode, instrumented).

    Returns:
      {'fwd', 'dq': int32 [B, K, tiles, num_blocks + 1]: per query tile, visits of each key
       block (1 without mask, 2 masked), and in the last column the slots loaded past the
       used count (the masked tail of the last step); 'dkv': [B, K, num_blocks, groups]: per
       key block, visits of each query group}.
    """
    vis_fwd, vis_dq, vis_dkv = _visits(q, k, v, block_indices, block_size, query_block, block_sizes)
    nv = vis_fwd.shape[-1]
    nblk = -(-q.shape[1] // block_size)
    # Keys padded for wide dkv tiles add block columns that can never be selected.
    keep = list(range(nblk)) + [nv - 1]
    return {
        "fwd": np.asarray(vis_fwd)[..., keep],
        "dq": np.asarray(vis_dq)[..., keep],
        "dkv": np.asarray(vis_dkv),
    }
