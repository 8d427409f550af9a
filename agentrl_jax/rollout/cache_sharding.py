"""The sampler's state on a device mesh: KV cache slots over ``data``, KV heads over ``tensor``.

Under an ambient mesh (``jax.set_mesh``, e.g. ``agentrl_jax.sharding.activate`` around a
rollout) :func:`place_decode_state` puts a fresh ``DecodeState`` on it:

* S-layer rings ``[G, B, W, K, H]`` and the attention-mass buffers ``[G, B, S]``: slots B over
  ``data``; rings' KV heads K over ``tensor``;
* F/D-layer page pools ``[G, P, L, K, H]``: pages P over ``data`` (each slot's pages are
  contiguous in a per-slot pool, so this is the slot split) and K over ``tensor``;
* per-slot rows (``lengths``, block tables, next-token logits, eviction marks): over ``data``.

An axis shards a dimension only where it divides it (``sharding.fit_spec``); everything else is
replicated. The jitted prefill / decode then run as one program over the mesh (parameters as
the caller placed them). Without a mesh, or on a mesh of one device, the state is left where it
is.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from agentrl_jax.sharding import fit_spec

_POOL_SPEC = P(None, "data", None, "tensor")  # [G, B|P, W|L, K, H]
_MASS_SPEC = P(None, "data")  # [G, B, S]
_ROW_SPEC = P("data")  # [B, ...]


def ambient_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh set by ``jax.set_mesh`` (None without one or with one device)."""
    try:
        mesh = jax.sharding.get_mesh()
    except (AttributeError, ValueError):
        return None
    if mesh is None or mesh.empty or mesh.size <= 1:
        return None
    return mesh


def decode_state_shardings(state, mesh: jax.sharding.Mesh):
    """``NamedSharding`` per leaf of a ``DecodeState`` (module docstring)."""
    sizes = dict(mesh.shape)

    def layer_leaf(x):
        spec = _POOL_SPEC if np.ndim(x) == 5 else _MASS_SPEC
        return NamedSharding(mesh, fit_spec(spec, np.shape(x), sizes))

    def row_leaf(x):
        return NamedSharding(mesh, fit_spec(_ROW_SPEC, np.shape(x), sizes))

    cache = dict(state.cache)
    layers = jax.tree.map(layer_leaf, cache.pop("layers"))
    rows = jax.tree.map(row_leaf, cache)
    return state._replace(
        cache={**rows, "layers": layers},
        logits=row_leaf(state.logits),
        evict_at=row_leaf(state.evict_at),
        int8_at=row_leaf(state.int8_at),
        blocks=None if state.blocks is None else row_leaf(state.blocks),
    )


def place_decode_state(state):
    """``state`` on the ambient mesh (module docstring); unchanged without one."""
    mesh = ambient_mesh()
    if mesh is None:
        return state
    return jax.device_put(state, decode_state_shardings(state, mesh))
