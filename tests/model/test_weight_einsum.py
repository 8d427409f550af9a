"""``precision.weight_einsum`` (2-D matmul form of weight contractions) against ``jnp.einsum``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.precision import get_policy, weight_einsum

FORMS = [
    ("BTD,DNH->BTNH", (2, 5, 8), (8, 4, 3)),  # projections to heads (2-D path)
    ("BTNH,NHD->BTD", (2, 5, 4, 3), (4, 3, 8)),  # output projection, two contracted axes
    ("BTD,DF->BTF", (3, 7, 8), (8, 6)),
    ("ECD,EDF->ECF", (3, 4, 5), (3, 5, 6)),  # batched per-expert: not a weight form, fallback
    ("BTD,VD->BTV", (2, 3, 8), (7, 8)),  # transposed weight (tied unembedding)
    ("BTD,TD->BT", (2, 3, 8), (3, 8)),  # a shared axis is not a weight form: fallback
]


@pytest.mark.parametrize("subscripts,xs,ws", FORMS)
def test_weight_einsum_matches_einsum_values_and_grads(subscripts, xs, ws):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=xs), jnp.float32)
    w = jnp.asarray(r.normal(size=ws), jnp.float32)
    out = weight_einsum(subscripts, x, w)
    ref = jnp.einsum(subscripts, x, w)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(r.normal(size=ref.shape), jnp.float32)
    g = jax.grad(lambda a, b: jnp.sum(weight_einsum(subscripts, a, b) * cot), argnums=(0, 1))(x, w)
    g_ref = jax.grad(lambda a, b: jnp.sum(jnp.einsum(subscripts, a, b) * cot), argnums=(0, 1))(x, w)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_policy_einsum_bf16_accumulates_in_f32():
    pol = get_policy("bf16")
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(2, 4, 8)), jnp.float32)
    w = jnp.asarray(r.normal(size=(8, 2, 3)), jnp.float32)
    out = pol.einsum("BTD,DNH->BTNH", x, w)
    ref = jnp.einsum(
        "BTD,DNH->BTNH",
        x.astype(jnp.bfloat16),
        w.astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    )
    assert out.dtype == pol.compute
    np.testing.assert_allclose(out.astype(jnp.float32), ref.astype(pol.compute).astype(jnp.float32))


BIG_FORMS = [
    ("BTD,DF->BTF", (8, 192, 256), (256, 768)),
    ("BTD,VD->BTV", (8, 192, 256), (1024, 256)),
]


@pytest.mark.parametrize("cotangent", ["random", "ones"])
@pytest.mark.parametrize("subscripts,xs,ws", [FORMS[0], FORMS[1], FORMS[4], *BIG_FORMS])
def test_policy_einsum_bf16_gradient_matches_autodiff(subscripts, xs, ws, cotangent):
    """The hand-written matmul gradient (bf16 operands, f32 sums) against autodiff of the plain
    cast-einsum-cast: the same products, so equal up to f32 summation order and the final bf16
    rounding of the gradient (one bf16 ulp). ``ones`` (a plain sum) gives XLA a broadcast
    cotangent to fold, the case that once produced a bf16 dot XLA CPU could not run."""
    pol = get_policy("bf16")
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=xs), jnp.float32)
    w = jnp.asarray(r.normal(size=ws), jnp.float32)
    shape = jnp.einsum(subscripts, x, w).shape
    cot = jnp.asarray(r.normal(size=shape), jnp.float32) if cotangent == "random" else 1.0

    def plain(a, b):
        y = jnp.einsum(
            subscripts,
            a.astype(pol.compute),
            b.astype(pol.compute),
            preferred_element_type=pol.accum,
        )
        return jnp.sum(y.astype(pol.compute).astype(jnp.float32) * cot)

    def ours(a, b):
        return jnp.sum(pol.einsum(subscripts, a, b).astype(jnp.float32) * cot)

    g_ref = jax.grad(plain, argnums=(0, 1))(x, w)
    for argnums in ((0, 1), 1):
        g = jax.jit(jax.grad(ours, argnums=argnums))(x, w)
        g = g if isinstance(g, tuple) else (g_ref[0], g)
        for a, b in zip(g, g_ref):
            assert a.dtype == b.dtype == jnp.float32
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-2 * float(jnp.abs(b).max()))


def test_weight_einsum_gradient_under_vmap():
    r = np.random.default_rng(3)
    x = jnp.asarray(r.normal(size=(3, 2, 5, 8)), jnp.float32)  # 3 vmapped copies
    w = jnp.asarray(r.normal(size=(3, 8, 6)), jnp.float32)

    def loss(fn, a, b):
        return jnp.sum(jnp.sin(fn("BTD,DF->BTF", a, b)))

    g = jax.vmap(jax.grad(lambda a, b: loss(weight_einsum, a, b), argnums=1))(x, w)
    g_ref = jax.vmap(jax.grad(lambda a, b: loss(jnp.einsum, a, b), argnums=1))(x, w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)
