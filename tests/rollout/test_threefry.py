"""The sampler's unrolled Threefry draws against ``jax.random`` (the reference): same bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rollout import threefry
from agentrl_jax.rollout.sampler import categorical


def _keys(n: int, seed: int = 0) -> jax.Array:
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(n))


@pytest.mark.parametrize("b, v", [(8, 1024), (5, 1000), (1, 7)])
def test_gumbel_is_jax_random_gumbel_bitwise(b, v):
    keys = _keys(b, seed=b * v)
    got = jax.jit(threefry.gumbel, static_argnums=1)(keys, v)
    want = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    assert got.shape == (b, v) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.std(got)) > 0.5  # noise, not a constant


def test_fold_in_is_jax_random_fold_in_bitwise():
    keys = _keys(6, seed=3)
    data = jnp.asarray([0, 1, 17, 2**31 - 1, -1, -123456], jnp.int32)
    got = jax.jit(threefry.fold_in)(keys, data)
    want = jax.vmap(jax.random.fold_in)(keys, data)
    assert str(jax.random.key_impl(got)) == "threefry2x32"
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    assert len({tuple(k) for k in np.asarray(jax.random.key_data(got))}) == 6
    with pytest.raises(ValueError, match="int32 or uint32 data, got int16"):
        threefry.fold_in(keys, data.astype(jnp.int16))


def test_hash_matches_the_threefry_known_answer():
    """Threefry-2x32, 20 rounds, the Random123 known-answer vector (key and counter all ones)."""
    ones = np.uint32(0xFFFFFFFF)
    got = threefry.hash2x32(*(jnp.asarray([ones]) for _ in range(4)))
    assert [int(x[0]) for x in got] == [0x1CB996FC, 0xBB002BE7]


def test_applies_only_where_the_bits_are_jax_randoms():
    keys = _keys(3)
    assert threefry.applies(keys)
    assert not threefry.applies(jax.random.key_data(keys))  # raw uint32 keys
    rbg = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0, impl="rbg"), i))(jnp.arange(3))
    assert not threefry.applies(rbg)
    with jax.threefry_partitionable(False):
        assert not threefry.applies(keys)


def test_other_keys_and_dtypes_go_to_jax_random():
    """What the unrolled hash does not serve (rbg keys, bf16 noise) is ``jax.random``'s own."""
    rbg = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5, impl="rbg"), i))(jnp.arange(4))
    pos = jnp.asarray([0, 3, 9, 100], jnp.int32)
    np.testing.assert_array_equal(
        jax.random.key_data(threefry.fold_in(rbg, pos)),
        jax.random.key_data(jax.vmap(jax.random.fold_in)(rbg, pos)),
    )
    for keys, dtype in ((rbg, jnp.float32), (_keys(4), jnp.bfloat16)):
        got = threefry.gumbel(keys, 50, dtype)
        want = jax.vmap(lambda k, d=dtype: jax.random.gumbel(k, (50,), d))(keys)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_categorical_with_other_keys_still_draws_jax_randoms_tokens():
    """Keys the unrolled hash does not serve (rbg) go to ``jax.random``: its tokens."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 50)).astype(np.float32) * 3)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(4, impl="rbg"), i))(jnp.arange(16))
    got = jax.jit(categorical)(keys, x)
    want = jax.vmap(jax.random.categorical)(keys, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(set(np.asarray(got).tolist())) > 4
