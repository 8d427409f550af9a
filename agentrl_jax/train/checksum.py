"""Checksums of checkpointed arrays: what a checkpoint holds is what was saved, bit for bit.

Orbax's own integrity data does not cover array contents (its zarr3 layout checksums only the
shard index; the default zarr2 + zstd layout checks nothing), so a flipped byte in a data file
restores silently. Every array a checkpoint holds therefore carries a checksum of its bits,
written with the checkpoint and compared after every restore.

The checksum of an array is two 32-bit sums over its elements ``w_i`` (each element's bits as
an unsigned integer; a 64-bit element counts as two 32-bit words, low word first), in C order:
``s1 = sum(w_i)`` and ``s2 = sum(w_i * (2 i + 1))``, both modulo 2**32. Any change confined to
one element changes ``s1`` (the difference of two distinct words is never 0 modulo 2**32);
other changes go unseen with a probability of about 2**-32 or less. Both sums are exact
integer arithmetic, so the result does not depend on the order of summation: the host (NumPy)
and device (jitted, for arrays spread over several hosts) computations agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_CHUNK = 1 << 22  # elements per host chunk (bounds the temporary uint64 buffers)
_MASK = (1 << 32) - 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _host_words(x: np.ndarray) -> np.ndarray:
    """The elements of ``x`` as uint32 words (two per 64-bit element), flat, C order."""
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    if size == 8:
        return x.view(np.uint32)
    if size not in _UINT:
        raise ValueError(f"cannot checksum dtype {x.dtype} (itemsize {size}): 1, 2, 4 or 8")
    return x.view(_UINT[size]).astype(np.uint32)


def host_checksum(x: Any) -> str:
    """The checksum (module docstring) of a host array, as 16 hex digits ``s1 s2``.

    Raises:
      ValueError: a dtype whose elements are not 1, 2, 4 or 8 bytes.
    """
    words = _host_words(np.asarray(x))
    s1 = s2 = 0
    for lo in range(0, words.size, _CHUNK):
        w = words[lo : lo + _CHUNK].astype(np.uint64)
        odd = 2 * np.arange(lo, lo + w.size, dtype=np.uint64) + 1
        s1 = (s1 + int(w.sum(dtype=np.uint64))) & _MASK
        s2 = (s2 + int((w * odd).sum(dtype=np.uint64))) & _MASK  # uint64 wraps: mod 2**64
    return f"{s1:08x}{s2:08x}"


@jax.jit
def _device_sums(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        w = x.astype(jnp.uint32)
    else:
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        w = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    w = w.reshape(-1)
    odd = 2 * jax.lax.iota(jnp.uint32, w.size) + 1  # wraps modulo 2**32, like the host's
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


def device_checksum(x: jax.Array) -> str:
    """``host_checksum`` computed where ``x`` lives (for arrays no single host holds whole).

    Raises:
      ValueError: a dtype wider than 4 bytes (JAX arrays on device never are without x64).
    """
    if x.dtype.itemsize > 4:
        raise ValueError(f"device_checksum supports dtypes up to 4 bytes, not {x.dtype}")
    s1, s2 = (int(v) for v in np.asarray(jax.device_get(_device_sums(x))))
    return f"{s1:08x}{s2:08x}"


def checksum(x: Any) -> str:
    """The checksum of ``x``: where it lives for a JAX array on accelerators or spread over
    several hosts (no copy to the host), else on the host."""
    if isinstance(x, jax.Array) and x.dtype.itemsize <= 4:
        if not x.is_fully_addressable or any(d.platform != "cpu" for d in x.devices()):
            return device_checksum(x)
    return host_checksum(np.asarray(x))


def tree_checksums(tree: Any) -> dict[str, dict[str, Any]]:
    """``{key path: {"shape", "dtype", "checksum"}}`` of every array leaf of ``tree``."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out[jax.tree_util.keystr(path)] = {
            "shape": list(np.shape(leaf)),
            "dtype": str(
                np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            ),
            "checksum": checksum(leaf),
        }
    return out


def mismatches(tree: Any, saved: dict[str, dict[str, Any]]) -> list[str]:
    """Key paths of ``tree``'s leaves whose shape, dtype or bits differ from ``saved``
    (``tree_checksums`` of what was written), and saved paths ``tree`` lacks."""
    now = tree_checksums(tree)
    bad = [k for k, v in now.items() if k in saved and saved[k] != v]
    return bad + sorted(set(saved) - set(now))
