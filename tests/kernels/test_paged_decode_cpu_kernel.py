"""The C++ paged decode kernel (impl='cpu'): block tables per kv head against the reference per
head, its build cache, and what happens without it. The shared-table cases run with every other
impl in test_paged_decode_kernel.py."""

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import (
    paged_decode_attention,
    paged_decode_attention_cpu,
    paged_decode_attention_reference,
    paged_decode_cpu,
    select_impl,
)

pytestmark = pytest.mark.skipif(
    not paged_decode_cpu.available(), reason=str(paged_decode_cpu.unavailable_reason())
)
B, KH, G, H, PAGE, J, P = 3, 2, 3, 16, 4, 6, 40
# (head dim, page size): the kernel's generic rows, and its vector rows (head dims 32 / 64 / 128,
# pages of a multiple of 16 keys; G = 3 query heads per kv head, so an odd last head too)
ROW_SHAPES = [(H, PAGE), (64, 16), (32, 32), (128, 16)]


def _per_head_inputs(dtype, int8=False, seed=0, h=H, page=PAGE):
    """q, pools, and per kv head: tables [B, K, J] (junk past the pages in use), lengths
    [B, K] (0, partial pages, all J pages), kv_mask [B, K, J * page]."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, KH * G, h)).astype(np.float32)).astype(dtype)
    shape = (P, page, KH, h)
    scales = {}
    if int8:
        k, v = (jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2))
        scales = {n: jnp.asarray(rng.uniform(0.005, 0.02, (P, KH)), jnp.float32)
                  for n in ("k_scales", "v_scales")}  # fmt: skip
    else:
        k, v = (jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
                for _ in range(2))  # fmt: skip
    tables = rng.integers(0, P, (B, KH, J)).astype(np.int32)
    lengths = np.array([[0, 5], [J * page, 13 + page], [7, 1]], np.int32)
    past = np.arange(J)[None, None, :] * page >= lengths[..., None]
    tables = np.where(past, np.where(np.arange(J) % 2, -1, 10**6), tables)
    mask = rng.random((B, KH, J * page)) < 0.7
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(lengths))
    return args, jnp.asarray(mask), scales


def _per_head_reference(q, k, v, tables, lengths, kv_mask, window, scales):
    """The reference per kv head (its pool slice, its table): (out [B, N, H], lse [B, N])."""
    outs, lses = [], []
    for i in range(KH):
        sc = {n: s[:, i : i + 1] for n, s in scales.items()}
        o, lse = paged_decode_attention_reference(
            q[:, i * G : (i + 1) * G], k[:, :, i : i + 1], v[:, :, i : i + 1], tables[:, i],
            lengths[:, i], window=window, kv_mask=None if kv_mask is None else kv_mask[:, i],
            return_lse=True, **sc,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


@pytest.mark.parametrize("h,page", ROW_SHAPES)
@pytest.mark.parametrize(
    "dtype,int8,window,masked",
    [(jnp.float32, False, None, True), (jnp.float32, False, 5, False),
     (jnp.bfloat16, False, None, False), (jnp.float32, True, 6, True)],
)  # fmt: skip
def test_tables_per_kv_head_match_the_reference_per_head(dtype, int8, window, masked, h, page):
    (q, k, v, tables, lengths), mask, scales = _per_head_inputs(dtype, int8, seed=3, h=h, page=page)
    mask = mask if masked else None
    run = jax.jit(lambda *a: paged_decode_attention_cpu(
        *a, window=window, kv_mask=mask, return_lse=True, **scales))  # fmt: skip
    out, lse = run(q, k, v, tables, lengths)
    ref, ref_lse = _per_head_reference(q, k, v, tables, lengths, mask, window, scales)
    tol = dict(atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out, ref, **tol)
    np.testing.assert_allclose(lse, ref_lse, **tol)
    np.testing.assert_array_equal(out[0, :G], 0.0)  # length 0: zeros, lse -inf
    np.testing.assert_array_equal(lse[0, :G], -np.inf)
    plain = jax.jit(
        lambda *a: paged_decode_attention_cpu(*a, window=window, kv_mask=mask, **scales)
    )(q, k, v, tables, lengths)
    assert plain.dtype == dtype  # fmt: skip


def test_shared_table_is_the_same_as_one_per_head():
    (q, k, v, tables, lengths), mask, _ = _per_head_inputs(jnp.float32, seed=5)
    shared = paged_decode_attention_cpu(q, k, v, tables[:, 0], lengths[:, 0],
                                        kv_mask=mask[:, 0])  # fmt: skip
    per_head = paged_decode_attention_cpu(
        q, k, v, jnp.repeat(tables[:, :1], KH, 1), jnp.repeat(lengths[:, :1], KH, 1),
        kv_mask=jnp.repeat(mask[:, :1], KH, 1),
    )  # fmt: skip
    np.testing.assert_array_equal(shared, per_head)


@pytest.mark.parametrize("h,page", ROW_SHAPES[:2])
def test_a_nan_score_makes_its_row_nan_like_the_reference(h, page):
    (q, k, v, tables, lengths), _, _ = _per_head_inputs(jnp.float32, seed=9, h=h, page=page)
    k = k.at[tables[1, 0, 0], 2, 0].set(jnp.nan)  # a visible key of row 1, kv head 0
    out, lse = paged_decode_attention_cpu(q, k, v, tables, lengths, return_lse=True)
    ref, _ = _per_head_reference(q, k, v, tables, lengths, None, None, {})
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))  # that row only
    assert np.isnan(out[1, :G]).all() and np.isnan(lse[1, :G]).all()
    assert not np.isnan(lse[:, G:]).any() and not np.isnan(lse[0]).any()


def test_bad_inputs_raise():
    (q, k, v, tables, lengths), mask, _ = _per_head_inputs(jnp.float32)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention_cpu(q, k, v, tables[:, :, None], lengths)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention_cpu(q, k, v, tables, lengths[:2])
    with pytest.raises(ValueError, match="kv_mask"):
        paged_decode_attention_cpu(q, k, v, tables, lengths, kv_mask=mask[..., :-1])
    with pytest.raises(ValueError, match="int8 pages need"):
        paged_decode_attention_cpu(q, k.astype(jnp.int8), v.astype(jnp.int8), tables, lengths)
    with pytest.raises(ValueError, match="pages of one of"):
        paged_decode_attention_cpu(q, k.astype(jnp.float16), v.astype(jnp.float16), tables,
                                   lengths)  # fmt: skip
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention_cpu(q, k, v, tables, lengths, window=0)


def test_unavailable_kernel_falls_back_and_explains(monkeypatch):
    """Without a build, 'auto' keeps the XLA path and asking for 'cpu' says why."""
    load = paged_decode_cpu._load.__wrapped__  # uncached: the reasons it gives
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert load() == "no C++ compiler 'no-such-compiler' on PATH (set $CXX)"
    monkeypatch.setenv("AGENTRL_NATIVE_KERNELS", "0")
    assert load() == "disabled by AGENTRL_NATIVE_KERNELS=0"
    monkeypatch.setattr(paged_decode_cpu, "_load", lambda: "no C++ compiler 'c++' on PATH")
    assert select_impl("paged_decode", backend="cpu") == "xla"
    (q, k, v, tables, lengths), _, _ = _per_head_inputs(jnp.float32)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        paged_decode_attention(q, k, v, tables[:, 0], lengths[:, 0], impl="cpu")


def test_a_multi_device_mesh_keeps_the_xla_path():
    """The kernel has no SPMD partitioning rule (a sharded pool would be gathered whole for
    it): under a mesh of several devices, also while tracing, 'auto' picks XLA."""
    assert select_impl("paged_decode", backend="cpu") == "cpu"
    seen = []
    for n in (1, 2):
        mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:n])  # fmt: skip
        with jax.set_mesh(mesh):
            seen.append(select_impl("paged_decode", backend="cpu"))
            jax.jit(lambda x: seen.append(select_impl("paged_decode", backend="cpu")) or x)(1.0)
    assert seen == ["cpu", "cpu", "xla", "xla"]


def test_build_is_cached_and_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTRL_KERNEL_CACHE", str(tmp_path / "cache"))
    compiler = os.environ.get("CXX", "c++")
    lib = paged_decode_cpu._build(compiler)
    assert lib.parent == tmp_path / "cache" and lib.exists()
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporary file left
    stamp = lib.stat().st_mtime_ns
    assert paged_decode_cpu._build(compiler) == lib and lib.stat().st_mtime_ns == stamp
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(paged_decode_cpu, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="broken.cc"):
        paged_decode_cpu._build(compiler)
    assert sorted(p.name for p in lib.parent.iterdir()) == [lib.name]  # the failure left none
    with pytest.raises(subprocess.CalledProcessError):
        paged_decode_cpu._build("false")  # a "compiler" whose --version fails
