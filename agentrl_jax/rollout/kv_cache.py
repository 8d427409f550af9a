"""Host-side KV page allocation over shared pools, KV memory accounting, eviction decisions.

The device cache is the model's (``agentrl_jax.model.transformer.init_cache``): sliding-window
(``S``) layers hold a ring buffer of ``window`` tokens per slot; full/sparse (``F``/``D``) layers
hold one pool of ``n_pages`` float pages of ``page_size`` tokens, addressed through per-slot
block tables ``int32 [slots, max_pages]`` (-1 = no page), and optionally an int8 pool of their
own addressed through ``int8_tables``. :class:`PagePool` owns a pool's block tables on the host:
it hands out free pages when a slot grows, takes them back when a slot ends, is preempted, its
tail is trimmed or its tokens left the pool, and reports what is in use. Exhaustion never
raises inside the loop: ``ensure`` answers False and the agent loop makes admission wait or
preempts a slot.

Eviction (``EvictionConfig``): after a model turn, the tokens of *finished* tool-output blocks
(observations followed by at least one later model turn) whose accumulated attention from later
tokens stays under ``threshold`` are evicted from the F/D layers, or with ``int8=True`` moved to
int8 instead (under ``drop_threshold`` still evicted): their K and V are replaced by the int8
round trip with one fp32 scale per (logical page, KV head) over the page's int8 tokens
(``model.kv_quant``). The decision takes effect at the next prefill-chunk-aligned position and
is recorded per token (``Trajectory.kv_evict_at`` / ``kv_keep_mask``, ``kv_int8_at`` /
``kv_int8_mask``), so training replays exactly the same visibility and the same quantised values
(bitwise under parity policies).

Memory is really freed (``rollout.turns.reclaim``): a page whose tokens are all evicted goes
back to the float pool once no later chunk can see it; a page whose tokens are all int8 gets a
page of the int8 pool when one is free (codes + scales, a quarter of an fp32 page) and its float
page goes back once the conversion chunk has run. Pages partly int8 stay in the float pool with
the round-tripped values (bitwise what the int8 pool returns). Later turns and newly admitted
episodes take the freed pages. :class:`KVLayout` prices pages from the live device buffers, so
KV bytes are pages in use x page bytes per pool (plus the per-slot rings); :func:`kv_bytes_per_seq`
is the planning formula (what a sequence of n tokens would cost), not a measurement.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.attention import pool_dtype
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import DTypePolicy


def _itemsize(policy: DTypePolicy) -> int:
    """Bytes per float K/V element (the pool dtype; the compute dtype under int8 policies)."""
    return jnp.dtype(pool_dtype(policy)).itemsize


def kv_bytes_per_seq(
    cfg: ModelConfig,
    policy: DTypePolicy,
    n_tokens: int,
    page_size: int,
    int8_tokens: int = 0,
    int8_pages: int | None = None,
) -> int:
    """KV bytes one sequence of ``n_tokens`` holds in an int8-capable page store.

    S rings (``window`` tokens, float) + the allocated pages of F/D layers, where ``int8_tokens``
    of the paged tokens cost 1 byte per element plus one fp32 scale per (page, KV head) for K and
    V over ``int8_pages`` pages (default ``ceil(int8_tokens / page_size)``) and every other slot
    of an allocated page costs the pool dtype. Under a ``kv_cache_dtype='int8'`` policy every
    complete page is int8 (the tail page stays float). Float elements use the pool dtype
    (``model.attention.pool_dtype``). A planning formula: measured bytes come from
    :class:`KVLayout` and the pools (module docstring).
    """
    counts = cfg.layer_counts()
    per_tok = 2 * cfg.n_kv_heads * cfg.head_dim  # k and v
    ring = counts["S"] * cfg.window * per_tok * _itemsize(policy) if n_tokens else 0
    pages = -(-n_tokens // page_size)
    if int8_pages is None:
        int8_pages = -(-int8_tokens // page_size)
    if policy.kv_cache_dtype == "int8":
        int8_tokens = max(int8_tokens, (n_tokens // page_size) * page_size)
        int8_pages = max(int8_pages, n_tokens // page_size)
    paged_layers = counts["F"] + counts["D"]
    full = (pages * page_size - int8_tokens) * per_tok * _itemsize(policy)
    q8 = int8_tokens * per_tok + int8_pages * 2 * cfg.n_kv_heads * 4
    return int(ring + paged_layers * (full + q8))


def dense_kv_bytes(cfg: ModelConfig, policy: DTypePolicy, n_tokens: int) -> int:
    """KV bytes of one dense cache of ``n_tokens`` for every layer (the comparison baseline)."""
    return int(cfg.n_layers * n_tokens * 2 * cfg.n_kv_heads * cfg.head_dim * _itemsize(policy))


class PagePool:
    """Free-list allocator of ``n_pages`` pages shared by ``slots`` sequences.

    Args:
      slots: number of sequences (rows of the block table).
      n_pages: pages in the pool.
      page_size: tokens per page.
      max_len: most tokens one slot can hold (block-table width = ceil(max_len / page_size)).
      usable: pages the allocator may hand out (default ``n_pages``): a memory budget below
        the device pool's size (same compiled shapes, smaller budget).

    Raises:
      ValueError: if any size is < 1 or ``usable`` exceeds ``n_pages``.
    """

    def __init__(
        self, slots: int, n_pages: int, page_size: int, max_len: int, usable: int | None = None
    ):
        usable = n_pages if usable is None else usable
        for name, v in (("slots", slots), ("n_pages", n_pages), ("page_size", page_size)):
            if v < 1:
                raise ValueError(f"PagePool.{name}={v} must be >= 1")
        if not 1 <= usable <= n_pages:
            raise ValueError(f"PagePool.usable={usable} must be in [1, n_pages={n_pages}]")
        self.slots, self.n_pages, self.page_size = slots, usable, page_size
        self.max_pages = -(-max_len // page_size)
        self.tables = np.full((slots, self.max_pages), -1, np.int32)
        self.free = list(range(usable - 1, -1, -1))  # pop() hands out low ids first
        self.holes = [set() for _ in range(slots)]  # evicted block-table entries (stay empty)
        self.dirty = True

    def owned(self, slot: int) -> int:
        """Number of pages held by ``slot``."""
        return int(np.sum(self.tables[slot] >= 0))

    def _missing(self, slot: int, n_tokens: int) -> list[int]:
        return [
            j
            for j in range(self.pages_for(n_tokens))
            if self.tables[slot, j] < 0 and j not in self.holes[slot]
        ]

    @property
    def in_use(self) -> int:
        return self.n_pages - len(self.free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def can_hold(self, slot: int, n_tokens: int) -> bool:
        if self.pages_for(n_tokens) > self.max_pages:
            return False
        return len(self._missing(slot, n_tokens)) <= len(self.free)

    def ensure(self, slot: int, n_tokens: int) -> bool:
        """Gives ``slot`` pages for ``n_tokens`` tokens; False (nothing changed) if short."""
        if not self.can_hold(slot, n_tokens):
            return False
        for j in self._missing(slot, n_tokens):
            self.tables[slot, j] = self.free.pop()
            self.dirty = True
        return True

    def room(self, slot: int, n_tokens: int) -> int:
        """Tokens ``slot`` (holding ``n_tokens``) could add: its last page's slack plus every
        free page."""
        slack = self.pages_for(n_tokens) * self.page_size - n_tokens
        return slack + len(self.free) * self.page_size

    def trim(self, slot: int, n_tokens: int) -> None:
        """Returns the pages of ``slot`` beyond the first ``n_tokens`` tokens."""
        keep = self.pages_for(n_tokens)
        for j in range(keep, self.max_pages):
            if self.tables[slot, j] >= 0:
                self.free.append(int(self.tables[slot, j]))
                self.tables[slot, j] = -1
                self.dirty = True

    def release(self, slot: int) -> None:
        """Frees every page of ``slot`` (and forgets its evicted entries)."""
        self.trim(slot, 0)
        self.holes[slot].clear()

    def take(self, slot: int, j: int) -> bool:
        """Gives block-table entry ``j`` of ``slot`` a page if it has none; False if none is
        free (nothing changed)."""
        if self.tables[slot, j] >= 0:
            return True
        if not self.free:
            return False
        self.tables[slot, j] = self.free.pop()
        self.dirty = True
        return True

    def release_pages(self, slot: int, page_indices) -> int:
        """Frees the given block-table entries of ``slot`` (evicted pages); returns how many.

        The entries become -1; the attention mask (eviction) guarantees they are never read.
        """
        n = 0
        for j in page_indices:
            self.holes[slot].add(int(j))
            if self.tables[slot, j] >= 0:
                self.free.append(int(self.tables[slot, j]))
                self.tables[slot, j] = -1
                n += 1
        self.dirty = n > 0 or self.dirty
        return n

    def waste_tokens(self, lengths) -> int:
        """Allocated but unused token slots over all sequences (after trimming)."""
        return int(sum(self.owned(s) * self.page_size - int(n) for s, n in enumerate(lengths)))


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Bytes of the live cache buffers per allocation unit (from their shapes and dtypes).

    Attributes:
      float_page: one float page across every F/D layer (K and V).
      int8_page: one int8 page across every F/D layer (codes and scales of K and V; 0 when the
        cache has no int8 pool).
      per_slot: what every slot holds whatever its length: the S rings and, with
        ``sparse_gather``, the F layers' block means (the eviction mass accumulator is
        bookkeeping, not KV, and is left out).
    """

    float_page: int
    int8_page: int
    per_slot: int

    @classmethod
    def from_cache(cls, cache: dict, pattern: str) -> KVLayout:
        """Prices the buffers of a model cache (``init_cache`` layout: [G, P or B, ...])."""
        float_page = int8_page = per_slot = 0
        for name, layer in cache["layers"].items():
            kind = pattern[int(name[6:])]
            for key, a in layer.items():
                unit = int(a.size // a.shape[1]) * a.dtype.itemsize
                if key == "mass":
                    continue
                if kind == "S" or key == "kmean":
                    per_slot += unit
                elif key in ("k", "v"):
                    float_page += unit
                else:  # k8, v8, ks, vs
                    int8_page += unit
        return cls(float_page, int8_page, per_slot)

    def slot_bytes(self, float_pages: int, int8_pages: int = 0) -> int:
        """KV bytes of one slot holding these pages."""
        return self.per_slot + float_pages * self.float_page + int8_pages * self.int8_page


@dataclasses.dataclass(frozen=True)
class EvictionConfig:
    """When finished tool-output tokens are evicted from (or int8-compressed in) F/D layers.

    Attributes:
      threshold: a finished observation block is compressed when the mean attention mass later
        tokens put on it (``block_attention``) is below this. 0 disables.
      int8: move the block's F/D-layer K/V to int8 (per-page, per-head fp32 scales; recorded in
        ``kv_int8_at`` / ``kv_int8_mask``) instead of evicting it.
      min_block: blocks shorter than this are left alone.
      drop_threshold: with ``int8``, blocks whose share is under this (<= ``threshold``) are
        evicted rather than moved to int8. 0: none.
    """

    threshold: float = 0.0
    int8: bool = False
    min_block: int = 4
    drop_threshold: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"EvictionConfig.threshold={self.threshold} must be in [0, 1]")
        if self.min_block < 1:
            raise ValueError(f"EvictionConfig.min_block={self.min_block} must be >= 1")
        if not 0.0 <= self.drop_threshold <= self.threshold:
            raise ValueError(
                f"EvictionConfig.drop_threshold={self.drop_threshold} must be in "
                f"[0, threshold={self.threshold}]"
            )
        if self.drop_threshold > 0 and not self.int8:
            raise ValueError("EvictionConfig.drop_threshold needs int8=True")
