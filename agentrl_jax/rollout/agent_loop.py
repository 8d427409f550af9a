"""Multi-turn episodes over a batch of environment slots, token-in/token-out.

Each slot holds one episode. :meth:`AgentLoop.step` plays one round of phases:
  1. ``admit``: free slots take the next task (``env.reset`` -> prompt ids) or a preempted
     episode, whose whole token history is prefilled again (identical ids);
  2. ``prefill``: every slot's pending environment ids (prompt / observation / re-injected goal)
     are appended to its cache in one jitted call; nothing cached is recomputed;
  3. ``decode``: one jitted ``lax.while_loop`` call generates for every mid-turn slot; with
     ``continuous=True`` it returns as soon as one slot's turn ends (that slot steps its
     environment and is prefilled or refilled while the others keep their place mid-turn);
     with ``continuous=False`` a wave of slots moves in lockstep;
  4. ``end_turns``: an ended turn (stop token, ``max_new_tokens``, full cache) is recorded, its
     tool call goes to ``env.step`` (``step_envs``, optionally on an executor) and the
     observation is recorded (``record_step``, which runs KV eviction, ``evict``);
  5. pages beyond each slot's cached tokens go back to the pool.
An episode ends when the environment says done, after ``max_turns`` turns or at ``max_tokens``
/ the cache capacity (``truncated``). Between rounds a caller may swap the parameters
(``set_params``); :func:`run_episodes` plays rounds until every task is done.

With a shared page pool (``n_pages``), new episodes wait when the pool runs short and a slot
that cannot grow preempts the most recently admitted slot, which resumes later by
re-prefilling its exact tokens. KV eviction / int8 give their pages back (``rollout.turns``):
later turns and newly admitted episodes take them. With eviction on, a slot short of pages
prefills what fits and continues once its decisions freed pages, a preempted episode resumes
piecewise when it would be alone in the pool (else when its whole history fits), and an
episode alone that cannot grow ends truncated. Sampling keys depend on (episode id, position)
only, so under a
parity policy a preempted run reproduces the tokens of an unconstrained run. With
``disaggregate`` prefill and decode run on two device sub-meshes and the prefilled KV moves
between them (``rollout/disaggregation.py``; ``kv_moved_bytes`` per turn in the logs); tokens
and logprobs equal the colocated run's (bitwise under parity policies).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import jax
import numpy as np

from agentrl_jax.envs.base import Env, StepResult, Tokenizer
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rollout import disaggregation as dis
from agentrl_jax.rollout import turns
from agentrl_jax.rollout.kv_cache import KVLayout, PagePool
from agentrl_jax.rollout.loop_state import (
    EpisodeSlot,
    LoopOptions,
    LoopState,
    RolloutStats,
    resolve_options,
    twin_slots,
)
from agentrl_jax.rollout.sampler import NEVER, RolloutConfig, get_sampler
from agentrl_jax.rollout.trajectory import (
    EpisodeRecord,
    Trajectory,
    own_blocks,
    weighted_process,
    write_jsonl,
)


def default_stop_tokens(tokenizer: Tokenizer) -> tuple[int, ...]:
    """``</call>``, ``<eot>``, ``<eos>`` ids."""
    return (tokenizer.call_end_id, tokenizer.eot_id, tokenizer.eos_id)


class AgentLoop:
    """One rollout of ``tasks`` over ``options.n_slots`` slots, played a round at a time.

    Args:
      model: the policy (its dtype policy decides parity with training).
      params: its parameters (:meth:`set_params` swaps them between rounds).
      tasks: one episode per entry (``env.reset(task)``); trajectory rows follow this order and
        episode ``i`` samples with keys folded from ``(rng, i)``.
      env_factory: returns a fresh environment (one per episode).
      tokenizer: shared tokenizer (stop tokens default to its ``</call> <eot> <eos>``).
      sampling_cfg: sampling and cache shape.
      rng: base PRNG key.
      options: the :class:`LoopOptions` (default ``LoopOptions()``).
      group_ids: per task group id (default: the task index).
      greedy: per task, decode that episode greedily (argmax) although ``sampling_cfg``
        samples; its logprobs are still the sampling policy's (at its temperature). Default: none.
      stats: counters filled in place (default: new ones, ``self.state.stats``).
      env_executor: runs the environment steps of a round concurrently (``executor.map``);
        None steps them one after the other.

    Raises:
      ValueError: for empty ``tasks``, ``max_tokens`` out of ``[2, max_len]``, per-task lists
        of the wrong length, or ``disaggregate`` with KV eviction, block records or a
        ``sparse_gather`` model.
    """

    def __init__(
        self,
        model: Transformer,
        params,
        tasks: Sequence[Any],
        env_factory: Callable[[], Env],
        tokenizer: Tokenizer,
        sampling_cfg: RolloutConfig,
        rng: jax.Array,
        options: LoopOptions | None = None,
        *,
        group_ids: Sequence[int] | None = None,
        greedy: Sequence[bool] | None = None,
        stats: RolloutStats | None = None,
        env_executor: Executor | None = None,
    ):
        if not tasks:
            raise ValueError("tasks must be non-empty")
        options, self.eviction, self.int8_pages = resolve_options(
            options, sampling_cfg, model.cfg, len(tasks)
        )
        self.options = options
        cap = sampling_cfg.max_len if options.max_tokens is None else options.max_tokens
        if not 2 <= cap <= sampling_cfg.max_len:
            raise ValueError(
                f"max_tokens={options.max_tokens} must be in [2, max_len={sampling_cfg.max_len}]"
            )
        for name, per_task in (("group_ids", group_ids), ("greedy", greedy)):
            if per_task is not None and len(per_task) != len(tasks):
                raise ValueError(f"{name} has {len(per_task)} entries, tasks {len(tasks)}")
        self.greedy = None if greedy is None or not any(greedy) else [bool(g) for g in greedy]
        self.tasks, self.env_factory, self.tokenizer, self.rng = tasks, env_factory, tokenizer, rng
        self.group_ids, self.cap, self.env_executor = group_ids, cap, env_executor
        self.cfg = cfg = sampling_cfg
        if not cfg.stop_tokens:
            self.cfg = cfg = cfg.replace(stop_tokens=default_stop_tokens(tokenizer))
        self.model, self.sampler = model, get_sampler(model, cfg)
        self.weights = dict(options.process_weights)
        mcfg = model.cfg
        self.route_shape = (mcfg.n_layers, mcfg.experts_per_token) if mcfg.is_moe else None
        self.evicting = self.eviction is not None
        self.params, self.split = params, None  # split: the prefill sub-mesh's copies
        self.state = self._init_state(stats)
        self.decode_params = self._prepare()

    def _init_state(self, stats: RolloutStats | None) -> LoopState:
        """Empty slots, the page pool, the sampler state (placed on the sub-meshes)."""
        opts, cfg = self.options, self.cfg
        pool = pool8 = None
        if opts.n_pages is not None:
            pool = PagePool(
                opts.n_slots, opts.n_pages, cfg.page_size, cfg.max_len, opts.page_budget
            )
        if self.int8_pages:
            pool8 = PagePool(opts.n_slots, self.int8_pages, cfg.page_size, cfg.max_len)
        decode = self.sampler.init_state(
            opts.n_slots, opts.n_pages, track_mass=self.evicting, int8_pages=self.int8_pages
        )
        layout = KVLayout.from_cache(decode.cache, self.model.cfg.layer_pattern)
        if opts.disaggregate is not None:
            tables = pool.tables if pool is not None else np.asarray(decode.cache["block_tables"])
            self.split = dis.Split(opts.disaggregate, self.sampler, self.params, decode, tables)
            self.params, decode = self.split.params_b, self.split.to_decode(decode)
        never = np.full((opts.n_slots, cfg.max_len), NEVER, np.int32)
        self.state = LoopState(
            slots=[None] * opts.n_slots,
            queue=collections.deque(range(len(self.tasks))),
            records=[None] * len(self.tasks),
            logs=[],
            pool=pool,
            pool8=pool8,
            decode=decode,
            layout=layout,
            evict_at=never,
            int8_at=never.copy(),
            stats=stats if stats is not None else RolloutStats(),
        )
        if pool is not None:
            self.sync_tables(force=True)
        return self.state

    # Driving ----------------------------------------------------------------------------------
    def done(self) -> bool:
        """Whether every task has been played."""
        return not self.state.busy

    def step(self) -> None:
        """One round: admit, prefill, decode, end the turns that ended, trim the pages."""
        self.admit()
        self.prefill()
        ended = self.decode()
        if ended is None:
            return
        self.end_turns(ended)
        self.state.trim()

    def set_params(self, params) -> None:
        """Parameters for the following rounds (placed on both sub-meshes when disaggregated);
        the decode's are prepared from them once, here."""
        self.params = params if self.split is None else self.split.set_params(params)
        self.decode_params = self._prepare()

    def _prepare(self):
        """The decode's parameters of this weight version (``Sampler.prepare``)."""
        return self.sampler.prepare(self.params, track_mass=self.evicting)

    def trajectory(self) -> Trajectory:
        """The padded batch of the finished episodes (call once :meth:`done`); written to
        ``options.log_path`` when set. Padded to the longest episode rounded up to the decode
        chunk."""
        block_size = self.model.cfg.sparse_block_size
        traj = self.state.stack(self.cfg, self.route_shape, self.evicting, block_size)
        if self.options.log_path is not None:
            write_jsonl(traj, self.options.log_path)
        return traj

    # Slots ------------------------------------------------------------------------------------
    def reset_slots(self, mask, tables=None, tables8=None) -> None:
        """Empties the device slots where ``mask`` is set; optionally new block tables (of the
        float and the int8 pool)."""
        st = self.state
        st.decode = self.sampler.reset_slots(st.decode, mask, tables, tables8)
        if self.split is not None:
            st.decode = self.split.reset(st.decode, mask, tables)

    def sync_tables(self, mask=None, *, force: bool = False) -> None:
        """Resets the slots in ``mask`` (if any) and uploads the pools' block tables if they
        changed (or ``force``)."""
        st = self.state
        mask = np.zeros(len(st.slots), bool) if mask is None else mask
        pools = [p for p in (st.pool, st.pool8) if p is not None]
        if not (mask.any() or force or any(p.dirty for p in pools)):
            return
        tables = None if st.pool is None else st.pool.tables.copy()
        tables8 = None if st.pool8 is None else st.pool8.tables.copy()
        self.reset_slots(mask, tables, tables8)
        for p in pools:
            p.dirty = False

    def sync_marks(self) -> None:
        """Uploads the host mirrors of evict_at / int8_at when a decision changed them."""
        self.state.upload_marks()

    # 1. Admission -----------------------------------------------------------------------------
    def new_episode(self, task_index: int) -> EpisodeSlot:
        """Starts the environment of task ``task_index``: its prompt is the episode's stream."""
        env = self.env_factory()
        prompt = list(env.reset(self.tasks[task_index]))
        gid = task_index if self.group_ids is None else int(self.group_ids[task_index])
        uid = task_index + self.options.first_uid  # sampling keys and log rows use it
        rec = EpisodeRecord(uid=uid, task_index=task_index, group_id=gid)
        if self.route_shape is not None:
            rec.routes = np.zeros((self.cap, *self.route_shape), np.int32)
        rec.extend(prompt[: self.cap], action=False, turn=0)
        if self.state.decode.blocks is not None:
            shape = self.state.decode.blocks.shape
            rec.blocks = own_blocks(self.cap, shape[2:], self.model.cfg.sparse_block_size)
        bos = self.tokenizer.bos_id
        goal = prompt[1:] if prompt and prompt[0] == bos else prompt
        return EpisodeSlot(rec=rec, env=env, goal=goal, admitted=self.state.admitted)

    def admit(self) -> None:
        """Free slots take queued tasks or preempted episodes (all slots free in lockstep)."""
        st = self.state
        if not (self.options.continuous or all(sl is None for sl in st.slots)):
            return
        reset = np.zeros(len(st.slots), bool)
        for s in range(len(st.slots)):
            if st.slots[s] is not None or not st.queue:
                continue
            item = st.queue.popleft()
            if isinstance(item, int):  # a new task: start its environment
                item = self.new_episode(item)
            need = item.stream_len + 1
            if self.evicting and all(sl is None for sl in st.slots):
                need = min(need, self.cfg.page_size)  # alone: the rest is prefilled piecewise
            if st.pool is not None and not st.pool.ensure(s, need):
                st.stats.admission_waits += 1
                if all(sl is None for sl in st.slots):  # can never fit: give up on it
                    item.rec.truncated = True
                    st.records[item.rec.task_index] = item.rec
                else:
                    st.queue.appendleft(item)
                break
            st.place(s, item)
            turns.assign_int8(st, s, len(item.rec.tokens), self.cfg.page_size)  # resumed
            reset[s] = True
        self.sync_tables(reset)

    # 2. Prefill -------------------------------------------------------------------------------
    def prefill(self) -> None:
        """Appends every slot's pending environment tokens to its cache (one jitted call)."""
        st = self.state
        n_new = st.pending_tokens(partial=self.evicting)
        if not n_new.any():
            return
        self.sync_tables()
        self.sync_marks()
        width = self.sampler.prefill_width(n_new.max())
        toks = np.zeros((len(st.slots), width), np.int32)
        for s in np.nonzero(n_new)[0]:
            sl = st.slots[s]
            toks[s, : n_new[s]] = (sl.rec.tokens + sl.turn_toks)[sl.cached : sl.cached + n_new[s]]
        routes = self.run_prefill(toks, n_new)
        for s in np.nonzero(n_new)[0]:
            sl = st.slots[s]
            if routes is not None:
                # resumed episodes keep the routes their tokens were first computed with
                start = sl.cached
                lo, hi = max(start, sl.rec.routes_upto), start + n_new[s]
                if hi > lo:
                    sl.rec.set_routes(lo, routes[s, lo - start : hi - start])
                    sl.rec.routes_upto = hi
            sl.cached += int(n_new[s])
            sl.generating = sl.pending == 0  # else the rest is prefilled next round
            if self.evicting:  # conversions of this prefill done: their float pages go back
                turns.reclaim(st, int(s), self.cfg.page_size)
        st.stats.prefill_calls += 1

    def run_prefill(self, toks: np.ndarray, n_new: np.ndarray) -> np.ndarray | None:
        """The device prefill of ``toks`` int32 [B, W] (``n_new`` int32 [B] per slot); returns
        the new tokens' routes [B, W, L_moe, k] (MoE) or None."""
        st = self.state
        # Slots with the same tokens (cached and new) as an earlier one are copied from it
        # (not with eviction, whose per-slot decisions this would bypass).
        twins = {} if self.split is not None or self.evicting else twin_slots(st.slots, n_new)
        run_new = n_new.copy()
        run_new[list(twins)] = 0
        st.stats.prefill_tokens += int(run_new.sum())
        st.stats.shared_prefill_tokens += int(n_new.sum() - run_new.sum())
        if self.split is None:  # only the slots with new tokens are computed
            st.decode, routes = self.sampler.prefill_slots(self.params, st.decode, toks, run_new)
            if twins:
                st.decode = self.sampler.copy_slots(st.decode, list(twins.values()), list(twins))
                if routes is not None:
                    routes[list(twins)] = routes[list(twins.values())]
        else:
            cached = np.asarray([0 if sl is None else sl.cached for sl in st.slots])
            st.decode, routes, moved = self.split.prefill(st.decode, toks, n_new, cached)
            for s in np.nonzero(moved)[0]:
                st.slots[s].moved += int(moved[s])
            st.stats.kv_moved_bytes += int(moved.sum())
            st.stats.prefill_devices = self.split.prefill_devices
        return None if routes is None else np.asarray(routes)

    # 3. Decode --------------------------------------------------------------------------------
    def decode(self) -> list[int] | None:
        """Generates for every mid-turn slot (one jitted call) and appends the tokens.

        Returns:
          The slots whose turn ended, in slot order; None when no slot was generating.
        """
        st, cfg = self.state, self.cfg
        if not any(sl is not None and sl.generating for sl in st.slots):
            return None
        budget = st.budgets(cfg.max_new_tokens, self.cap, partial=self.evicting)
        active = np.asarray([sl is not None and sl.generating for sl in st.slots])
        if not active.any():
            return None
        self.sync_tables()
        st.note_memory()
        self.sync_marks()
        uids = np.asarray([sl.rec.uid if sl is not None else 0 for sl in st.slots], np.int32)
        stop_after = 1 if self.options.continuous else int(active.sum())
        rows = None  # None traces the all-sampled decode
        if self.greedy is not None:
            rows = np.asarray(
                [sl is not None and self.greedy[sl.rec.task_index] for sl in st.slots]
            )
        st.decode, out = self.sampler.decode(
            self.decode_params, st.decode, self.rng, uids, active, budget, np.int32(stop_after),
            rows,
        )  # fmt: skip
        if self.split is not None:
            st.stats.decode_devices |= {d.id for d in out.tokens.sharding.device_set}
        out = jax.device_get(out)
        st.mass = None
        st.stats.decode_calls += 1
        st.stats.decode_tokens += int(out.n_new.sum())
        ended = []
        for s in np.nonzero(active)[0]:
            sl = st.slots[s]
            n = int(out.n_new[s])
            start = sl.stream_len
            sl.turn_toks += out.tokens[s, :n].tolist()
            sl.turn_lp += out.logprobs[s, :n].tolist()
            if out.routes is not None and n:
                sl.rec.set_routes(start, out.routes[s, :n])
                sl.rec.routes_upto = start + n
            sl.cached += n
            if turns.turn_ended(sl, cfg, self.cap):
                ended.append(int(s))
        return ended

    # 4. Turn ends: tool calls, environment steps, records, eviction --------------------------
    def end_turns(self, ended: Sequence[int]) -> None:
        """Records the ended turns, steps their environments (all at once, so an executor can
        run them together) and records what they answered, slot by slot in ``ended`` order."""
        actions = [(s, self.close_turn(s)) for s in ended]
        calls = [(s, a) for s, a in actions if self.room(s) > 0]
        results = self.step_envs([(self.state.slots[s].env, a) for s, a in calls])
        answers = dict(zip([s for s, _ in calls], results, strict=True))
        for s, action in actions:
            if s in answers:
                self.record_step(s, action, *answers[s])
            else:  # no room for an observation
                self.state.finish(s, truncated=True)

    def room(self, s: int) -> int:
        """Tokens slot ``s``'s episode may still grow by."""
        return self.cap - len(self.state.slots[s].rec.tokens)

    def close_turn(self, s: int) -> list[int]:
        """Appends the turn's tokens to slot ``s``'s record; returns them (the tool call)."""
        slot = self.state.slots[s]
        slot.turn += 1
        slot.rec.extend(slot.turn_toks, action=True, turn=slot.turn, logprobs=slot.turn_lp)
        action = list(slot.turn_toks)
        slot.turn_toks, slot.turn_lp, slot.generating = [], [], False
        return action

    def step_envs(self, calls: Sequence[tuple[Env, list[int]]]) -> list[tuple[list, StepResult]]:
        """``env.step(action)`` for every (env, action), on ``env_executor`` when given."""
        if self.env_executor is None:
            return [env.step(action) for env, action in calls]
        return list(self.env_executor.map(lambda call: call[0].step(call[1]), calls))

    def record_step(self, s: int, action: list[int], obs, res: StepResult) -> None:
        """Logs the turn, evicts what later tokens no longer attend, appends the observation
        (and the goal when it is due) and ends the episode when it is over."""
        st, slot = self.state, self.state.slots[s]
        rec, room = slot.rec, self.room(s)
        rec.process[len(rec.tokens) - 1] = weighted_process(res.process, self.weights)
        every = self.options.goal_every
        extra = list(slot.goal) if not res.done and every and slot.turn % every == 0 else []
        new = list(obs) + extra
        st.logs.append(
            turns.turn_log(
                st,
                s,
                action,
                res,
                prefill_tokens=0 if res.done else min(len(new), room),
                goal_reinjected=bool(extra),
            )
        )
        if self.evicting and not res.done:
            self.evict(s)
        lo = len(rec.tokens)
        rec.extend(new[:room], action=False, turn=slot.turn)
        slot.blocks.append([lo, len(rec.tokens), False])
        if res.done:
            turns.record_outcome(rec, res)
            self.state.finish(s, truncated=False)
        elif len(new) >= room or slot.turn >= self.options.max_turns or self.room(s) <= 1:
            self.state.finish(s, truncated=True)

    def evict(self, s: int) -> None:
        """KV eviction (or int8) of slot ``s``'s finished observation blocks."""
        st = self.state
        if st.mass is None:
            st.mass = np.asarray(self.sampler.attention_mass(st.decode))
        turns.evict_blocks(
            st,
            s,
            st.mass[s],
            self.eviction,
            chunk=self.sampler.prefill_rows,
            page_size=self.cfg.page_size,
            n_paged_layers=self.sampler.n_paged_layers,
        )


def run_episodes(
    model: Transformer,
    params,
    tasks: Sequence[Any],
    env_factory: Callable[[], Env],
    tokenizer: Tokenizer,
    sampling_cfg: RolloutConfig,
    rng: jax.Array,
    options: LoopOptions | None = None,
    *,
    group_ids: Sequence[int] | None = None,
    greedy: Sequence[bool] | None = None,
    stats: RolloutStats | None = None,
    env_executor: Executor | None = None,
    **option_fields,
) -> Trajectory:
    """Plays one episode per task with the model as policy; returns the padded batch.

    Arguments are :class:`AgentLoop`'s; ``option_fields`` (``n_slots=``, ``max_turns=``,
    ``max_tokens=``, ``continuous=``, ``n_pages=``, ``page_budget=``, ``goal_every=``,
    ``process_weights=``, ``eviction=``, ``log_path=``, ``disaggregate=``, ``first_uid=``)
    override fields of ``options`` (default ``LoopOptions()``).

    Returns:
      The :class:`Trajectory`, padded to the longest episode rounded up to the decode chunk.

    Raises:
      ValueError: as :class:`AgentLoop` and :class:`LoopOptions`.
      TypeError: for a keyword that is no ``LoopOptions`` field.
    """
    if not tasks:
        raise ValueError("tasks must be non-empty")
    options = dataclasses.replace(options or LoopOptions(), **option_fields)
    loop = AgentLoop(
        model, params, tasks, env_factory, tokenizer, sampling_cfg, rng, options,
        group_ids=group_ids, greedy=greedy, stats=stats, env_executor=env_executor,
    )  # fmt: skip
    while not loop.done():
        loop.step()
    return loop.trajectory()
