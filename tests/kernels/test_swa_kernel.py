"""sliding_window_attention: every impl against the fp32 reference (Pallas in interpret mode)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import sliding_window_attention, sliding_window_attention_reference
from agentrl_jax.kernels.sliding_window_pallas import BlockSizes, sliding_window_attention_pallas

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


@pytest.mark.parametrize("impl,window", [("xla", 3), ("pallas", 3), ("pallas-public", 24)])
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


def test_bad_inputs_raise():
    q, k, v = _inputs(1, 8, 2, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, k, v, window=0, impl="xla")
    with pytest.raises(ValueError, match="impl"):
        sliding_window_attention(q, k, v, window=2, impl="cuda")
    with pytest.raises(ValueError, match="q_heads"):
        sliding_window_attention(q[:, :, :3], k, v, window=2, impl="xla")


def test_pallas_block_sizes_must_divide_seq_len():
    q, k, v = _inputs(1, 12, 1, 1, 4, jnp.float32)
    with pytest.raises(ValueError, match="seq_len=12 must be a multiple of block_q=8"):
        sliding_window_attention_pallas(q, k, v, window=2, block_sizes=BlockSizes(8, 4))


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
