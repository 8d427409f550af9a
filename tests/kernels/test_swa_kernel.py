"""sliding_window_attention: every impl against the fp32 reference (Pallas in interpret mode)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import sliding_window_attention, sliding_window_attention_reference

# One unoptimised XLA compile per case: XLA's CPU backend optimisations dominate test time.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# Tolerances per input dtype. bf16: outputs are rounded to bf16 (rel 2^-8) and the fast impls
# feed bf16 probabilities to the P@V matmul, so ~1e-2 absolute on O(1) outputs.
TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)  # float32 inputs
IMPLS = [("xla", False)]


def _inputs(b, t, kh, g, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, kh * g, d), (b, t, kh, d), (b, t, kh, d)]
    return [jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype)) for s in shapes]


def test_reference_window_one_returns_values():
    q, k, v = _inputs(1, 8, 2, 2, 4, jnp.float32)
    out = sliding_window_attention_reference(q, k, v, window=1)
    np.testing.assert_allclose(out, jnp.repeat(v, 2, axis=2), atol=1e-6)


def test_reference_matches_numpy_loop():
    q, k, v = _inputs(1, 7, 1, 2, 4, jnp.float32, seed=3)
    window = 3
    out = np.asarray(sliding_window_attention_reference(q, k, v, window=window))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    for t in range(7):
        for n in range(2):
            lo = max(0, t - window + 1)
            s = kn[0, lo : t + 1, 0] @ qn[0, t, n] / 2.0
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vn[0, lo : t + 1, 0]
            np.testing.assert_allclose(out[0, t, n], want, atol=1e-5)


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("window", [1, 5, 40])
def test_matches_reference(impl, interpret, dtype, g, window):
    q, k, v = _inputs(2, 24, 2, g, 16, dtype, seed=g + window)

    @fast_jit
    def both(q, k, v):
        out = sliding_window_attention(q, k, v, window=window, impl=impl, interpret=interpret)
        return out, sliding_window_attention_reference(q, k, v, window=window)

    out, ref = both(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[dtype]
    )


@pytest.mark.parametrize("impl,interpret", IMPLS)
@pytest.mark.parametrize("window", [3, 24])
def test_gradients_match_reference(impl, interpret, window):
    q, k, v, w = (
        _inputs(1, 24, 2, 4, 16, jnp.float32, seed=7)
        + _inputs(1, 24, 2, 4, 16, jnp.float32, seed=1)[:1]
    )

    def fn(q, k, v):
        return sliding_window_attention(q, k, v, window=window, impl=impl, interpret=interpret)

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
