"""What the host does when a model turn ends: the end test, the turn's log record, the
episode's outcome, and KV eviction / int8 decisions over finished observation blocks.

Eviction (``kv_cache.EvictionConfig``): after a model turn, an observation block followed by at
least one later model turn whose attention mass from the tokens after it (summed over F/D layers,
per later token) is under ``threshold`` is evicted, or moved to int8, from the next
prefill-chunk-aligned position on. The decision is recorded per token in the episode record and
in the loop's host mirrors (uploaded before the next device call), so training replays it.
"""

from __future__ import annotations

from agentrl_jax.envs.base import StepResult
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import DTypePolicy
from agentrl_jax.rollout.kv_cache import EvictionConfig, kv_bytes_per_seq
from agentrl_jax.rollout.loop_state import EpisodeSlot, LoopState
from agentrl_jax.rollout.sampler import SamplingConfig
from agentrl_jax.rollout.trajectory import EpisodeRecord


def turn_ended(slot: EpisodeSlot, cfg: SamplingConfig, cap: int) -> bool:
    """Whether the slot's turn is over: a stop token, ``max_new_tokens`` or ``cap`` tokens."""
    last = slot.turn_toks[-1] if slot.turn_toks else None
    return (
        last in cfg.stop_tokens
        or len(slot.turn_toks) >= cfg.max_new_tokens
        or slot.stream_len >= cap
    )


def record_kv_bytes(
    rec: EpisodeRecord, model_cfg: ModelConfig, policy: DTypePolicy, page_size: int
) -> int:
    """KV bytes of ``rec``'s tokens, counting the int8 decisions in effect at its length."""
    n = len(rec.tokens)
    q8 = [p for p, at in rec.int8_at.items() if at <= n]
    pages = len({p // page_size for p in q8})
    return kv_bytes_per_seq(model_cfg, policy, n, page_size, len(q8), int8_pages=pages)


def turn_log(
    state: LoopState,
    s: int,
    action: list[int],
    res: StepResult,
    *,
    kv_bytes: int,
    page_size: int,
    prefill_tokens: int,
    goal_reinjected: bool,
) -> dict:
    """The log record of slot ``s``'s turn that just ended (one JSONL line per turn); takes the
    KV bytes it moved between sub-meshes since the last record."""
    slot, pool = state.slots[s], state.pool
    rec = slot.rec
    slot.moved, moved = 0, slot.moved
    return dict(
        episode=rec.uid,
        turn=slot.turn,
        tool=res.log.get("tool", ""),
        args=list(res.log.get("args", ())),
        output=res.log.get("output", ""),
        error=bool(res.log.get("error", False)),
        process=dict(res.process),
        pages_in_use=pool.owned(s) if pool else -(-len(rec.tokens) // page_size),
        pool_pages_in_use=pool.in_use if pool else None,
        kv_bytes=kv_bytes,
        kv_moved_bytes=moved,
        int8_tokens=sum(at <= len(rec.tokens) for at in rec.int8_at.values()),
        tokens_so_far=len(rec.tokens),
        new_tokens=len(action),
        prefill_tokens=prefill_tokens,
        goal_reinjected=goal_reinjected,
    )


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
    slot ``s`` that later tokens barely attend (module docstring).

    Args:
      state: the loop state (slot, pool, host mirrors, counters; ``marks_dirty`` is set when a
        decision is taken).
      s: the slot; everything in its record is cached.
      mass: float32 [max_len] attention mass each cached position of the slot received.
      eviction: the policy.
      chunk: the sampler's prefill chunk rows (decisions take effect at multiples of it).
      page_size: KV page size (whole evicted pages go back to the pool).
      n_paged_layers: F/D layers the mass is summed over.
    """
    slot, pool = state.slots[s], state.pool
    n = len(slot.rec.tokens)
    at = -(-n // chunk) * chunk  # first chunk-aligned position: takes effect there
    for block in slot.blocks:
        lo, hi, done = block
        if done:
            if block[2] <= n and pool is not None and not eviction.int8:  # invisible: free pages
                pool.release_pages(s, range(-(-lo // page_size), hi // page_size))
            continue
        if hi - lo < eviction.min_block or n <= hi:
            continue
        share = float(mass[lo:hi].sum()) / (n_paged_layers * (n - hi))
        if share < eviction.threshold:
            block[2] = at
            (state.int8_at if eviction.int8 else state.evict_at)[s, lo:hi] = at
            record = slot.rec.int8_at if eviction.int8 else slot.rec.evict_at
            for pos in range(lo, hi):
                record[pos] = at
            if eviction.int8:
                state.stats.int8_tokens += hi - lo
            else:
                state.stats.evicted_tokens += hi - lo
            state.marks_dirty = True
