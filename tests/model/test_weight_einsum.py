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
