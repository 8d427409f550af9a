"""The one-row decode's weight matmuls against packed weights (op ``decode_matmul``).

``select.TABLE['decode_matmul']`` has three impls: 'xla' multiplies the weights as stored (the
model's ``DTypePolicy.einsum``: nothing here), 'cpu' and 'reference' multiply weights packed
once into column panels (:func:`pack`, ``skinny_matmul_cpu.pack``): 'cpu' through the C++
kernel of ``skinny_matmul_cpu``, 'reference' as a jnp matmul of the unpacked weight. Packing is
decided once per weight version (``model.decode_params.prepare_decode``); the modules then call
:func:`packed_matmul` with the impl the parameters were packed for.

Legend: K contracted size, N output columns, Np panels, P panel width, G weights (experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from agentrl_jax.kernels import skinny_matmul_cpu

PACKED_IMPLS = ("cpu", "reference")  # impls that read packed weights


@jax.jit
def pack(w: jax.Array) -> jax.Array:
    """A [..., K, N] weight in float32 as column panels [..., Np, K, P]
    (``skinny_matmul_cpu.pack``)."""
    return skinny_matmul_cpu.pack(w.astype(jnp.float32))


def packed_matmul(x: jax.Array, packed: jax.Array, n: int, *, impl: str) -> jax.Array:
    """``x @ W`` for ``packed = pack(W)``: x [..., K] against one weight (packed [Np, K, P]) ->
    float32 [..., n], or x [G, M, K] against G weights (packed [G, Np, K, P]) -> [G, M, n].

    Args:
      x: float32 rows.
      packed: :func:`pack` of the weight(s).
      n: N, the weight's columns.
      impl: 'cpu' (the C++ kernel) or 'reference' (jnp).

    Raises:
      ValueError: an impl that reads no packed weights, or inconsistent shapes.
      RuntimeError: 'cpu' where the kernel is unavailable.
    """
    if impl not in PACKED_IMPLS:
        raise ValueError(f"packed_matmul impl={impl!r}; allowed: {PACKED_IMPLS}")
    if impl == "cpu":
        return skinny_matmul_cpu.skinny_matmul(x, packed, n)
    return skinny_matmul_cpu.skinny_matmul_reference(x, packed, n)
