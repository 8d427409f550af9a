"""Decode through the paged decode kernel with an int8 pool and an eviction mask: the same
numbers as the gathered / masked chunk path (up to the kernel tests' tolerance)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import paged_decode_cpu

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.paged_attention import paged_chunk
from agentrl_jax.precision import get_policy

NEVER = np.iinfo(np.int32).max
CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    layer_pattern="DF", window=8, sparse_block_size=4, sparse_topk_tokens=8, d_ff=48,
)  # fmt: skip
PAGE, J, P, P8 = 8, 6, 24, 20  # page size, pages per sequence, float / int8 pool pages
LENGTHS = [17, 40, 31, 9]  # cached before the decode row (mid-page, last page full, ...)
# the kernel tests' tolerances (fp32 reduction order; bf16 probabilities in P @ V)
TOL = {"fp32": dict(atol=2e-5, rtol=2e-5), "bf16": dict(atol=2e-2, rtol=2e-2)}


def _case(policy, int8: bool, evict: bool, gather: bool, seed: int = 0):
    """Random pools, tables, int8 pages (random codes: a page read from the wrong pool shows)
    and a keep mask; returns the paged_chunk arguments of one decode row."""
    rng = np.random.default_rng(seed)
    dt = policy.compute
    b, kh, h, n = len(LENGTHS), CFG.n_kv_heads, CFG.head_dim, CFG.n_heads
    lengths = np.asarray(LENGTHS, np.int32)
    tables = rng.permutation(P)[: b * J].reshape(b, J).astype(np.int32)
    tables[0, 4:] = -1  # unowned slots

    def f(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    cache = {"k": f(1, P, PAGE, kh, h), "v": f(1, P, PAGE, kh, h)}
    meta = {"lengths": jnp.asarray(lengths), "block_tables": jnp.asarray(tables)}
    s = J * PAGE
    if int8:
        for key in ("k8", "v8"):
            cache[key] = jnp.asarray(rng.integers(-127, 128, (1, P8, PAGE, kh, h)), jnp.int8)
        for key in ("ks", "vs"):
            cache[key] = jnp.asarray(rng.uniform(0.005, 0.02, (1, P8, kh)), jnp.float32)
        full = np.arange(J)[None, :] < (lengths // PAGE)[:, None]  # complete pages
        use8 = full & (rng.random((b, J)) < 0.6)
        use8[1, :2] = use8[2, 0] = True  # a row with several int8 pages
        ids8 = rng.permutation(P8)[: use8.sum()]
        tables8 = np.full((b, J), -1)
        tables8[use8] = ids8
        tables8[2, 0] = -1  # int8 decision in effect without an int8 page: its float page
        at = np.where(np.repeat(use8, PAGE, axis=1), 0, NEVER).astype(np.int32)
        tables[1, 0] = -1  # the float page of an int8 page freed
        meta.update(
            block_tables=jnp.asarray(tables), int8_tables=jnp.asarray(tables8.astype(np.int32)),
            int8_at=jnp.asarray(at),
        )  # fmt: skip
    if evict:
        keep = rng.random((b, s)) < 0.7
        keep[np.arange(b), lengths] = True  # the new token
        keep[3, : lengths[3]] = False  # everything before it evicted
        meta["keep"] = jnp.asarray(keep)
    if gather:
        cache["kmean"] = jnp.asarray(rng.standard_normal((1, b, kh, s // 4, h)), jnp.float32)
    q = f(b, 1, n, h)
    kd, vd = f(b, 1, kh, h), f(b, 1, kh, h)
    pos = jnp.asarray(lengths)[:, None]
    return (q, kd, vd, pos, cache, meta, jnp.ones((b, 1), bool), jnp.asarray(lengths + 1))


def spy_kernels(monkeypatch) -> list:
    """Records (page dtype, kv_mask given, return_lse, impl) of each paged decode call: through
    the dispatcher, or the C++ kernel called directly (sparse decode: a table per kv head)."""
    calls = []

    def spy(name, impl):
        real = getattr(kernels, name)

        def call(*a, **kw):
            mask, lse = kw.get("kv_mask") is not None, kw.get("return_lse", False)
            resolved = kernels.select_impl("paged_decode", kw.get("impl", impl))
            calls.append((a[1].dtype, mask, lse, resolved))
            return real(*a, **kw)

        monkeypatch.setattr(kernels, name, call)

    spy("paged_decode_attention", "auto")
    spy("paged_decode_attention_cpu", "cpu")
    return calls


@pytest.mark.parametrize(
    "kind,gather,int8,evict,policy",
    [
        ("D", False, True, True, "fp32"),
        ("D", False, True, False, "bf16"),
        ("D", False, False, True, "fp32"),
        ("F", False, True, True, "fp32"),
        ("F", False, False, True, "bf16"),
        ("F", True, True, True, "fp32"),
        ("F", True, True, False, "bf16"),
    ],
)
@pytest.mark.parametrize("impl", ["xla", "auto"])  # auto: the C++ kernel where it builds
def test_kernel_decode_matches_chunk_path(monkeypatch, kind, gather, int8, evict, policy, impl):
    pol = dataclasses.replace(get_policy(policy), kernel_impl=impl)
    cfg = CFG.replace(sparse_gather=gather)
    args = _case(pol, int8, evict, gather, seed=len(kind) + 2 * int8 + 3 * evict + 5 * gather)
    calls = spy_kernels(monkeypatch)

    @jax.jit
    def both(*a):
        run = lambda dk: paged_chunk(  # noqa: E731
            *a, jnp.int32(0), cfg=cfg, policy=pol, kind=kind, decode_kernel=dk, record=True
        )
        return run(False), run(True)

    (ref, ref_cache), (got, got_cache) = both(*args)
    assert calls, "the kernel path was not taken"
    native = impl == "auto" and paged_decode_cpu.available()
    assert {c[3] for c in calls} == {"cpu" if native else impl}
    if int8:  # one float-pool and one int8-pool call per page bucket, merged by lse
        assert {c[0] for c in calls} == {jnp.dtype(pol.compute), jnp.dtype(jnp.int8)}
        assert all(c[1] and c[2] for c in calls)
    elif evict:
        assert all(c[1] for c in calls)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref, np.float32), **TOL[policy]
    )
    if kind == "F":  # the same blocks selected
        np.testing.assert_array_equal(got_cache["blocks"], ref_cache["blocks"])
    for key in ("k", "v", "k8", "v8", "ks", "vs"):
        if key in ref_cache:
            np.testing.assert_array_equal(got_cache[key], ref_cache[key])


@pytest.mark.parametrize("int8", [True, False])
def test_sparse_kernel_per_head_calls_equal_one_call(monkeypatch, int8):
    """Sparse decode reads each kv head's own selected blocks. The XLA implementation: a loop of
    kernel calls, one per head; the Pallas ones vmap the kernel over the heads (forced here while
    the kernel itself still runs XLA); the C++ kernel: one call with a block table per head.
    All give the same numbers."""
    args = _case(get_policy("fp32"), int8, True, True, seed=7 + int8)
    cfg = CFG.replace(sparse_gather=True)
    calls = spy_kernels(monkeypatch)

    def run(impl):
        calls.clear()
        pol = dataclasses.replace(get_policy("fp32"), kernel_impl=impl)
        fn = functools.partial(paged_chunk, cfg=cfg, policy=pol, kind="F", decode_kernel=True)
        out, _ = jax.jit(fn)(*args, jnp.int32(0))
        return np.asarray(out), len(calls)

    looped, n_loop = run("xla")
    native, n_native = run("auto") if paged_decode_cpu.available() else (looped, None)
    monkeypatch.setattr(kernels, "select_impl", lambda *a, **k: "pallas")  # the vmap branch
    vmapped, n_vmap = run("xla")
    assert n_loop == CFG.n_kv_heads * n_vmap > 0  # per pool and bucket: one call per head / one
    np.testing.assert_allclose(looped, vmapped, **TOL["fp32"])
    if n_native is not None:
        assert n_native == 1 + int8  # one call per pool (no page buckets: it stops at lengths)
        np.testing.assert_allclose(native, looped, **TOL["fp32"])


def test_mass_and_sinks_keep_the_chunk_path(monkeypatch):
    """The attention-mass accumulator and sink logits still exclude the kernel."""
    pol = get_policy("fp32")
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda *a, **k: 1 / 0)
    q, kd, vd, pos, cache, meta, valid, new_len = _case(pol, True, True, False)
    mass = {**cache, "mass": jnp.zeros((1, len(LENGTHS), J * PAGE))}
    for c, sinks in ((mass, None), (cache, jnp.zeros((CFG.n_heads,)))):
        paged_chunk(
            q, kd, vd, pos, c, meta, valid, new_len, jnp.int32(0), cfg=CFG, policy=pol,
            kind="D", decode_kernel=True, sinks=sinks,
        )  # fmt: skip


@pytest.mark.parametrize("kind,gather", [("D", False), ("F", False), ("F", True)])
def test_each_pool_call_reads_only_its_pages(kind, gather):
    """Float pages that are read from the int8 pool and fully evicted float pages are poisoned
    with NaN: the kernel path never reads them (a masked read would give 0 * NaN), so its
    output is finite and equals the chunk path on the clean pools."""
    pol = get_policy("fp32")
    cfg = CFG.replace(sparse_gather=gather)
    q, kd, vd, pos, cache, meta, valid, new_len = _case(pol, True, True, gather, seed=11)
    tables = np.asarray(meta["block_tables"])
    use8 = np.asarray(meta["int8_at"]).reshape(len(LENGTHS), J, PAGE)[..., 0] == 0
    use8 &= np.asarray(meta["int8_tables"]) >= 0
    held = np.asarray(meta["keep"]).reshape(len(LENGTHS), J, PAGE).any(axis=2)
    poison = (use8 | ~held) & (tables >= 0)
    assert poison.sum() >= 3
    bad = {key: cache[key].at[0, tables[poison]].set(jnp.nan) for key in ("k", "v")}

    @functools.partial(jax.jit, static_argnums=1)
    def run(cache, decode_kernel):
        return paged_chunk(
            q, kd, vd, pos, cache, meta, valid, new_len, jnp.int32(0), cfg=cfg, policy=pol,
            kind=kind, decode_kernel=decode_kernel, record=True,
        )  # fmt: skip

    ref = run(cache, False)[0]
    got = run({**cache, **bad}, True)[0]
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **TOL["fp32"])
