"""kernels/skinny_matmul_cpu: the C++ few-rows matmul against packed column panels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import skinny_matmul_cpu as sk

needs_kernel = pytest.mark.skipif(not sk.available(), reason=str(sk.unavailable_reason()))


def _close(got, want):
    """float32 sums over K in another order than the reference's: relative to the output's
    scale, a few ulps of the largest partial sum."""
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 100])
def test_pack_lays_columns_out_in_zero_padded_panels(n):
    w = jax.random.normal(jax.random.key(0), (7, n))
    packed = sk.pack(w)
    panels = -(-n // sk.PANEL)
    assert packed.shape == (panels, 7, sk.PANEL)
    np.testing.assert_array_equal(sk.unpack(packed, n), w)
    np.testing.assert_array_equal(packed[0, :, : min(n, sk.PANEL)], w[:, : sk.PANEL])
    assert not np.any(np.asarray(packed).transpose(1, 0, 2).reshape(7, -1)[:, n:])
    stacked = jax.random.normal(jax.random.key(1), (3, 7, n))  # leading axes kept
    np.testing.assert_array_equal(sk.pack(stacked)[2], sk.pack(stacked[2]))


@needs_kernel
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 5, 33), (3, 64, 128), (8, 256, 1536), (13, 768, 256), (32, 256, 1024), (9, 300, 70)],
)
def test_kernel_matches_the_reference(m, k, n):
    """Row counts around the 8-row register block, a ragged last panel, a weight under and
    over the size that wakes XLA's pool threads (256 KB)."""
    kx, kw = jax.random.split(jax.random.key(m * 1000 + n))
    x = jax.random.normal(kx, (m, k))
    w = jax.random.normal(kw, (k, n))
    packed = sk.pack(w)
    got = jax.jit(sk.skinny_matmul, static_argnums=2)(x, packed, n)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    _close(got, sk.skinny_matmul_reference(x, packed, n))
    _close(got, np.asarray(x, np.float64) @ np.asarray(w, np.float64))


@needs_kernel
def test_leading_axes_vmap_and_loops():
    x = jax.random.normal(jax.random.key(2), (2, 3, 64))
    w = jax.random.normal(jax.random.key(3), (64, 96))
    packed = sk.pack(w)
    want = sk.skinny_matmul_reference(x, packed, 96)
    _close(sk.skinny_matmul(x, packed, 96), want)
    _close(jax.vmap(lambda r: sk.skinny_matmul(r, packed, 96))(x), want)

    def body(i, y):  # the kernel inside a compiled loop, as the decode calls it
        return jnp.tanh(sk.skinny_matmul(y, sk.pack(jnp.eye(96)[:64, :64] * 1.5), 64))

    y0 = jax.random.normal(jax.random.key(4), (5, 64))
    got = jax.jit(lambda y: jax.lax.fori_loop(0, 3, body, y))(y0)
    want = y0
    for _ in range(3):
        want = jnp.tanh(want * 1.5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("g,m,k,n", [(8, 4, 256, 384), (3, 1, 40, 70), (2, 13, 64, 32)])
def test_grouped_matmul_matches_the_reference(g, m, k, n):
    """G weights (a MoE layer's experts) against G row blocks in one call."""
    kx, kw = jax.random.split(jax.random.key(g * 100 + m))
    x = jax.random.normal(kx, (g, m, k))
    w = jax.random.normal(kw, (g, k, n))
    packed = sk.pack(w)
    assert packed.shape == (g, -(-n // sk.PANEL), k, sk.PANEL)
    got = jax.jit(sk.skinny_matmul, static_argnums=2)(x, packed, n)
    assert got.shape == (g, m, n)
    _close(got, sk.skinny_matmul_reference(x, packed, n))
    _close(got, jnp.einsum("gmk,gkn->gmn", x, w, precision="highest"))
    with pytest.raises(ValueError, match=r"x \[G, M, K\]"):
        sk.skinny_matmul(x[:-1], packed, n)


@needs_kernel
def test_bad_inputs_are_refused():
    x = jax.random.normal(jax.random.key(5), (4, 16))
    packed = sk.pack(jax.random.normal(jax.random.key(6), (16, 40)))
    with pytest.raises(ValueError, match="packed"):
        sk.skinny_matmul(x[:, :15], packed, 40)
    with pytest.raises(ValueError, match="do not fill"):
        sk.skinny_matmul(x, packed, 65)
    with pytest.raises(ValueError, match="do not fill"):
        sk.skinny_matmul(x, packed, 32)
    with pytest.raises(ValueError, match="float32"):
        sk.skinny_matmul(x.astype(jnp.bfloat16), packed, 40)
    with pytest.raises(ValueError, match=r"\[..., K, N\]"):
        sk.pack(jnp.ones((3,)))


def test_an_unavailable_kernel_says_why(monkeypatch):
    load = sk._load.__wrapped__  # uncached: the reasons it gives
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert load() == "no C++ compiler 'no-such-compiler' on PATH (set $CXX)"
    monkeypatch.setenv("AGENTRL_NATIVE_KERNELS", "0")
    assert load() == "disabled by AGENTRL_NATIVE_KERNELS=0"
    monkeypatch.setattr(sk, "_load", lambda: "no C++ compiler 'c++' on PATH")
    assert not sk.available()
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        sk.skinny_matmul(jnp.ones((2, 4)), sk.pack(jnp.ones((4, 4))), 4)
