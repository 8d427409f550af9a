"""sliding_window_attention: every impl against the fp32 reference (Pallas in interpret mode)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import sliding_window_attention, sliding_window_attention_reference
from agentrl_jax.kernels.sliding_window_pallas import (
    BlockSizes,
    key_block_range,
    query_block_range,
    sliding_window_attention_pallas,
    sliding_window_visits,
)

# One unoptimised XLA compile per case: XLA's CPU backend optimisations dominate test time.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# Tolerances per input dtype. bf16: outputs are rounded to bf16 (rel 2^-8) and the fast impls
# feed bf16 probabilities to the P@V matmul, so ~1e-2 absolute on O(1) outputs.
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)  # float32 inputs
# The Pallas kernels run in interpret mode with small, unequal tiles so the block loops and
# their bounds are exercised (T = 24: 3 query blocks, 6 key blocks).
IMPLS = {
    "xla": functools.partial(sliding_window_attention, impl="xla"),
    "pallas": functools.partial(
        sliding_window_attention_pallas,
        block_sizes=BlockSizes(block_q=8, block_k=4),
        interpret=True,
    ),
    # Backward tiles unlike the forward's: dq with wide key tiles, dkv with narrow query tiles.
    "pallas-bwd-tiles": functools.partial(
        sliding_window_attention_pallas,
        block_sizes=BlockSizes(block_q=4, block_k=8, block_q_dq=8, block_k_dq=8, block_q_dkv=2),
        interpret=True,
    ),
}
# (group size, window, dtype): every group size, window (1, small, >= T) and dtype.
CASES = [
    (1, 1, jnp.float32),
    (4, 5, jnp.bfloat16),
    (8, 40, jnp.float32),
    (8, 5, jnp.bfloat16),
]


def _inputs(b, t, kh, g, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, kh * g, d), (b, t, kh, d), (b, t, kh, d)]
    return [jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype)) for s in shapes]


def test_reference_window_one_returns_values():
    q, k, v = _inputs(1, 8, 2, 2, 4, jnp.float32)
    out = fast_jit(sliding_window_attention_reference, static_argnames="window")(q, k, v, window=1)
    np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=2), atol=1e-6)


def test_reference_matches_numpy_loop():
    q, k, v = _inputs(1, 7, 1, 2, 4, jnp.float32, seed=3)
    window = 3
    ref = fast_jit(sliding_window_attention_reference, static_argnames="window")
    out = np.asarray(ref(q, k, v, window=window))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for t in range(7):
        for n in range(2):
            lo = max(0, t - window + 1)
            s = kn[0, lo : t + 1, 0] @ qn[0, t, n] / 2.0
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vn[0, lo : t + 1, 0]
            np.testing.assert_allclose(out[0, t, n], want, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("g,window,dtype", CASES)
def test_matches_reference(impl, g, window, dtype):
    q, k, v = _inputs(2, 24, 2, g, 16, dtype, seed=g + window)

    @fast_jit
    def both(q, k, v):
        out = IMPLS[impl](q, k, v, window=window)
        return out, sliding_window_attention_reference(q, k, v, window=window)

    out, ref = both(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype]
    )


@pytest.mark.parametrize(
    "impl,window",
    [("xla", 3), ("pallas", 3), ("pallas", 13), ("pallas-bwd-tiles", 7), ("pallas-public", 24)],
)
def test_gradients_match_reference(impl, window):
    q, k, v, w = (
        _inputs(1, 24, 2, 4, 16, jnp.float32, seed=7)
        + _inputs(1, 24, 2, 4, 16, jnp.float32, seed=1)[:1]
    )

    def fn(q, k, v):
        if impl == "pallas-public":  # default tiles through the public entry point
            return sliding_window_attention(q, k, v, window=window, impl="pallas", interpret=True)
        return IMPLS[impl](q, k, v, window=window)

    def ref(q, k, v):
        return sliding_window_attention_reference(q, k, v, window=window)

    @fast_jit
    def grads(q, k, v):
        loss = lambda f, q, k, v: jnp.sum(f(q, k, v) * w)
        return [jax.grad(loss, argnums=(1, 2, 3))(f, q, k, v) for f in (fn, ref)]

    got, want = grads(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **GRAD_TOL)


@pytest.mark.parametrize(
    "t,window,g,dtype",
    [
        (77, 77, 2, jnp.float32),  # causal: 3 query chunks, the last one shorter
        (130, 200, 4, jnp.float32),  # causal: 4 chunks
        (64, 64, 2, jnp.bfloat16),
        (77, 20, 2, jnp.float32),  # banded: chunks of 20, the sequence padded to 80
        (70, 33, 4, jnp.float32),  # banded: two key chunks before each query chunk
        (48, 1, 2, jnp.float32),
        (64, 17, 2, jnp.bfloat16),
    ],
)
def test_xla_path_values_and_gradients_match_reference(t, window, g, dtype):
    """The XLA path (causal: query chunks; banded: chunks against the key chunks the window
    reaches) has a hand-written backward pass: values and gradients against autodiff of the
    reference. bf16: probabilities and dS go to the matmuls in bf16 (rel 2^-8 each), so
    gradients are held to 1% of their largest entry (autodiff of
    ``jax.nn.dot_product_attention`` is off by 0.6% at the causal case too)."""
    from agentrl_jax.kernels.chunked_causal import causal_chunks

    if window >= t:
        chunks = causal_chunks(t)
        assert len(chunks) >= 2 and chunks[0][0] == 0 and chunks[-1][1] == t
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    q, k, v = _inputs(2, t, 2, g, 16, dtype, seed=t + window)
    w = _inputs(2, t, 2, g, 16, jnp.float32, seed=t + 1)[0]

    @fast_jit
    def both(q, k, v):
        loss = lambda f, q, k, v: jnp.sum(f(q, k, v, window=window).astype(jnp.float32) * w)
        fns = (IMPLS["xla"], sliding_window_attention_reference)
        return [
            (f(q, k, v, window=window), jax.grad(loss, argnums=(1, 2, 3))(f, q, k, v)) for f in fns
        ]

    (out, got), (ref, want) = both(q, k, v)
    assert out.dtype == dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype]
    )
    for a, b in zip(got, want):
        assert a.dtype == dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, **GRAD_TOL)
        else:
            assert np.max(np.abs(a - b)) <= 1e-2 * np.max(np.abs(b))


def test_bad_inputs_raise():
    q, k, v = _inputs(1, 8, 2, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, k, v, window=0, impl="xla")
    with pytest.raises(ValueError, match="impl"):
        sliding_window_attention(q, k, v, window=2, impl="cuda")
    with pytest.raises(ValueError, match="impl='pallas_tpu'"):
        sliding_window_attention(q, k, v, window=2, impl="pallas_tpu")
    with pytest.raises(ValueError, match="q_heads"):
        sliding_window_attention(q[:, :, :3], k, v, window=2, impl="xla")


def test_pallas_block_sizes_must_divide_seq_len():
    q, k, v = _inputs(1, 12, 1, 1, 4, jnp.float32)
    with pytest.raises(ValueError, match="seq_len=12 must be a multiple of block_q=8"):
        sliding_window_attention_pallas(q, k, v, window=2, block_sizes=BlockSizes(8, 4))
    with pytest.raises(ValueError, match="block_q=0 must be >= 1"):
        BlockSizes(block_q=0)


def test_pallas_group_padding_keeps_values(monkeypatch):
    """On GPU a non-power-of-two group is padded (Triton tiles); check that path on CPU."""
    from agentrl_jax.kernels import sliding_window_pallas

    monkeypatch.setattr(sliding_window_pallas, "padded_group", lambda g, interpret, tokens=1: 4)
    q, k, v = _inputs(1, 16, 1, 3, 8, jnp.float32, seed=31)

    @fast_jit
    def both(q, k, v):
        out = IMPLS["pallas"](q, k, v, window=5)
        return out, sliding_window_attention_reference(q, k, v, window=5)

    out, ref = both(q, k, v)
    np.testing.assert_allclose(out, ref, **TOL[jnp.float32])


def _band_blocks(nq, nk, bq, bk, window):
    """[query block, key block] -> 0 outside the band, 1 if every pair is visible, 2 if some."""
    out = np.zeros((nq, nk), np.int32)
    for i in range(nq):
        for j in range(nk):
            qp = np.arange(i * bq, (i + 1) * bq)[:, None]
            kp = np.arange(j * bk, (j + 1) * bk)[None, :]
            vis = (kp <= qp) & (kp > qp - window)
            out[i, j] = 0 if not vis.any() else (1 if vis.all() else 2)
    return out


@pytest.mark.parametrize(
    "t,window,bq,bk",
    [(64, 20, 8, 4), (64, 9, 4, 8), (48, 48, 8, 8), (64, 1, 8, 8), (64, 33, 16, 4)],
)
def test_visits_only_the_band(t, window, bq, bk):
    """Forward, dq and dkv programs visit exactly the band's blocks, once each, and compute the
    mask only on the partial blocks at its edges."""
    q, k, v = _inputs(1, t, 1, 2, 8, jnp.float32, seed=t + window)
    bs = BlockSizes(block_q=bq, block_k=bk, block_q_dq=bq, block_k_dq=bk, block_q_dkv=bq)
    vis = sliding_window_visits(q, k, v, window=window, block_sizes=bs)
    want = _band_blocks(t // bq, t // bk, bq, bk, window)
    np.testing.assert_array_equal(vis["fwd"][0, 0], want)
    np.testing.assert_array_equal(vis["dq"][0, 0], want)
    np.testing.assert_array_equal(vis["dkv"][0, 0], want.T)


def test_block_ranges_cover_the_band_at_model_shapes():
    """The loop bounds alone (no kernel run) at T=32768, window 4096, 128-row tiles: visits per
    query block are the band's blocks, and the share of key blocks is ~window/T."""
    t, window, bq, bk = 32768, 4096, 32, 64
    want = _band_blocks(8, t // bk, bq, bk, window)  # first query blocks: partial band
    for i in range(8):
        lo, clo, chi, hi = (int(x) for x in key_block_range(i, bq, bk, window))
        got = np.zeros(t // bk, np.int32)
        got[lo:hi] = 2
        got[clo:chi] = 1
        np.testing.assert_array_equal(got, want[i])
    i = 600  # deep in the sequence
    lo, clo, chi, hi = (int(x) for x in key_block_range(i, bq, bk, window))
    assert (hi - lo) * bk <= window + bq + bk and chi - clo >= (window - bq) // bk - 2
    j = 100
    lo, clo, chi, hi = (int(x) for x in query_block_range(j, bq, bk, window, t // bq))
    assert (hi - lo) * bq <= window + bq + bk and lo == j * bk // bq
