"""What the host does when a model turn ends: the end test, the turn's log record, the
episode's outcome, KV eviction / int8 decisions over finished observation blocks, and giving
back the pages those decisions empty.

Eviction (``kv_cache.EvictionConfig``): after a model turn, an observation block followed by at
least one later model turn whose attention mass from the tokens after it (summed over F/D layers,
per later token) is under ``threshold`` is evicted, or moved to int8, from the next
prefill-chunk-aligned position on. The decision is recorded per token in the episode record and
in the loop's host mirrors (uploaded before the next device call), so training replays it.

Pages (:func:`assign_int8`, :func:`reclaim`): a page whose tokens are all int8 gets an int8
page when the int8 pool has one; a float page goes back to the pool once every token on it is
evicted and no later chunk sees it (cached length >= the decision position), or is int8 with an
int8 page and converted (cached length > the decision position).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from agentrl_jax.envs.base import StepResult
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.loop_state import EpisodeSlot, LoopState
from agentrl_jax.rollout.sampler import NEVER, RolloutConfig
from agentrl_jax.rollout.trajectory import EpisodeRecord


def turn_ended(slot: EpisodeSlot, cfg: RolloutConfig, cap: int) -> bool:
    """Whether the slot's turn is over: a stop token, ``max_new_tokens`` or ``cap`` tokens."""
    last = slot.turn_toks[-1] if slot.turn_toks else None
    return (
        last in cfg.stop_tokens
        or len(slot.turn_toks) >= cfg.max_new_tokens
        or slot.stream_len >= cap
    )


def turn_log(
    state: LoopState,
    s: int,
    action: list[int],
    res: StepResult,
    *,
    prefill_tokens: int,
    goal_reinjected: bool,
) -> dict:
    """The log record of slot ``s``'s turn that just ended (one JSONL line per turn), with the
    episode's KV memory on the live pools (``LoopState.slot_kv``); takes the KV bytes it moved
    between sub-meshes since the last record."""
    slot, pool, pool8 = state.slots[s], state.pool, state.pool8
    rec = slot.rec
    slot.moved, moved = 0, slot.moved
    return dict(
        episode=rec.uid,
        turn=slot.turn,
        tool=res.log.get("tool", ""),
        args=_args(res.log.get("args", ())),
        output=res.log.get("output", ""),
        **({"text": res.log["text"]} if "text" in res.log else {}),  # a chat env's whole turn
        error=bool(res.log.get("error", False)),
        process=dict(res.process),
        hack_suspect=list(res.log.get("hack_suspect", ())),
        **state.slot_kv(s),
        pool_pages_in_use=pool.in_use if pool else None,
        int8_pool_pages_in_use=pool8.in_use if pool8 else None,
        kv_moved_bytes=moved,
        int8_tokens=sum(at <= len(rec.tokens) for at in rec.int8_at.values()),
        tokens_so_far=len(rec.tokens),
        new_tokens=len(action),
        prefill_tokens=prefill_tokens,
        goal_reinjected=goal_reinjected,
    )


def _args(args) -> dict | list:
    """A call's arguments as logged: a JSON-call environment's dict whole, else a list (the
    mini-language's words)."""
    return dict(args) if isinstance(args, Mapping) else list(args)


def record_outcome(rec: EpisodeRecord, res: StepResult) -> None:
    """Marks ``rec`` done with the final step's outcome reward, success and goal adherence."""
    rec.done = True
    rec.outcome = float(res.outcome_reward)
    rec.success = bool(res.log.get("success", res.outcome_reward > 0))
    rec.goal_adhered = bool(res.log.get("goal_adhered", True))


def evict_blocks(
    state: LoopState,
    s: int,
    mass,
    eviction: EvictionConfig,
    *,
    chunk: int,
    page_size: int,
    n_paged_layers: int,
) -> None:
    """Evicts (or, with ``eviction.int8``, moves to int8) the finished observation blocks of
    slot ``s`` that later tokens barely attend (module docstring), gives int8 pages to pages now
    all int8 and frees the pages earlier decisions emptied.

    Args:
      state: the loop state (slot, pools, host mirrors, counters; ``marks_dirty`` is set when a
        decision is taken).
      s: the slot; everything in its record is cached.
      mass: float32 [max_len] attention mass each cached position of the slot received.
      eviction: the policy.
      chunk: the sampler's prefill chunk rows (decisions take effect at multiples of it).
      page_size: KV page size.
      n_paged_layers: F/D layers the mass is summed over.
    """
    slot = state.slots[s]
    n = len(slot.rec.tokens)
    at = -(-n // chunk) * chunk  # first chunk-aligned position: takes effect there
    for block in slot.blocks:
        lo, hi, done = block
        if done or hi - lo < eviction.min_block or n <= hi:
            continue
        share = float(mass[lo:hi].sum()) / (n_paged_layers * (n - hi))
        if share >= eviction.threshold:
            continue
        int8 = eviction.int8 and share >= eviction.drop_threshold
        block[2] = at
        (state.int8_at if int8 else state.evict_at)[s, lo:hi] = at
        record = slot.rec.int8_at if int8 else slot.rec.evict_at
        for pos in range(lo, hi):
            record[pos] = at
        if int8:
            state.stats.int8_tokens += hi - lo
        else:
            state.stats.evicted_tokens += hi - lo
        state.marks_dirty = True
    assign_int8(state, s, n, page_size)
    reclaim(state, s, page_size)


def _complete_pages(marks: np.ndarray, n: int, page_size: int) -> np.ndarray:
    """int32 [n // L, L] marks of the complete pages of the first ``n`` positions."""
    full = n // page_size
    return marks[: full * page_size].reshape(full, page_size)


def assign_int8(state: LoopState, s: int, n: int, page_size: int) -> None:
    """Gives an int8 page to every complete page among slot ``s``'s first ``n`` positions whose
    tokens are all int8 (while the int8 pool has free pages; the others stay float)."""
    if state.pool8 is None:
        return
    pages = _complete_pages(state.int8_at[s], n, page_size)
    for j in np.flatnonzero((pages != NEVER).all(axis=1)):
        if not state.pool8.take(s, int(j)):
            return


def reclaim(state: LoopState, s: int, page_size: int) -> int:
    """Frees slot ``s``'s float pages that no later chunk reads (module docstring); returns
    how many."""
    pool, slot = state.pool, state.slots[s]
    if pool is None or slot is None:
        return 0
    cached = slot.cached
    evicted = (_complete_pages(state.evict_at[s], cached, page_size) <= cached).all(axis=1)
    gone = evicted
    if state.pool8 is not None:
        marks = _complete_pages(state.int8_at[s], cached, page_size)
        has8 = state.pool8.tables[s, : len(marks)] >= 0
        gone = gone | (has8 & (marks < cached).all(axis=1))
    held = pool.tables[s, : len(gone)] >= 0
    return pool.release_pages(s, np.flatnonzero(gone & held))
