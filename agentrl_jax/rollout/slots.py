"""The slot axis of the sampler's ``DecodeState``: reset, gather, scatter and copy slots.

Per-slot arrays are the S-layer ring buffers and the attention-mass accumulators (axis 1 of a
layer's arrays), ``lengths``, ``block_tables``, ``logits`` and the ``evict_at`` / ``int8_at``
positions; F/D layers' K/V live in one page pool shared by every slot and are addressed
through the block tables. The jittable functions take and return a ``DecodeState`` (a
NamedTuple, rebuilt with ``_replace``); :func:`bucket` pads host-side counts to few shapes.

Legend: B slots, R gathered slots, M copied slot pairs, S cache capacity (``max_len``).
"""

from __future__ import annotations

import jax.numpy as jnp

from agentrl_jax.model.chunked import NEVER


def per_slot(pattern: str, layer_name: str, key: str) -> bool:
    """Whether cache array ``layers[layer_name][key]`` has one entry per slot (axis 1): S rings
    and the attention-mass accumulators; F/D pages are a pool shared by all slots."""
    return key == "mass" or pattern[int(layer_name[6:])] == "S"


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest of 1, 4, 16, ... that holds ``n``, capped at ``cap`` (few compiled shapes)."""
    r = 1
    while r < n:
        r *= 4
    return r if cap is None else min(r, cap)


def reset_slots(state, mask, block_tables=None):
    """Empties the slots where ``mask`` (bool [B]) is set; optionally new block tables.

    Stale keys stay in the buffers but are masked by ``lengths`` (model cache contract); the
    attention mass and the eviction / int8 positions of the reset slots are cleared.
    """
    mask = jnp.asarray(mask)
    cache = dict(state.cache)
    cache["lengths"] = jnp.where(mask, 0, cache["lengths"])
    if block_tables is not None:
        cache["block_tables"] = jnp.asarray(block_tables, jnp.int32)
    cache["layers"] = {
        name: (
            {**layer, "mass": jnp.where(mask[None, :, None], 0.0, layer["mass"])}
            if "mass" in layer
            else layer
        )
        for name, layer in cache["layers"].items()
    }
    evict = jnp.where(mask[:, None], NEVER, state.evict_at)
    int8 = jnp.where(mask[:, None], NEVER, state.int8_at)
    return state._replace(cache=cache, evict_at=evict, int8_at=int8)


def gather_slots(state, rows, pattern: str):
    """The state of slots ``rows`` (int32 [R], distinct) as a batch of R slots over the same
    shared page pool.

    Raises:
      ValueError: the cache holds entries other than layers, lengths and block tables.
    """
    cache = state.cache
    if set(cache) != {"layers", "lengths", "block_tables"}:
        raise ValueError(f"unexpected cache entries {sorted(cache)}")
    take = lambda name, key, a: a[:, rows] if per_slot(pattern, name, key) else a  # noqa: E731
    return state._replace(
        cache={
            "layers": {
                name: {key: take(name, key, a) for key, a in layer.items()}
                for name, layer in cache["layers"].items()
            },
            "lengths": cache["lengths"][rows],
            "block_tables": cache["block_tables"][rows],
        },
        logits=state.logits[rows],
        evict_at=state.evict_at[rows],
        int8_at=state.int8_at[rows],
    )


def scatter_slots(state, rows, sub, pattern: str):
    """``state`` with slots ``rows`` taken from ``sub`` (a :func:`gather_slots` result after
    prefill): their rings, mass, lengths and logits, and the shared page pool; block tables
    and eviction positions stay ``state``'s."""
    cache = state.cache

    def put(name, key, a, b):
        return a.at[:, rows].set(b) if per_slot(pattern, name, key) else b

    layers = {
        name: {key: put(name, key, a, sub.cache["layers"][name][key]) for key, a in layer.items()}
        for name, layer in cache["layers"].items()
    }
    new_cache = {
        "layers": layers,
        "lengths": cache["lengths"].at[rows].set(sub.cache["lengths"]),
        "block_tables": cache["block_tables"],
    }
    return state._replace(cache=new_cache, logits=state.logits.at[rows].set(sub.logits))


def copy_slots(state, src, dst, pattern: str):
    """Slot ``dst[i]`` becomes a copy of slot ``src[i]``: its pages' K/V (through both block
    tables: the pages are copied, not shared), rings, attention mass, length, logits and
    eviction positions. src, dst int32 [M]; no dst may be a src (a pair with src == dst is a
    no-op, for padding)."""
    cache = state.cache
    tables = cache["block_tables"]
    pools = [
        a
        for name, layer in cache["layers"].items()
        for key, a in layer.items()
        if not per_slot(pattern, name, key)
    ]
    n_pages = pools[0].shape[1] if pools else 0  # F/D pools: [G, P, L, K, H]
    src_pages = jnp.maximum(tables[src], 0).reshape(-1)
    dst_pages = jnp.where(tables[dst] >= 0, tables[dst], n_pages).reshape(-1)  # -1: dropped

    def copy(name, key, a):
        if per_slot(pattern, name, key):
            return a.at[:, dst].set(a[:, src])
        return a.at[:, dst_pages].set(a[:, src_pages], mode="drop")

    layers = {
        name: {key: copy(name, key, a) for key, a in layer.items()}
        for name, layer in cache["layers"].items()
    }
    lengths = cache["lengths"].at[dst].set(cache["lengths"][src])
    return state._replace(
        cache={**cache, "layers": layers, "lengths": lengths},
        logits=state.logits.at[dst].set(state.logits[src]),
        evict_at=state.evict_at.at[dst].set(state.evict_at[src]),
        int8_at=state.int8_at.at[dst].set(state.int8_at[src]),
    )
