"""The slot axis of the sampler's ``DecodeState``: reset, gather, scatter and copy slots.

Per-slot arrays are the S-layer ring buffers, the F layers' block means (``kmean``) and the
attention-mass accumulators (axis 1 of a layer's arrays), ``lengths``, ``block_tables`` (and
``int8_tables``), ``logits``, the ``evict_at`` / ``int8_at`` positions and the recorded block
selections; F/D layers' K/V live in one page pool shared by every slot (and an optional int8
pool) and are addressed through the block tables. The jittable functions take and return a
``DecodeState`` (a NamedTuple, rebuilt with ``_replace``); :func:`bucket` pads host-side counts
to few shapes.

Legend: B slots, R gathered slots, M copied slot pairs, S cache capacity (``max_len``).
"""

from __future__ import annotations

import jax.numpy as jnp

from agentrl_jax.model.chunked import NEVER


def per_slot(pattern: str, layer_name: str, key: str) -> bool:
    """Whether cache array ``layers[layer_name][key]`` has one entry per slot (axis 1): S rings,
    block means and the attention-mass accumulators; F/D pages are pools shared by all slots."""
    return key in ("mass", "kmean") or pattern[int(layer_name[6:])] == "S"


INT8_KEYS = ("k8", "v8", "ks", "vs")  # int8 pool arrays: addressed through ``int8_tables``


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest of 1, 4, 16, ... that holds ``n``, capped at ``cap`` (few compiled shapes)."""
    r = 1
    while r < n:
        r *= 4
    return r if cap is None else min(r, cap)


def reset_slots(state, mask, block_tables=None, int8_tables=None):
    """Empties the slots where ``mask`` (bool [B]) is set; optionally new block tables of the
    float and the int8 pool.

    Stale keys stay in the buffers but are masked by ``lengths`` (model cache contract); the
    attention mass, the eviction / int8 positions and the block records of the reset slots are
    cleared.
    """
    mask = jnp.asarray(mask)
    cache = dict(state.cache)
    cache["lengths"] = jnp.where(mask, 0, cache["lengths"])
    if block_tables is not None:
        cache["block_tables"] = jnp.asarray(block_tables, jnp.int32)
    if int8_tables is not None:
        cache["int8_tables"] = jnp.asarray(int8_tables, jnp.int32)
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
    blocks = state.blocks
    if blocks is not None:
        blocks = jnp.where(mask.reshape(-1, *([1] * (blocks.ndim - 1))), -1, blocks)
    return state._replace(cache=cache, evict_at=evict, int8_at=int8, blocks=blocks)


def gather_slots(state, rows, pattern: str):
    """The state of slots ``rows`` (int32 [R], distinct) as a batch of R slots over the same
    shared page pool.

    Raises:
      ValueError: the cache holds entries other than layers, lengths and block tables.
    """
    cache = state.cache
    if set(cache) - {"int8_tables"} != {"layers", "lengths", "block_tables"}:
        raise ValueError(f"unexpected cache entries {sorted(cache)}")
    take = lambda name, key, a: a[:, rows] if per_slot(pattern, name, key) else a  # noqa: E731
    sub = {
        "layers": {
            name: {key: take(name, key, a) for key, a in layer.items()}
            for name, layer in cache["layers"].items()
        },
        **{k: cache[k][rows] for k in ("lengths", "block_tables", "int8_tables") if k in cache},
    }
    return state._replace(
        cache=sub,
        logits=state.logits[rows],
        evict_at=state.evict_at[rows],
        int8_at=state.int8_at[rows],
        blocks=None if state.blocks is None else state.blocks[rows],
    )


def scatter_slots(state, rows, sub, pattern: str):
    """``state`` with slots ``rows`` taken from ``sub`` (a :func:`gather_slots` result after
    prefill): their rings, block means, mass, lengths, logits and block records, and the shared
    page pools; block tables and eviction positions stay ``state``'s."""
    cache = state.cache

    def put(name, key, a, b):
        return a.at[:, rows].set(b) if per_slot(pattern, name, key) else b

    layers = {
        name: {key: put(name, key, a, sub.cache["layers"][name][key]) for key, a in layer.items()}
        for name, layer in cache["layers"].items()
    }
    new_cache = {
        **cache,
        "layers": layers,
        "lengths": cache["lengths"].at[rows].set(sub.cache["lengths"]),
    }
    blocks = state.blocks
    if blocks is not None:
        blocks = blocks.at[rows].set(sub.blocks)
    return state._replace(
        cache=new_cache, logits=state.logits.at[rows].set(sub.logits), blocks=blocks
    )


def copy_slots(state, src, dst, pattern: str):
    """Slot ``dst[i]`` becomes a copy of slot ``src[i]``: its pages' K/V (through both block
    tables of each pool: the pages are copied, not shared), rings, block means, attention mass,
    length, logits, eviction positions and block records. src, dst int32 [M]; no dst may be a
    src (a pair with src == dst is a no-op, for padding)."""
    cache = state.cache

    def pages(tables_key, n):  # (source pages, destination pages or n: dropped), flat [M * J]
        tables = cache[tables_key]
        src_pages = jnp.maximum(tables[src], 0).reshape(-1)
        return src_pages, jnp.where(tables[dst] >= 0, tables[dst], n).reshape(-1)

    def copy(name, key, a):
        if per_slot(pattern, name, key):
            return a.at[:, dst].set(a[:, src])
        src_pages, dst_pages = pages(
            "int8_tables" if key in INT8_KEYS else "block_tables", a.shape[1]
        )
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
        blocks=None if state.blocks is None else state.blocks.at[dst].set(state.blocks[src]),
    )
