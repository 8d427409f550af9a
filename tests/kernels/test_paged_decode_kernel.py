"""paged_decode_attention: every impl against the fp32 reference (Pallas in interpret mode)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import (
    combine_attention,
    compact_pages,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_cpu,
)
from agentrl_jax.kernels.paged_decode_pallas import (
    BlockSizes,
    paged_decode_attention_pallas,
    paged_decode_visits,
)
from agentrl_jax.kernels.paged_decode_tpu import BlockSizes as TpuBlockSizes
from agentrl_jax.kernels.paged_decode_tpu import paged_decode_attention_pallas_tpu
from jax.experimental.pallas import tpu as pltpu

# One unoptimised XLA compile per case: XLA's CPU backend optimisations dominate test time.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# Per input dtype; bf16 outputs are rounded to bf16 and P@V takes bf16 probabilities.
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
IMPLS = {
    "xla": functools.partial(paged_decode_attention, impl="xla"),
    "cpu": functools.partial(paged_decode_attention, impl="cpu"),  # the C++ kernel
    "pallas": functools.partial(paged_decode_attention_pallas, interpret=True),
    # Two pages per step, two or four per split: tail steps past the owned pages, several
    # splits per sequence and empty splits, merged by the combine.
    "pallas-2pages": functools.partial(
        paged_decode_attention_pallas, block_sizes=BlockSizes(2, 2), interpret=True
    ),
    "pallas-splits": functools.partial(
        paged_decode_attention_pallas, block_sizes=BlockSizes(2, 4), interpret=True
    ),
}
# the C++ kernel's cases need it built (a C++ compiler)
CPU = pytest.param(
    "cpu",
    marks=pytest.mark.skipif(
        not paged_decode_cpu.available(), reason=str(paged_decode_cpu.unavailable_reason())
    ),
)
PAGE, MAX_PAGES, NUM_PAGES = 4, 5, 32
# Ragged lengths: a single token, a full last page, a partial page, the full table, empty.
LENGTHS = [1, 8, 13, MAX_PAGES * PAGE, 0]


def _inputs(kh, g, d, dtype, seed=0, int8=False):
    b = len(LENGTHS)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, kh * g, d), np.float32).astype(dtype))
    shape = (NUM_PAGES, PAGE, kh, d)
    if int8:
        k, v = (jnp.asarray(rng.integers(-127, 128, shape).astype(np.int8)) for _ in range(2))
        sk, sv = (
            jnp.asarray(rng.uniform(0.002, 0.02, (NUM_PAGES, kh)).astype(np.float32))
            for _ in range(2)
        )
        scales = dict(k_scales=sk, v_scales=sv)
    else:
        k, v = (jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype)) for _ in range(2))
        scales = {}
    # Each sequence owns distinct, shuffled pages; unowned table slots hold junk (-1 or huge).
    perm = rng.permutation(NUM_PAGES)[: b * MAX_PAGES].reshape(b, MAX_PAGES)
    owned = np.arange(MAX_PAGES)[None, :] * PAGE < np.array(LENGTHS)[:, None]
    junk = np.where(np.arange(MAX_PAGES) % 2, -1, 10**6)[None, :]
    tables = jnp.asarray(np.where(owned, perm, junk).astype(np.int32))
    return q, k, v, tables, jnp.asarray(LENGTHS, jnp.int32), scales


def test_reference_matches_numpy_loop():
    q, k, v, tables, lengths, _ = _inputs(2, 2, 8, jnp.float32, seed=1)
    ref = fast_jit(paged_decode_attention_reference, static_argnames="window")
    out = np.asarray(ref(q, k, v, tables, lengths, window=6))
    qn, kn, vn, tn = (np.asarray(x, np.float64) for x in (q, k, v, tables))
    for b, length in enumerate(LENGTHS):
        toks = [(int(tn[b, s // PAGE]), s % PAGE) for s in range(max(0, length - 6), length)]
        for n in range(4):
            if not toks:
                np.testing.assert_array_equal(out[b, n], 0.0)
                continue
            kk = np.stack([kn[p, o, n // 2] for p, o in toks])
            vv = np.stack([vn[p, o, n // 2] for p, o in toks])
            s = kk @ qn[b, n] / np.sqrt(8)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, n], (p / p.sum()) @ vv, atol=1e-5)


def _check(impl, dtype, window, q, k, v, tables, lengths, scales):
    fn = IMPLS[impl] if isinstance(impl, str) else impl

    @fast_jit
    def both(q, k, v, tables, lengths, scales):
        out = fn(q, k, v, tables, lengths, window=window, **scales)
        ref = paged_decode_attention_reference(q, k, v, tables, lengths, window=window, **scales)
        return out, ref

    out, ref = both(q, k, v, tables, lengths, scales)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # lengths == 0
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype]
    )


@pytest.mark.parametrize("impl", ["xla", CPU, "pallas", "pallas-splits"])
@pytest.mark.parametrize(
    "g,window,dtype",
    [(1, None, jnp.float32), (4, 6, jnp.bfloat16), (8, 1, jnp.float32), (4, None, jnp.bfloat16)],
)
def test_matches_reference(impl, g, window, dtype):
    _check(impl, dtype, window, *_inputs(2, g, 16, dtype, seed=g))


@pytest.mark.parametrize("impl", ["xla", CPU, "pallas", "pallas-2pages"])
@pytest.mark.parametrize("window,dtype", [(None, jnp.float32), (6, jnp.bfloat16)])
def test_int8_pages_match_reference(impl, window, dtype):
    _check(impl, dtype, window, *_inputs(2, 4, 16, dtype, seed=3, int8=True))


def test_bad_inputs_raise():
    q, k, v, tables, lengths, scales = _inputs(2, 2, 8, jnp.float32, int8=True)
    with pytest.raises(ValueError, match="k_scales"):
        paged_decode_attention(q, k, v, tables, lengths, impl="xla")
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, k, v, tables, lengths, window=0, impl="xla", **scales)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention(q, k, v, tables, lengths[:2], impl="xla", **scales)


def test_pallas_group_padding_keeps_values(monkeypatch):
    """On GPU the group is padded to 16 rows for Triton dots; check that path on CPU."""
    from agentrl_jax.kernels import paged_decode_pallas

    monkeypatch.setattr(paged_decode_pallas, "padded_group", lambda g, interpret, tokens=1: 16)
    _check("pallas", jnp.float32, None, *_inputs(2, 4, 16, jnp.float32, seed=5))


# --- impl='pallas_tpu': the scalar-prefetch kernel under pltpu.InterpretParams (TPU semantics:
# simulated DMAs, NaN-filled scratch, out-of-bounds reads raise). ~20x slower than
# interpret=True, so one representative per case runs by default; KERNEL_TESTS_FULL=1 runs all.
slow = pytest.mark.skipif(
    os.environ.get("KERNEL_TESTS_FULL") != "1",
    reason="slow InterpretParams grid point; KERNEL_TESTS_FULL=1 runs it",
)


def _tpu(ppb=1, interpret=None):
    """The public op (routing + validation) for one page per step, the kernel module for more."""
    interpret = pltpu.InterpretParams() if interpret is None else interpret
    if ppb == 1:
        return functools.partial(paged_decode_attention, impl="pallas_tpu", interpret=interpret)
    return functools.partial(
        paged_decode_attention_pallas_tpu,
        block_sizes=TpuBlockSizes(pages_per_block=ppb),
        interpret=interpret,
    )


@pytest.mark.parametrize(
    "g,window,dtype,int8,ppb",
    [
        (1, None, jnp.float32, False, 1),
        (4, 6, jnp.bfloat16, True, 2),
        pytest.param(4, None, jnp.float32, False, 1, marks=slow),
        pytest.param(1, 6, jnp.bfloat16, False, 2, marks=slow),
        pytest.param(4, None, jnp.bfloat16, True, 1, marks=slow),
        pytest.param(1, 1, jnp.float32, True, 1, marks=slow),
        pytest.param(4, 6, jnp.float32, False, 2, marks=slow),
        pytest.param(4, 20, jnp.float32, True, 3, marks=slow),  # window >= every length
    ],
)
def test_pallas_tpu_matches_reference(g, window, dtype, int8, ppb):
    """Lengths 1, 8 (full last page), 13, 20 (full table), 0; -1 and junk table slots."""
    _check(_tpu(ppb), dtype, window, *_inputs(2, g, 16, dtype, seed=g + 7, int8=int8))


@slow
def test_pallas_tpu_generic_interpret_and_vmap():
    """interpret=True runs the same kernel; vmap over kv heads as the rollout's sparse decode
    calls it (per-head pages, block tables and lengths: batched scalar-prefetch operands)."""
    q, k, v, tables, lengths, _ = _inputs(2, 2, 16, jnp.float32, seed=9)
    tables2, lengths2 = jnp.stack([tables, tables[::-1]], 1), jnp.stack([lengths, lengths[::-1]], 1)
    qg = q.reshape(q.shape[0], 2, 2, 16)

    def per_head(f):
        g = lambda q, k, v, t, n: f(q, k[:, :, None], v[:, :, None], t, n)
        return jax.vmap(g, in_axes=(1, 2, 2, 1, 1), out_axes=1)(qg, k, v, tables2, lengths2)

    out = per_head(_tpu(interpret=True))
    np.testing.assert_allclose(out, per_head(paged_decode_attention_reference), **TOL[jnp.float32])


def test_pallas_tpu_compiled_off_tpu_raises():
    with pytest.raises(ValueError, match="only on TPU"):
        _tpu(interpret=False)(*_inputs(1, 1, 8, jnp.float32)[:5])


@pytest.mark.parametrize("window,bsz", [(None, BlockSizes(2, 2)), (6, BlockSizes(1, 1))])
def test_visits_only_the_live_pages(window, bsz):
    """The programs of a sequence read each page slot it owns (or, with a window, each slot
    the window reaches) exactly once, nothing else, and load at most one partial step of
    padding per split."""
    q, k, v, tables, lengths, _ = _inputs(2, 2, 8, jnp.float32, seed=17)
    vis = paged_decode_visits(q, k, v, tables, lengths, window=window, block_sizes=bsz)
    for b, length in enumerate(LENGTHS):
        first = 0 if window is None else max(length - window, 0)
        want = np.zeros(MAX_PAGES, np.int32)
        want[first // PAGE : -(-length // PAGE)] = 1
        for kv_head in range(2):
            got = vis[b, kv_head]  # [splits, max_pages + 1]
            np.testing.assert_array_equal(got[:, :-1].sum(axis=0), want)
            assert np.all(got[:, -1] < bsz.pages_per_block)


# --- kv_mask (per-token key mask) and return_lse (merging calls over disjoint key sets).


def _kv_mask(seed):
    """Random keep mask with an all-false page (slot 1) and an all-false row (sequence 1)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((len(LENGTHS), MAX_PAGES * PAGE)) < 0.6
    mask[:, PAGE : 2 * PAGE] = False
    mask[1] = False
    return jnp.asarray(mask)


def _tpu_impl(ppb):
    return functools.partial(
        paged_decode_attention_pallas_tpu,
        block_sizes=TpuBlockSizes(pages_per_block=ppb),
        interpret=pltpu.InterpretParams(),
    )


LSE_IMPLS = {**IMPLS, "pallas_tpu": _tpu_impl(2)}


def _check_lse(fn, dtype, window, q, k, v, tables, lengths, scales, kv_mask):
    @fast_jit
    def both(q, k, v, tables, lengths, scales, kv_mask):
        kw = dict(window=window, kv_mask=kv_mask, return_lse=True, **scales)
        return fn(q, k, v, tables, lengths, **kw), paged_decode_attention_reference(
            q, k, v, tables, lengths, **kw
        )

    (out, lse), (ref, ref_lse) = both(q, k, v, tables, lengths, scales, kv_mask)
    assert out.dtype == jnp.float32 and lse.shape == q.shape[:2]
    for row in (1, len(LENGTHS) - 1):  # all masked, lengths == 0: zeros and -inf, no NaN
        np.testing.assert_array_equal(out[row], 0.0)
        np.testing.assert_array_equal(lse[row], -np.inf)
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, **TOL[dtype])
    plain = fast_jit(lambda *a: fn(*a[:5], window=window, kv_mask=a[5], **a[6]))
    got = plain(q, k, v, tables, lengths, kv_mask, scales)
    assert got.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref.astype(dtype), np.float32), **TOL[dtype]
    )


@pytest.mark.parametrize("impl", ["xla", CPU, "pallas", "pallas-splits"])
@pytest.mark.parametrize(
    "window,dtype,int8", [(None, jnp.float32, False), (6, jnp.bfloat16, False),
                          (None, jnp.bfloat16, True), (9, jnp.float32, True)],
)  # fmt: skip
def test_kv_mask_and_lse_match_reference(impl, window, dtype, int8):
    inputs = _inputs(2, 4, 16, dtype, seed=21, int8=int8)
    _check_lse(IMPLS[impl], dtype, window, *inputs, _kv_mask(22))


def test_kv_mask_and_lse_pallas_tpu():
    """The scalar-prefetch kernel under TPU semantics: int8 pages, a window, two pages/step."""
    inputs = _inputs(2, 4, 16, jnp.bfloat16, seed=23, int8=True)
    _check_lse(_tpu_impl(2), jnp.bfloat16, 9, *inputs, _kv_mask(24))


def test_reference_lse_matches_numpy():
    q, k, v, tables, lengths, _ = _inputs(2, 2, 8, jnp.float32, seed=25)
    mask = _kv_mask(26)
    out, lse = paged_decode_attention_reference(
        q, k, v, tables, lengths, kv_mask=mask, return_lse=True
    )
    qn, kn, tn, mn = (np.asarray(x, np.float64) for x in (q, k, tables, mask))
    for b, length in enumerate(LENGTHS):
        toks = [(int(tn[b, s // PAGE]), s % PAGE) for s in range(length) if mn[b, s]]
        for n in range(4):
            if not toks:
                assert lse[b, n] == -np.inf and not np.asarray(out[b, n]).any()
                continue
            s = np.stack([kn[p, o, n // 2] for p, o in toks]) @ qn[b, n] / np.sqrt(8)
            want = s.max() + np.log(np.exp(s - s.max()).sum())
            np.testing.assert_allclose(lse[b, n], want, rtol=1e-5)


def _two_pools(dtype, seed):
    """A float pool and an int8 pool; each logical page read from one of them (``use8``), a
    keep mask over tokens. Returns (q, float inputs, int8 inputs, per-token use8, keep, union
    inputs: one float32 pool holding both, dequantised)."""
    q, k, v, tables, lengths, _ = _inputs(2, 4, 16, dtype, seed=seed)
    _, k8, v8, _, _, scales = _inputs(2, 4, 16, dtype, seed=seed + 1, int8=True)
    rng = np.random.default_rng(seed + 2)
    tables8 = jnp.asarray(rng.permutation(NUM_PAGES)[: len(LENGTHS) * MAX_PAGES])
    tables8 = tables8.reshape(len(LENGTHS), MAX_PAGES).astype(jnp.int32)
    use8 = jnp.asarray(rng.random((len(LENGTHS), MAX_PAGES)) < 0.5).at[0, 0].set(True)
    use8_tok = jnp.repeat(use8, PAGE, axis=1)
    keep = _kv_mask(seed + 3).at[1].set(True)
    deq = lambda c, s: c.astype(jnp.float32) * s[:, None, :, None]  # noqa: E731
    union_k = jnp.concatenate([k.astype(jnp.float32), deq(k8, scales["k_scales"])])
    union_v = jnp.concatenate([v.astype(jnp.float32), deq(v8, scales["v_scales"])])
    union_tables = jnp.where(use8, NUM_PAGES + tables8, tables)
    return (
        q,
        (k, v, tables),
        (k8, v8, tables8, scales),
        use8_tok,
        keep,
        (union_k, union_v, union_tables, lengths),
    )


@pytest.mark.parametrize("impl", ["xla", CPU, "pallas-splits", "pallas_tpu"])
@pytest.mark.parametrize("window,dtype", [(None, jnp.float32), (9, jnp.bfloat16)])
def test_float_and_int8_pools_combine_to_the_union(impl, window, dtype):
    """A float-pool call and an int8-pool call, merged by lse, equal attention over the union
    of their keys (the reference over one pool holding both)."""
    if impl == "pallas_tpu" and dtype == jnp.float32:
        pytest.skip("one TPU-semantics case is enough")
    q, (k, v, tables), (k8, v8, tables8, scales), use8, keep, union = _two_pools(dtype, 31)
    fn = LSE_IMPLS[impl]

    @fast_jit
    def merged(q, k, v, tables, k8, v8, tables8, scales, use8, keep, lengths):
        kw = dict(window=window, return_lse=True)
        f = fn(q, k, v, tables, lengths, kv_mask=keep & ~use8, **kw)
        i8 = fn(q, k8, v8, tables8, lengths, kv_mask=keep & use8, **scales, **kw)
        return combine_attention([f[0], i8[0]], [f[1], i8[1]])

    uk, uv, ut, lengths = union
    out, lse = merged(q, k, v, tables, k8, v8, tables8, scales, use8, keep, lengths)
    ref, ref_lse = paged_decode_attention_reference(
        q.astype(jnp.float32), uk, uv, ut, lengths, window=window, kv_mask=keep, return_lse=True
    )
    _check_union(out, lse, ref, ref_lse, dtype)


def _check_union(out, lse, ref, ref_lse, dtype):
    """Merged two-pool output and lse against the reference over the union; the last row has
    nothing in either pool (zeros, lse -inf)."""
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[-1], 0.0)  # lengths == 0 in both pools
    np.testing.assert_array_equal(lse[-1], -np.inf)
    np.testing.assert_allclose(out, ref, **TOL[dtype])
    np.testing.assert_allclose(lse, ref_lse, **TOL[dtype])


def test_compact_pages_matches_numpy_loop():
    """Pages with a visible key first, in logical order; the rest padded with the row's first
    page (or pad_id if it has none); the mask follows its pages; lengths = pages * page size."""
    rng = np.random.default_rng(51)
    tables = rng.integers(-1, NUM_PAGES, (3, 2, MAX_PAGES)).astype(np.int32)
    visible = rng.random((3, 2, MAX_PAGES * PAGE)) < 0.3
    visible[0, 0] = False  # no page at all
    visible[1, 1] = True  # every page
    t, lengths, mask, pages = compact_pages(jnp.asarray(tables), jnp.asarray(visible), PAGE)
    for idx in np.ndindex(3, 2):
        by_page = visible[idx].reshape(MAX_PAGES, PAGE)
        keep = [j for j in range(MAX_PAGES) if by_page[j].any()]
        pad = tables[idx][keep[0]] if keep else 0
        want_t = [tables[idx][j] for j in keep] + [pad] * (MAX_PAGES - len(keep))
        want_m = np.zeros((MAX_PAGES, PAGE), bool)
        want_m[: len(keep)] = by_page[keep]
        np.testing.assert_array_equal(t[idx], want_t)
        np.testing.assert_array_equal(mask[idx], want_m.reshape(-1))
        assert pages[idx] == len(keep) and lengths[idx] == len(keep) * PAGE
    with pytest.raises(ValueError, match="visible"):
        compact_pages(jnp.asarray(tables), jnp.asarray(visible[..., :-1]), PAGE)
    with pytest.raises(ValueError, match="page_size"):
        compact_pages(jnp.asarray(tables), jnp.asarray(visible), 0)


@pytest.mark.parametrize("impl", ["xla", CPU, "pallas-splits", "pallas_tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compacted_pools_combine_to_the_union(impl, dtype):
    """Each pool's call over a table of only its pages holding a visible key (the bucket's
    width: padded tail included), merged by lse, equals attention over the union of the keys.
    Rows: int8 and float pages mixed, all int8, all float, evicted keys, lengths 0."""
    if impl == "pallas_tpu" and dtype == jnp.float32:
        pytest.skip("one TPU-semantics case is enough")
    q, (k, v, tables), (k8, v8, tables8, scales), use8, keep, union = _two_pools(dtype, 53)
    uk, uv, _, lengths = union
    use8 = use8.at[1].set(True).at[2].set(False)  # row 1 all int8, row 2 all float
    union_tables = jnp.where(use8[:, ::PAGE], NUM_PAGES + tables8, tables)
    visible = keep & (jnp.arange(MAX_PAGES * PAGE)[None, :] < lengths[:, None])
    fn = LSE_IMPLS[impl]
    parts = [(k, v, tables, {}, visible & ~use8), (k8, v8, tables8, scales, visible & use8)]
    pages = [compact_pages(p[2], p[4], PAGE)[3] for p in parts]
    widths = [int(jnp.max(n)) + 1 if impl == "xla" else MAX_PAGES for n in pages]

    @functools.partial(jax.jit, static_argnums=0)
    def merged(widths, q, parts):
        outs = []
        for n, (kp, vp, t, sc, vis) in zip(widths, parts, strict=True):
            ct, lens, mask, _ = compact_pages(t, vis, PAGE)
            n = min(n, MAX_PAGES)
            outs.append(fn(q, kp, vp, ct[:, :n], lens, kv_mask=mask[:, : n * PAGE],
                           return_lse=True, **sc))  # fmt: skip
        return combine_attention([o[0] for o in outs], [o[1] for o in outs])

    out, lse = merged(tuple(widths), q, parts)
    ref, ref_lse = paged_decode_attention_reference(
        q.astype(jnp.float32), uk, uv, union_tables, lengths, kv_mask=keep, return_lse=True
    )
    np.testing.assert_array_equal(pages[0][1], 0)  # all-int8 row: no float page visited
    np.testing.assert_array_equal(pages[1][2], 0)  # all-float row: no int8 page visited
    _check_union(out, lse, ref, ref_lse, dtype)


def test_pallas_visits_only_the_compacted_pages():
    """The split-K kernel over a compacted table reads exactly the pool's pages that hold a
    visible key, however wide the table."""
    q, (k, v, tables), _, use8, keep, _ = _two_pools(jnp.float32, 57)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    visible = keep & ~use8 & (jnp.arange(MAX_PAGES * PAGE)[None, :] < lengths[:, None])
    ct, lens, _, pages = compact_pages(tables, visible, PAGE)
    vis = paged_decode_visits(q, k, v, ct, lens, block_sizes=BlockSizes(2, 2))
    want = (np.arange(MAX_PAGES)[None, :] < np.asarray(pages)[:, None]).astype(np.int32)
    for kv_head in range(2):
        np.testing.assert_array_equal(vis[:, kv_head, :, :-1].sum(axis=1), want)
    assert (
        0
        < int(pages.sum())
        < int(
            jnp.sum(
                jnp.any(
                    (jnp.arange(MAX_PAGES * PAGE) < lengths[:, None]).reshape(-1, MAX_PAGES, PAGE),
                    -1,
                )
            )
        )
    )


def test_combine_attention_edge_cases():
    """One empty part leaves the other unchanged; all parts empty give 0 and -inf; the merge
    of two halves of a softmax is the whole softmax."""
    rng = np.random.default_rng(41)
    o = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    empty = jnp.full((3, 4), -jnp.inf)
    out, got = combine_attention([o, jnp.zeros_like(o)], [lse, empty])
    np.testing.assert_allclose(out, o, rtol=1e-6)
    np.testing.assert_allclose(got, lse)
    out, got = combine_attention([o, o], [empty, empty])
    assert not np.asarray(out).any() and np.all(np.asarray(got) == -np.inf)
    s, vals = rng.standard_normal(10), rng.standard_normal((10, 8))
    soft = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # noqa: E731
    lse_of = lambda x: x.max() + np.log(np.exp(x - x.max()).sum())  # noqa: E731
    parts = [(soft(s[:4]) @ vals[:4], lse_of(s[:4])), (soft(s[4:]) @ vals[4:], lse_of(s[4:]))]
    out, got = combine_attention(
        [jnp.asarray(p[0], jnp.float32) for p in parts], [jnp.float32(p[1]) for p in parts]
    )
    np.testing.assert_allclose(out, soft(s) @ vals, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, lse_of(s), rtol=1e-6)
    with pytest.raises(ValueError, match="lses"):
        combine_attention([o], [])


def test_bad_kv_mask_raises():
    q, k, v, tables, lengths, _ = _inputs(2, 2, 8, jnp.float32)
    with pytest.raises(ValueError, match="kv_mask"):
        paged_decode_attention(q, k, v, tables, lengths, kv_mask=jnp.ones((5, 3), bool))
    with pytest.raises(ValueError, match="kv_mask"):
        paged_decode_attention(
            q, k, v, tables, lengths, kv_mask=jnp.ones((5, MAX_PAGES * PAGE), jnp.int32)
        )
