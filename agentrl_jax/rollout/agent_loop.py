"""Multi-turn episodes over a batch of environment slots, token-in/token-out.

Each slot holds one episode. The host loop repeats:
  1. admission: free slots take the next task (``env.reset`` -> prompt ids) — or a preempted
     episode, whose whole token history is prefilled again (identical ids);
  2. prefill: pending environment ids (prompt / observation / re-injected goal) of every slot
     are appended to that slot's cache in one jitted call; nothing already cached is recomputed;
  3. decode: one jitted ``lax.while_loop`` call generates for every slot that is mid-turn; with
     ``continuous=True`` it returns as soon as one slot's turn ends, so that slot steps its
     environment, gets its observation prefilled (or is refilled from the queue) while the
     others keep their place mid-turn; with ``continuous=False`` a wave of slots moves in
     lockstep and new tasks enter only when every slot is free;
  4. a turn that ended (stop token, ``max_new_tokens``, or the cache is full) is decoded on the
     host into a tool call by ``env.step``; the observation ids are appended.
An episode ends when the environment says done, after ``max_turns`` turns or when it reaches
``max_tokens`` / the cache capacity (``truncated``).

With a shared page pool (``n_pages``) pages are taken per call and trimmed afterwards; when the
pool runs short, new episodes wait, and a slot that cannot grow preempts the most recently
admitted slot, which later resumes by re-prefilling its exact tokens. Sampling keys depend on
(episode id, position) only, so under a parity policy a preempted run reproduces the tokens of
an unconstrained run.

With ``disaggregate=Disaggregation(prefill_devices, decode_devices)`` prefill runs on one device
sub-mesh and decode on another; the KV rows of prefilled slots move between them with
``jax.device_put`` around every prefill (``rollout/disaggregation.py``; ``kv_moved_bytes`` per
turn in the logs). Tokens and logprobs equal the colocated run's (bitwise under parity policies).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.envs.base import Env, Tokenizer
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rollout import disaggregation as dis
from agentrl_jax.rollout.kv_cache import EvictionConfig, PagePool, kv_bytes_per_seq
from agentrl_jax.rollout.sampler import SamplingConfig, get_sampler
from agentrl_jax.rollout.trajectory import (
    EpisodeRecord,
    Trajectory,
    stack_episodes,
    weighted_process,
    write_jsonl,
)

logger = logging.getLogger(__name__)


def default_stop_tokens(tokenizer: Tokenizer) -> tuple[int, ...]:
    """``</call>``, ``<eot>``, ``<eos>`` ids."""
    return (tokenizer.call_end_id, tokenizer.eot_id, tokenizer.eos_id)


@dataclasses.dataclass
class _Slot:
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


@dataclasses.dataclass
class RolloutStats:
    """Counters of one ``run_episodes`` call (also attached to the trajectory's logs)."""

    prefill_calls: int = 0
    prefill_tokens: int = 0  # computed; plus shared_prefill_tokens copied from a twin slot
    shared_prefill_tokens: int = 0
    decode_calls: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    admission_waits: int = 0
    max_pages_in_use: int = 0
    evicted_tokens: int = 0
    int8_tokens: int = 0
    kv_moved_bytes: int = 0
    prefill_devices: set = dataclasses.field(default_factory=set)  # ids holding prefill outputs
    decode_devices: set = dataclasses.field(default_factory=set)


def _twins(slots: list, n_new: np.ndarray) -> dict[int, int]:
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


def run_episodes(
    model: Transformer,
    params,
    tasks: Sequence[Any],
    env_factory: Callable[[], Env],
    tokenizer: Tokenizer,
    sampling_cfg: SamplingConfig,
    rng: jax.Array,
    *,
    n_slots: int | None = None,
    max_turns: int = 16,
    max_tokens: int | None = None,
    continuous: bool = True,
    n_pages: int | None = None,
    page_budget: int | None = None,
    goal_every: int = 0,
    group_ids: Sequence[int] | None = None,
    process_weights: dict[str, float] | None = None,
    eviction: EvictionConfig | None = None,
    log_path: str | None = None,
    stats: RolloutStats | None = None,
    disaggregate: dis.Disaggregation | None = None,
    greedy: Sequence[bool] | None = None,
) -> Trajectory:
    """Plays one episode per task with the model as policy; returns the padded batch.

    Args:
      model, params: the policy (its dtype policy decides parity with training).
      tasks: one episode per entry (``env.reset(task)``); trajectory rows follow this order and
        episode ``i`` samples with keys folded from ``(rng, i)``.
      env_factory: returns a fresh environment (one per episode).
      tokenizer: shared tokenizer (stop tokens default to its ``</call> <eot> <eos>``).
      sampling_cfg: sampling and cache shape.
      rng: base PRNG key.
      n_slots: sequences decoded together (default ``len(tasks)``); the trainer's parity
        recompute uses the same batch size.
      max_turns: model turns per episode.
      max_tokens: tokens per episode (default and cap: ``sampling_cfg.max_len``).
      continuous: refill/step slots individually (True) or in lockstep waves (False).
      n_pages: shared KV page pool size (None: every slot owns ``max_len`` worth of pages).
      page_budget: pages the allocator may use out of ``n_pages`` (default all).
      goal_every: if > 0, after every ``goal_every``-th turn the prompt (without ``<bos>``) is
        appended again as environment tokens.
      group_ids: per task group id (default: the task index).
      process_weights: weight per process-signal key (default 1.0 each) for ``process_rewards``.
      eviction: KV eviction / int8 policy for finished tool outputs (see ``kv_cache.py``);
        None: from ``sampling_cfg.eviction_threshold`` / ``eviction_int8`` (off by default).
      log_path: if given, the per-turn records are appended there as JSONL.
      stats: optional counters filled in place.
      disaggregate: prefill and decode on separate device sub-meshes (module docstring).
      greedy: per task, decode that episode greedily (argmax) although ``sampling_cfg``
        samples (e.g. one greedy member per RL group); its logprobs are still the untempered
        policy's. Default: none.

    Returns:
      The :class:`Trajectory`, padded to the longest episode rounded up to the decode chunk.

    Raises:
      ValueError: for empty ``tasks``, ``n_slots < 1``, ``max_turns < 1``, ``max_tokens`` out
        of ``[2, max_len]``, or ``disaggregate`` with KV eviction.
    """
    if not tasks:
        raise ValueError("tasks must be non-empty")
    n_slots = len(tasks) if n_slots is None else n_slots
    if n_slots < 1:
        raise ValueError(f"n_slots={n_slots} must be >= 1")
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    cap = sampling_cfg.max_len if max_tokens is None else max_tokens
    if not 2 <= cap <= sampling_cfg.max_len:
        raise ValueError(f"max_tokens={max_tokens} must be in [2, max_len={sampling_cfg.max_len}]")
    if group_ids is not None and len(group_ids) != len(tasks):
        raise ValueError(f"group_ids has {len(group_ids)} entries, tasks {len(tasks)}")
    if greedy is not None and len(greedy) != len(tasks):
        raise ValueError(f"greedy has {len(greedy)} entries, tasks {len(tasks)}")
    greedy = None if greedy is None or not any(greedy) else [bool(g) for g in greedy]
    cfg = sampling_cfg
    if not cfg.stop_tokens:
        cfg = cfg.replace(stop_tokens=default_stop_tokens(tokenizer))
    sampler = get_sampler(model, cfg)
    mcfg, policy = model.cfg, model.policy
    stats = stats if stats is not None else RolloutStats()
    weights = process_weights or {}
    route_shape = (mcfg.n_layers, mcfg.experts_per_token) if mcfg.is_moe else None
    pool = None
    if n_pages is not None:
        pool = PagePool(n_slots, n_pages, cfg.page_size, cfg.max_len, usable=page_budget)
    if eviction is None and cfg.eviction_threshold > 0:
        eviction = EvictionConfig(threshold=cfg.eviction_threshold, int8=cfg.eviction_int8)
    evicting = eviction is not None and eviction.threshold > 0
    if disaggregate is not None and evicting:
        raise ValueError("disaggregate does not support KV eviction / int8 (eviction=...)")
    state = sampler.init_state(n_slots, n_pages, track_mass=evicting)
    split = None  # disaggregated: `state` lives on the decode mesh, split.state_a on prefill's
    if disaggregate is not None:
        tables = pool.tables if pool is not None else np.asarray(state.cache["block_tables"])
        split = dis.Split(disaggregate, sampler, params, state, tables)
        params, state = split.params_b, split.to_decode(state)

    def reset_slots(mask, tables=None):
        nonlocal state
        state = sampler.reset_slots(state, mask, tables)
        if split is not None:
            state = split.reset(state, mask, tables)

    if pool is not None:
        reset_slots(np.zeros(n_slots, bool), pool.tables)
        pool.dirty = False
    int8 = evicting and eviction.int8
    never = np.iinfo(np.int32).max
    evict_np = np.full((n_slots, cfg.max_len), never, np.int32)  # host mirror of evict_at
    int8_np = np.full((n_slots, cfg.max_len), never, np.int32)  # host mirror of int8_at
    dirty = {"evict": False, "mass": None}

    def kv_bytes(rec: EpisodeRecord) -> int:
        n = len(rec.tokens)
        q8 = [p for p, at in rec.int8_at.items() if at <= n]  # in effect at this length
        pages = len({p // cfg.page_size for p in q8})
        return kv_bytes_per_seq(mcfg, policy, n, cfg.page_size, len(q8), int8_pages=pages)

    def sync(state):
        """Uploads the host mirrors of evict_at / int8_at when a decision changed them."""
        if dirty["evict"]:
            state = state._replace(evict_at=jnp.asarray(evict_np), int8_at=jnp.asarray(int8_np))
            dirty["evict"] = False
        return state

    records: list[EpisodeRecord | None] = [None] * len(tasks)
    slots: list[_Slot | None] = [None] * n_slots
    queue: collections.deque = collections.deque(range(len(tasks)))
    logs: list[dict] = []
    admitted = 0

    def finish(s: int, *, truncated: bool) -> None:
        slot = slots[s]
        slot.rec.truncated = truncated and not slot.rec.done
        records[slot.rec.task_index] = slot.rec
        slots[s] = None
        if pool is not None:
            pool.release(s)

    def preempt(s: int) -> None:
        slot = slots[s]
        slot.cached = 0
        queue.appendleft(slot)
        slots[s] = None
        if pool is not None:
            pool.release(s)
        stats.preemptions += 1

    def youngest(exclude: int | None = None) -> int | None:
        cands = [i for i, sl in enumerate(slots) if sl is not None and i != exclude]
        return max(cands, key=lambda i: slots[i].admitted) if cands else None

    def evict_blocks(s: int) -> None:
        """Evicts (or, with ``eviction.int8``, moves to int8) finished observation blocks of
        slot ``s`` that later tokens barely attend."""
        slot = slots[s]
        n = len(slot.rec.tokens)  # everything so far is cached
        if dirty["mass"] is None:
            dirty["mass"] = np.asarray(sampler.attention_mass(state))
        mass = dirty["mass"][s]
        c = sampler.prefill_rows
        at = -(-n // c) * c  # first chunk-aligned position: takes effect there
        for block in slot.blocks:
            lo, hi, done = block
            if done:
                if block[2] <= n and pool is not None and not int8:  # invisible: free pages
                    ps = cfg.page_size
                    pool.release_pages(s, range(-(-lo // ps), hi // ps))
                continue
            if hi - lo < eviction.min_block or n <= hi:
                continue
            share = float(mass[lo:hi].sum()) / (sampler.n_paged_layers * (n - hi))
            if share < eviction.threshold:
                block[2] = at
                (int8_np if int8 else evict_np)[s, lo:hi] = at
                record = slot.rec.int8_at if int8 else slot.rec.evict_at
                for pos in range(lo, hi):
                    record[pos] = at
                if int8:
                    stats.int8_tokens += hi - lo
                else:
                    stats.evicted_tokens += hi - lo
                dirty["evict"] = True

    def end_turn(s: int) -> None:
        slot = slots[s]
        rec = slot.rec
        slot.turn += 1
        rec.extend(slot.turn_toks, action=True, turn=slot.turn, logprobs=slot.turn_lp)
        action = list(slot.turn_toks)
        slot.turn_toks, slot.turn_lp, slot.generating = [], [], False
        room = cap - len(rec.tokens)
        if room <= 0:
            finish(s, truncated=True)
            return
        obs, res = slot.env.step(action)
        rec.process[len(rec.tokens) - 1] = weighted_process(res.process, weights)
        extra = []
        if not res.done and goal_every and slot.turn % goal_every == 0:
            extra = list(slot.goal)
        new = list(obs) + extra
        kv = kv_bytes(rec)
        slot.moved, moved = 0, slot.moved
        logs.append(
            dict(
                episode=rec.uid,
                turn=slot.turn,
                tool=res.log.get("tool", ""),
                args=list(res.log.get("args", ())),
                output=res.log.get("output", ""),
                error=bool(res.log.get("error", False)),
                process=dict(res.process),
                pages_in_use=pool.owned(s) if pool else -(-len(rec.tokens) // cfg.page_size),
                pool_pages_in_use=pool.in_use if pool else None,
                kv_bytes=kv,
                kv_moved_bytes=moved,
                int8_tokens=sum(at <= len(rec.tokens) for at in rec.int8_at.values()),
                tokens_so_far=len(rec.tokens),
                new_tokens=len(action),
                prefill_tokens=0 if res.done else min(len(new), room),
                goal_reinjected=bool(extra),
            )
        )
        if evicting and not res.done:
            evict_blocks(s)
        lo = len(rec.tokens)
        rec.extend(new[:room], action=False, turn=slot.turn)
        slot.blocks.append([lo, len(rec.tokens), False])
        if res.done:
            rec.done = True
            rec.outcome = float(res.outcome_reward)
            rec.success = bool(res.log.get("success", res.outcome_reward > 0))
            rec.goal_adhered = bool(res.log.get("goal_adhered", True))
            finish(s, truncated=False)
        elif len(new) >= room or slot.turn >= max_turns or len(rec.tokens) >= cap - 1:
            finish(s, truncated=True)

    while queue or any(sl is not None for sl in slots):
        # 1. admission --------------------------------------------------------------------
        reset = np.zeros(n_slots, bool)
        if continuous or all(sl is None for sl in slots):
            for s in range(n_slots):
                if slots[s] is not None or not queue:
                    continue
                item = queue.popleft()
                if isinstance(item, int):  # a new task: start its environment
                    env = env_factory()
                    prompt = list(env.reset(tasks[item]))
                    gid = item if group_ids is None else int(group_ids[item])
                    rec = EpisodeRecord(uid=item, task_index=item, group_id=gid)
                    if route_shape is not None:
                        rec.routes = np.zeros((cap, *route_shape), np.int32)
                    rec.extend(prompt[:cap], action=False, turn=0)
                    goal = prompt[1:] if prompt and prompt[0] == tokenizer.bos_id else prompt
                    item = _Slot(rec=rec, env=env, goal=goal, admitted=admitted)
                if pool is not None and not pool.ensure(s, item.stream_len + 1):
                    stats.admission_waits += 1
                    if all(sl is None for sl in slots):  # can never fit: give up on it
                        item.rec.truncated = True
                        records[item.rec.task_index] = item.rec
                    else:
                        queue.appendleft(item)
                    break
                slot = item
                slot.admitted = admitted
                slot.cached = 0
                evict_np[s] = never
                int8_np[s] = never
                for pos, at in slot.rec.evict_at.items():
                    evict_np[s, pos] = at
                for pos, at in slot.rec.int8_at.items():
                    int8_np[s, pos] = at
                dirty["evict"] = dirty["evict"] or bool(slot.rec.evict_at or slot.rec.int8_at)
                admitted += 1
                slots[s] = slot
                reset[s] = True
            if reset.any() or (pool is not None and pool.dirty):
                reset_slots(reset, None if pool is None else pool.tables.copy())
                if pool is not None:
                    pool.dirty = False

        # 2. prefill pending environment tokens -------------------------------------------
        n_new = np.zeros(n_slots, np.int32)
        lengths = np.zeros(n_slots, np.int32)
        for s, sl in enumerate(slots):
            if sl is not None:
                lengths[s] = sl.cached
                n_new[s] = len(sl.rec.tokens) + len(sl.turn_toks) - sl.cached
        if n_new.any():
            for s in np.nonzero(n_new)[0]:
                while pool is not None and slots[s] is not None:
                    if pool.ensure(s, int(lengths[s] + n_new[s])):
                        break
                    victim = youngest(exclude=s)
                    preempt(victim if victim is not None else s)
            n_new = np.asarray(
                [0 if slots[s] is None else n_new[s] for s in range(n_slots)], np.int32
            )
        if n_new.any():
            if pool is not None and pool.dirty:
                reset_slots(np.zeros(n_slots, bool), pool.tables.copy())
                pool.dirty = False
            state = sync(state)
            width = sampler.prefill_width(n_new.max())
            toks = np.zeros((n_slots, width), np.int32)
            for s in np.nonzero(n_new)[0]:
                sl = slots[s]
                stream = sl.rec.tokens + sl.turn_toks
                toks[s, : n_new[s]] = stream[sl.cached :]
            # Slots with the same tokens (cached and new) as an earlier one are copied from it
            # (not with eviction, whose per-slot decisions this would bypass).
            twins = {} if split is not None or evicting else _twins(slots, n_new)
            run_new = n_new.copy()
            run_new[list(twins)] = 0
            stats.prefill_tokens += int(run_new.sum())
            stats.shared_prefill_tokens += int(n_new.sum() - run_new.sum())
            if split is None:  # only the slots with new tokens are computed
                state, routes = sampler.prefill_slots(params, state, toks, run_new)
                if twins:
                    state = sampler.copy_slots(state, list(twins.values()), list(twins))
                    if routes is not None:
                        routes[list(twins)] = routes[list(twins.values())]
            else:
                cached = np.asarray([0 if sl is None else sl.cached for sl in slots])
                state, routes, moved = split.prefill(state, toks, n_new, cached)
                for s in np.nonzero(moved)[0]:
                    slots[s].moved += int(moved[s])
                stats.kv_moved_bytes += int(moved.sum())
                stats.prefill_devices = split.prefill_devices
            routes = None if routes is None else np.asarray(routes)
            for s in np.nonzero(n_new)[0]:
                sl = slots[s]
                if routes is not None:
                    # resumed episodes keep the routes their tokens were first computed with
                    start = sl.cached
                    lo = max(start, sl.rec.routes_upto)
                    hi = start + n_new[s]
                    if hi > lo:
                        sl.rec.set_routes(lo, routes[s, lo - start : hi - start])
                        sl.rec.routes_upto = hi
                sl.cached += int(n_new[s])
                sl.generating = True
            stats.prefill_calls += 1

        # 3. decode -----------------------------------------------------------------------
        active = np.asarray([sl is not None and sl.generating for sl in slots])
        if not active.any():
            continue
        budget = np.zeros(n_slots, np.int32)
        for s in np.nonzero(active)[0]:
            sl = slots[s]
            if sl is None:  # preempted by an earlier slot of this loop
                continue
            budget[s] = max(0, min(cfg.max_new_tokens - len(sl.turn_toks), cap - sl.stream_len))
            while pool is not None and budget[s] > 0:
                if pool.ensure(s, sl.stream_len + budget[s]):
                    break
                room = pool.room(s, sl.stream_len)
                if room > 0:
                    pool.ensure(s, sl.stream_len + room)
                    budget[s] = room
                    break
                victim = youngest(exclude=s)
                preempt(victim if victim is not None else s)
                if victim is None:
                    break
        active = np.asarray([sl is not None and sl.generating for sl in slots])
        if not active.any():
            continue
        if pool is not None:
            if pool.dirty:
                reset_slots(np.zeros(n_slots, bool), pool.tables.copy())
                pool.dirty = False
            stats.max_pages_in_use = max(stats.max_pages_in_use, pool.in_use)
        state = sync(state)
        uids = np.asarray([sl.rec.uid if sl is not None else 0 for sl in slots], np.int32)
        stop_after = 1 if continuous else int(active.sum())
        rows = None  # None traces the all-sampled decode
        if greedy is not None:
            rows = np.asarray([sl is not None and greedy[sl.rec.task_index] for sl in slots])
        state, out = sampler.decode(
            params, state, rng, uids, active, budget, np.int32(stop_after), rows
        )
        if split is not None:
            stats.decode_devices |= {d.id for d in out.tokens.sharding.device_set}
        out = jax.device_get(out)
        dirty["mass"] = None
        stats.decode_calls += 1
        stats.decode_tokens += int(out.n_new.sum())
        for s in np.nonzero(active)[0]:
            sl = slots[s]
            n = int(out.n_new[s])
            start = sl.stream_len
            sl.turn_toks += out.tokens[s, :n].tolist()
            sl.turn_lp += out.logprobs[s, :n].tolist()
            if out.routes is not None and n:
                sl.rec.set_routes(start, out.routes[s, :n])
                sl.rec.routes_upto = start + n
            sl.cached += n
            last = sl.turn_toks[-1] if sl.turn_toks else None
            if (
                last in cfg.stop_tokens
                or len(sl.turn_toks) >= cfg.max_new_tokens
                or sl.stream_len >= cap
            ):
                end_turn(s)
        if pool is not None:
            for s, sl in enumerate(slots):
                if sl is not None:
                    pool.trim(s, sl.cached)

    done_records = [r for r in records if r is not None]
    c = cfg.chunk
    longest = max(len(r.tokens) for r in done_records)
    pad_to = min(-(-longest // c) * c, max(cfg.max_len, longest))
    traj = stack_episodes(
        done_records, pad_to=pad_to, route_shape=route_shape, kv_masks=evicting, logs=logs
    )
    if log_path is not None:
        write_jsonl(traj, log_path)
    return traj
