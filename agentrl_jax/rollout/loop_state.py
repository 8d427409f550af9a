"""The agent loop's options, counters and state: what ``AgentLoop``'s phases read and change.

:class:`LoopOptions` is the frozen description of a rollout (slots, turn and token limits,
batching mode, page pools, eviction, disaggregation, logging). :class:`LoopState` holds what
changes while it runs: the episodes in their slots, the queue of tasks and preempted episodes,
the finished records and per-turn logs, the float and int8 page pools and the price of their
pages, the sampler's device state, the host mirrors of the recorded KV eviction / int8
positions, and the :class:`RolloutStats` counters.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from agentrl_jax.envs.base import Env
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig, KVLayout, PagePool
from agentrl_jax.rollout.sampler import NEVER, DecodeState, RolloutConfig
from agentrl_jax.rollout.trajectory import EpisodeRecord, Trajectory, stack_episodes


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """How a rollout plays its tasks (hashable; everything but tasks, policy and rng).

    Attributes:
      n_slots: sequences decoded together (None: one per task); the trainer's parity
        recompute uses the same batch size.
      max_turns: model turns per episode (>= 1).
      max_tokens: tokens per episode (None: the sampler's ``max_len``, also the cap).
      continuous: refill/step slots individually (True) or in lockstep waves (False).
      n_pages: shared KV page pool size (None: the sampling config's ``n_pages``, or every slot
        owns ``max_len`` worth of pages).
      page_budget: pages the allocator may use out of ``n_pages`` (None: all).
      int8_pages: int8 page pool size with int8 eviction and a shared pool (None: the sampling
        config's ``int8_pages``, else ``n_pages``; 0: no int8 pool, int8 pages stay in the float
        pool as their round-tripped values).
      goal_every: if > 0, after every ``goal_every``-th turn the prompt (without ``<bos>``) is
        appended again as environment tokens.
      process_weights: (key, weight) pairs per process-signal key (a missing key weighs 1.0);
        a mapping is accepted and stored as sorted pairs.
      eviction: KV eviction / int8 policy for finished tool outputs (``kv_cache.py``); None:
        from the sampling config's ``eviction_threshold`` / ``eviction_int8``.
      disaggregate: prefill and decode on separate device sub-meshes
        (``rollout/disaggregation.py``).
      log_path: if given, the per-turn records are appended there as JSONL.
      first_uid: episode id of the first task (task ``i`` samples with keys folded from
        ``first_uid + i``, also its log rows' ``episode``): a process playing tasks
        ``lo..hi-1`` of a longer list passes ``lo`` and samples what one process playing the
        whole list would (>= 0).

    Raises:
      ValueError: ``n_slots`` < 1, ``max_turns`` < 1, ``goal_every`` < 0 or ``first_uid`` < 0.
    """

    n_slots: int | None = None
    max_turns: int = 16
    max_tokens: int | None = None
    continuous: bool = True
    n_pages: int | None = None
    page_budget: int | None = None
    int8_pages: int | None = None
    goal_every: int = 0
    process_weights: tuple[tuple[str, float], ...] = ()
    eviction: EvictionConfig | None = None
    disaggregate: Disaggregation | None = None
    log_path: str | None = None
    first_uid: int = 0

    def __post_init__(self):
        if self.n_slots is not None and self.n_slots < 1:
            raise ValueError(f"n_slots={self.n_slots} must be >= 1")
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns} must be >= 1")
        if self.goal_every < 0:
            raise ValueError(f"LoopOptions.goal_every={self.goal_every} must be >= 0")
        if self.first_uid < 0:
            raise ValueError(f"LoopOptions.first_uid={self.first_uid} must be >= 0")
        if self.int8_pages is not None and self.int8_pages < 0:
            raise ValueError(f"LoopOptions.int8_pages={self.int8_pages} must be >= 0")
        weights = self.process_weights
        if isinstance(weights, Mapping) or weights is None:
            weights = (weights or {}).items()
        object.__setattr__(self, "process_weights", tuple(sorted(tuple(kv) for kv in weights)))


def resolve_options(
    options: LoopOptions | None, cfg: RolloutConfig, model_cfg: ModelConfig, n_tasks: int
) -> tuple[LoopOptions, EvictionConfig | None, int]:
    """The options a rollout of ``n_tasks`` runs with, its eviction policy and int8 pool size.

    Unset options take their defaults: one slot per task, the sampling config's ``n_pages``,
    the eviction policy of the sampling config's ``eviction_*`` fields; the int8 pool (int8
    eviction with a shared pool only) has ``options.int8_pages``, else the sampling config's,
    else ``n_pages`` pages. Returns (options, eviction or None when off, int8 pages or 0).

    Raises:
      ValueError: ``disaggregate`` with KV eviction, block records or a ``sparse_gather``
        model.
    """
    options = options or LoopOptions()
    if options.n_slots is None:
        options = dataclasses.replace(options, n_slots=n_tasks)
    if options.n_pages is None and cfg.n_pages is not None:
        options = dataclasses.replace(options, n_pages=cfg.n_pages)
    eviction = options.eviction
    if eviction is None and cfg.eviction_threshold > 0:
        eviction = EvictionConfig(
            threshold=cfg.eviction_threshold,
            int8=cfg.eviction_int8,
            drop_threshold=cfg.eviction_drop_threshold,
        )
    if eviction is not None and eviction.threshold <= 0:
        eviction = None
    int8_pages = 0
    if eviction is not None and eviction.int8 and options.n_pages is not None:
        sizes = (options.int8_pages, cfg.int8_pages, options.n_pages)
        int8_pages = next(x for x in sizes if x is not None)
    if options.disaggregate is not None and (
        eviction is not None or cfg.record_blocks or model_cfg.sparse_gather
    ):
        raise ValueError(
            "disaggregate does not support KV eviction / int8 (eviction=...), block records "
            "(record_blocks) or sparse_gather models"
        )
    return options, eviction, int8_pages


@dataclasses.dataclass
class RolloutStats:
    """Counters of one rollout (also attached to the trajectory's logs)."""

    prefill_calls: int = 0
    prefill_tokens: int = 0  # computed; plus shared_prefill_tokens copied from a twin slot
    shared_prefill_tokens: int = 0
    decode_calls: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    admission_waits: int = 0
    max_pages_in_use: int = 0
    max_int8_pages_in_use: int = 0
    max_kv_bytes: int = 0  # peak KV bytes of the live pools (pages in use x page bytes + rings)
    evicted_tokens: int = 0
    int8_tokens: int = 0
    kv_moved_bytes: int = 0
    prefill_devices: set = dataclasses.field(default_factory=set)  # ids holding prefill outputs
    decode_devices: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class EpisodeSlot:
    """One episode in play: its record, environment and the host view of its cache."""

    rec: EpisodeRecord
    env: Env
    goal: list[int]
    admitted: int
    turn: int = 0
    cached: int = 0  # tokens of rec (+ turn) in the device cache
    turn_toks: list[int] = dataclasses.field(default_factory=list)
    turn_lp: list[float] = dataclasses.field(default_factory=list)
    moved: int = 0  # KV bytes moved between prefill and decode sub-meshes since the last log
    generating: bool = False
    blocks: list = dataclasses.field(default_factory=list)  # [lo, hi, evicted_at or False]

    @property
    def stream_len(self) -> int:
        return len(self.rec.tokens) + len(self.turn_toks)

    @property
    def pending(self) -> int:
        """Tokens of the stream not yet in the device cache."""
        return self.stream_len - self.cached


@dataclasses.dataclass
class LoopState:
    """What a rollout changes while it runs.

    Attributes:
      slots: the episode in each slot, or None (free).
      queue: task indices not started yet, or preempted :class:`EpisodeSlot` s to resume.
      records: finished episodes by task index (None while unfinished).
      logs: one dict per model turn, in the order turns ended.
      pool: the shared page pool, or None (every slot owns its pages).
      decode: the sampler's ``DecodeState`` (on the decode sub-mesh when disaggregated).
      layout: the bytes of a float page, an int8 page and a slot's rings in ``decode``.
      evict_at: int32 [slots, max_len] host mirror of ``decode.evict_at``.
      int8_at: int32 [slots, max_len] host mirror of ``decode.int8_at``.
      marks_dirty: the mirrors changed since they were last uploaded.
      mass: float32 [slots, max_len] attention mass read after the last decode, or None.
      admitted: episodes admitted so far (orders preemption: the youngest goes first).
      stats: the counters.
      pool8: the int8 page pool, or None.
    """

    slots: list[EpisodeSlot | None]
    queue: collections.deque
    records: list[EpisodeRecord | None]
    logs: list[dict]
    pool: PagePool | None
    decode: DecodeState
    layout: KVLayout
    evict_at: np.ndarray
    int8_at: np.ndarray
    stats: RolloutStats
    marks_dirty: bool = False
    mass: np.ndarray | None = None
    admitted: int = 0
    pool8: PagePool | None = None

    @property
    def busy(self) -> bool:
        """Whether episodes remain queued or in play."""
        return bool(self.queue) or any(sl is not None for sl in self.slots)

    def youngest(self, exclude: int | None = None) -> int | None:
        """The most recently admitted occupied slot other than ``exclude`` (None if none)."""
        cands = [i for i, sl in enumerate(self.slots) if sl is not None and i != exclude]
        return max(cands, key=lambda i: self.slots[i].admitted) if cands else None

    def place(self, s: int, slot: EpisodeSlot) -> None:
        """Puts ``slot`` in slot ``s`` with nothing cached, restoring its recorded KV marks."""
        slot.admitted = self.admitted
        slot.cached = 0
        self.evict_at[s] = NEVER
        self.int8_at[s] = NEVER
        for pos, at in slot.rec.evict_at.items():
            self.evict_at[s, pos] = at
        for pos, at in slot.rec.int8_at.items():
            self.int8_at[s, pos] = at
        self.marks_dirty = self.marks_dirty or bool(slot.rec.evict_at or slot.rec.int8_at)
        self.admitted += 1
        self.slots[s] = slot

    def upload_marks(self) -> None:
        """Uploads the host mirrors of evict_at / int8_at when a decision changed them."""
        if self.marks_dirty:
            self.decode = self.decode._replace(
                evict_at=jnp.asarray(self.evict_at), int8_at=jnp.asarray(self.int8_at)
            )
            self.marks_dirty = False

    def stack(self, cfg: RolloutConfig, route_shape, kv_masks: bool, block_size: int) -> Trajectory:
        """The padded batch of the finished episodes (``stack_episodes``), padded to the
        longest rounded up to the decode chunk, with the per-turn logs."""
        done = [r for r in self.records if r is not None]
        longest = max(len(r.tokens) for r in done)
        pad_to = min(-(-longest // cfg.chunk) * cfg.chunk, max(cfg.max_len, longest))
        blocks = None
        if self.decode.blocks is not None:
            blocks = (self.decode.blocks.shape[2:], block_size)
        return stack_episodes(
            done,
            pad_to=pad_to,
            route_shape=route_shape,
            kv_masks=kv_masks,
            logs=self.logs,
            blocks=blocks,
        )

    def _vacate(self, s: int) -> None:
        """Keeps the slot's block records and frees its pages in both pools."""
        slot = self.slots[s]
        if self.decode.blocks is not None and slot.cached > slot.rec.blocks_upto:
            slot.rec.set_blocks(slot.cached, np.asarray(self.decode.blocks[s]))
        self.slots[s] = None
        for pool in (self.pool, self.pool8):
            if pool is not None:
                pool.release(s)

    def finish(self, s: int, *, truncated: bool) -> None:
        """Ends the episode of slot ``s`` (its record is final) and frees the slot."""
        slot = self.slots[s]
        slot.rec.truncated = truncated and not slot.rec.done
        self.records[slot.rec.task_index] = slot.rec
        self._vacate(s)

    def preempt(self, s: int) -> None:
        """Sends the episode of slot ``s`` back to the front of the queue (to be re-prefilled)."""
        slot = self.slots[s]
        self._vacate(s)
        slot.cached = 0
        self.queue.appendleft(slot)
        self.stats.preemptions += 1

    def slot_kv(self, s: int) -> dict[str, int]:
        """Slot ``s``'s KV memory on the live pools: its float and int8 pages and their bytes
        (a slot without a shared pool holds ``max_len`` worth of float pages)."""
        if self.pool is not None:
            float_pages = self.pool.owned(s)
        else:
            float_pages = int(self.decode.cache["block_tables"].shape[1])
        int8_pages = self.pool8.owned(s) if self.pool8 is not None else 0
        return dict(
            pages_in_use=float_pages,
            int8_pages_in_use=int8_pages,
            kv_bytes=self.layout.slot_bytes(float_pages, int8_pages),
            kv_bytes_float=float_pages * self.layout.float_page,
            kv_bytes_int8=int8_pages * self.layout.int8_page,
        )

    def note_memory(self) -> None:
        """Updates the peak counters from the pools in use now."""
        st, n = self.stats, len(self.slots)
        if self.pool is not None:
            float_pages = self.pool.in_use
        else:
            float_pages = int(self.decode.cache["block_tables"].size)
        int8_pages = self.pool8.in_use if self.pool8 is not None else 0
        st.max_pages_in_use = max(st.max_pages_in_use, float_pages)
        st.max_int8_pages_in_use = max(st.max_int8_pages_in_use, int8_pages)
        used = n * self.layout.per_slot + float_pages * self.layout.float_page
        st.max_kv_bytes = max(st.max_kv_bytes, used + int8_pages * self.layout.int8_page)

    def pending_tokens(self, partial: bool = False) -> np.ndarray:
        """int32 [slots] stream tokens each slot caches next, with the pages to cache them taken:
        a slot that cannot grow preempts the youngest other slots (or itself when it is alone);
        preempted slots count 0. ``partial`` (KV eviction / int8 on): a slot short of pages
        first takes what the pool has left (the rest waits for the pages its decisions free
        once these tokens are cached), and a slot alone that cannot grow ends truncated."""
        n_new = np.asarray([0 if sl is None else sl.pending for sl in self.slots], np.int32)
        if not n_new.any():
            return n_new
        for s in np.nonzero(n_new)[0]:
            while self.pool is not None and self.slots[s] is not None:
                cached = self.slots[s].cached
                if self.pool.ensure(s, int(cached + n_new[s])):
                    break
                room = self.pool.room(s, cached) if partial else 0
                if room > 0:
                    n_new[s] = min(int(n_new[s]), room)
                    self.pool.ensure(s, int(cached + n_new[s]))
                    break
                self._make_room(s, partial)
        return np.asarray([0 if sl is None else n for sl, n in zip(self.slots, n_new)], np.int32)

    def _make_room(self, s: int, partial: bool) -> None:
        """Slot ``s`` cannot grow: preempts the youngest other slot; alone, preempts itself (or,
        ``partial``, ends truncated: it would resume alone and stop at the same point)."""
        victim = self.youngest(exclude=s)
        if victim is None and partial:
            self.finish(s, truncated=True)
        else:
            self.preempt(victim if victim is not None else s)

    def budgets(self, max_new_tokens: int, cap: int, partial: bool = False) -> np.ndarray:
        """int32 [slots] tokens each generating slot may emit in the next decode call (at most
        ``max_new_tokens`` per turn, ``cap`` per episode), with their pages taken: a slot short
        of pages gets what the pool has left, else preempts the youngest other slots
        (``partial``: as :meth:`pending_tokens`)."""
        budget = np.zeros(len(self.slots), np.int32)
        for s in range(len(self.slots)):
            sl = self.slots[s]
            if sl is None or not sl.generating:  # free, or preempted earlier in this loop
                continue
            budget[s] = max(0, min(max_new_tokens - len(sl.turn_toks), cap - sl.stream_len))
            while self.pool is not None and budget[s] > 0:
                if self.pool.ensure(s, sl.stream_len + budget[s]):
                    break
                room = self.pool.room(s, sl.stream_len)
                if room > 0:
                    self.pool.ensure(s, sl.stream_len + room)
                    budget[s] = room
                    break
                alone = self.youngest(exclude=s) is None
                self._make_room(s, partial)
                if alone:
                    budget[s] = 0
                    break
        return budget

    def trim(self) -> None:
        """Returns the pages beyond each slot's cached tokens to the pool."""
        if self.pool is not None:
            for s, sl in enumerate(self.slots):
                if sl is not None:
                    self.pool.trim(s, sl.cached)


def twin_slots(slots: list, n_new: np.ndarray) -> dict[int, int]:
    """``{slot: earlier slot}`` for slots with new tokens whose whole token stream and cached
    length equal an earlier such slot's: their caches would be computed from the same tokens
    (the episodes of a group start from one prompt, and often read the same first tool
    output)."""
    first: dict[tuple, int] = {}
    twins = {}
    for s in np.flatnonzero(n_new):
        sl = slots[s]
        key = (sl.cached, *sl.rec.tokens, -1, *sl.turn_toks)
        if key in first:
            twins[int(s)] = first[key]
        else:
            first[key] = int(s)
    return twins
