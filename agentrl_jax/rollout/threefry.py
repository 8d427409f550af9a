"""The sampler's per-row PRNG draws (``fold_in`` and Gumbel noise) with Threefry-2x32 unrolled.

JAX lowers its ``threefry2x32`` primitive on CPU as a rolled loop of five round groups, which
XLA runs as a while loop per draw. The decode loop draws per step and row: a fold-in of the
position into each episode key and Gumbel noise over the vocabulary, about 7% of a dense decode
step at batch 8 on the 2-core development CPU. The same hash written out here (straight-line
``uint32`` adds, rotations and xors) gives the same bits as ``jax.random`` (tested bitwise
against it) in 0.3x the time ([8, 1024] Gumbel draws, docs/results.md).

It applies to typed keys of the ``threefry2x32`` implementation under JAX's default
``jax_threefry_partitionable`` and low-dynamic-range Gumbel settings (:func:`applies`);
:func:`fold_in` and :func:`gumbel` hand any other key, setting or dtype to ``jax.random``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Threefry-2x32 rotation constants of the round groups (alternating) and the key-schedule parity
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_TINY = float(np.finfo(np.float32).tiny)


def applies(keys: jax.Array) -> bool:
    """Whether :func:`fold_in` and :func:`gumbel` give ``jax.random``'s numbers for ``keys``
    under this process's JAX configuration (trace-time check)."""
    return (
        jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
        and str(jax.random.key_impl(keys)) == "threefry2x32"
        and bool(getattr(jax.config, "jax_threefry_partitionable", False))
        and not bool(getattr(jax.config, "jax_high_dynamic_range_gumbel", True))
    )


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def hash2x32(k1, k2, x1, x2) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of the counter pair (x1, x2) under key (k1, k2); uint32 arrays
    that broadcast together -> the hashed pair."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(_PARITY))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = _rotl(x2, r) ^ x1
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def fold_in(keys: jax.Array, data: jax.Array) -> jax.Array:
    """``jax.vmap(jax.random.fold_in)(keys, data)``: [B] keys, int32 [B] -> [B] keys.

    Raises:
      ValueError: ``data`` not a 32-bit integer array (a 64-bit value's high word would be
        part of JAX's seed).
    """
    if data.dtype not in (jnp.int32, jnp.uint32):
        raise ValueError(f"threefry.fold_in needs int32 or uint32 data, got {data.dtype}")
    if not applies(keys):
        return jax.vmap(jax.random.fold_in)(keys, data)
    kd = jax.random.key_data(keys)
    d = data.astype(jnp.uint32)  # threefry_seed of a 32-bit value: (0, value)
    y1, y2 = hash2x32(kd[:, 0], kd[:, 1], jnp.zeros_like(d), d)
    return jax.random.wrap_key_data(jnp.stack([y1, y2], axis=-1), impl="threefry2x32")


def gumbel(keys: jax.Array, v: int, dtype=jnp.float32) -> jax.Array:
    """``jax.vmap(lambda k: jax.random.gumbel(k, (v,), dtype))(keys)``: [B] keys -> [B, v]."""
    if jnp.dtype(dtype) != jnp.float32 or not applies(keys):
        return jax.vmap(lambda k: jax.random.gumbel(k, (v,), dtype))(keys)
    kd = jax.random.key_data(keys)
    count = jax.lax.broadcasted_iota(jnp.uint32, (1, v), 1)  # the low words; high words zero
    b1, b2 = hash2x32(kd[:, :1], kd[:, 1:], jnp.zeros_like(count), count)
    bits = b1 ^ b2
    # uniform in [tiny, 1): 23 random mantissa bits under exponent 0, as jax.random.uniform
    one = np.array(1.0, np.float32).view(np.uint32)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0
    tiny = jnp.float32(_TINY)
    u = jnp.maximum(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(u))
