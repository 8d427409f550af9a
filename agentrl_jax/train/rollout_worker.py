"""The rollout side of asynchronous RL: versioned weights, the switch schedule, and an agent-loop
driver that switches weights mid-rollout and overlaps environment steps with the model.

* :class:`WeightStore`: the policy versions the rollout side may sample from. Version ``v`` is
  the parameters after ``v`` updates; the learner publishes each one as a device-side copy
  (``jnp.copy``, no host round trip), so the update may donate its own state while rollouts
  read the copy. The rollout side blocks on a version it needs and nothing else.
* :class:`VersionSchedule`: which version batch ``b``'s rollouts use: ``max(0, b - k)`` at the
  start, one closer to ``b`` every ``sync_every_rounds`` agent-loop rounds. Switch points are
  counted in rounds of the rollout itself, never timed: the tokens a run samples do not depend
  on how fast the learner is, so runs repeat and resume bitwise.
* :class:`VersionedLoop`: plays one :class:`~agentrl_jax.rollout.agent_loop.AgentLoop` through
  its phase methods. A round admits, prefills and decodes; the environment step of a turn that
  ended is submitted to an executor at once and the slot waits while the others decode. The
  observations are recorded, all pending ones together in submission order, when
  ``resolve_at`` calls are pending or when no slot has anything left to decode: a rule on the
  rollout's own progress, so tool calls run concurrently with each other and with the model,
  and what is recorded when does not depend on how long they take. At a switch point the new
  weights are set and the episodes in flight continue, are re-prefilled under them, or
  restart (``RLConfig.partial_rollout``); each sampled token's version is recorded
  (``Trajectory.policy_versions``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.rl.state import PARTIAL_ROLLOUTS
from agentrl_jax.rollout.agent_loop import AgentLoop
from agentrl_jax.rollout.loop_state import EpisodeSlot
from agentrl_jax.rollout.trajectory import Trajectory


class StoreClosed(RuntimeError):
    """The weight store was closed while the rollout side waited for a version."""


def device_copy(params):
    """A copy of ``params`` in new device buffers (the learner's may be donated)."""
    return jax.tree.map(jnp.copy, params)


class WeightStore:
    """Policy versions for the rollout side (thread-safe).

    Args:
      place: puts a published version where the rollout runs (default :func:`device_copy`;
        e.g. ``lambda p: jax.device_put(p, rollout_sharding)`` for another device set, a
        device-to-device transfer). It must return new buffers: the learner donates its own.
    """

    def __init__(self, place: Callable[[Any], Any] | None = None):
        self._place = place or device_copy
        self._cond = threading.Condition()
        self._versions: dict[int, tuple[Any, Any]] = {}
        self._closed = False

    def publish(self, version: int, params, policy) -> None:
        """Makes ``params`` (sampled under dtype policy ``policy``) version ``version``."""
        placed = self._place(params)
        with self._cond:
            self._versions[int(version)] = (placed, policy)
            self._cond.notify_all()

    def get(self, version: int) -> tuple[Any, Any, float]:
        """``(params, policy, seconds waited)`` of ``version``, waiting until it is published.

        Raises:
          StoreClosed: the store was closed (the run is stopping).
          KeyError: ``version`` was dropped.
        """
        t0 = time.perf_counter()
        with self._cond:
            while version not in self._versions:
                if self._closed:
                    raise StoreClosed(f"weight store closed while waiting for version {version}")
                if self._versions and version < min(self._versions):
                    raise KeyError(f"version {version} was dropped (oldest {min(self._versions)})")
                self._cond.wait()
            params, policy = self._versions[version]
        return params, policy, time.perf_counter() - t0

    def drop_below(self, version: int) -> None:
        """Forgets the versions older than ``version`` (no batch to come needs them)."""
        with self._cond:
            for v in [v for v in self._versions if v < version]:
                del self._versions[v]

    def versions(self) -> list[int]:
        """The versions held, ascending."""
        with self._cond:
            return sorted(self._versions)

    def close(self) -> None:
        """Wakes every waiter with :class:`StoreClosed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclasses.dataclass(frozen=True)
class VersionSchedule:
    """Which policy version batch ``b``'s rollouts use (module docstring).

    Attributes:
      max_staleness: k; batch ``b`` starts under version ``max(0, b - k)`` (>= 0).
      sync_every_rounds: rounds between moves one version closer to ``b`` (0: never).
    """

    max_staleness: int
    sync_every_rounds: int = 0

    def __post_init__(self):
        for name in ("max_staleness", "sync_every_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"VersionSchedule.{name}={getattr(self, name)} must be >= 0")

    def start(self, batch: int) -> int:
        """The version batch ``batch``'s rollouts start with."""
        return max(0, batch - self.max_staleness)

    def target(self, batch: int, rounds: int) -> int:
        """The version due after ``rounds`` rounds of batch ``batch``'s rollouts."""
        if not self.sync_every_rounds:
            return self.start(batch)
        return min(batch, self.start(batch) + rounds // self.sync_every_rounds)


@dataclasses.dataclass
class BatchClock:
    """One batch's rollout progress and weights: rounds played, the version in use, the waits.

    Args:
      store: the weight store.
      schedule: the version schedule.
      batch: the batch index.

    Attributes:
      rounds: agent-loop rounds played for this batch (over all its rollouts).
      version, params, policy: the weights in use.
      wait_s: seconds spent waiting for versions.
      switches: mid-batch weight switches; aborted / reprefilled: episodes restarted /
        prefilled again at a switch; discarded_tokens: sampled tokens the aborts threw away.
    """

    store: WeightStore
    schedule: VersionSchedule
    batch: int
    rounds: int = 0
    version: int = -1
    params: Any = None
    policy: Any = None
    wait_s: float = 0.0
    switches: int = 0
    aborted: int = 0
    reprefilled: int = 0
    discarded_tokens: int = 0

    def __post_init__(self):
        self.version = self.schedule.start(self.batch)
        self.params, self.policy, self.wait_s = self.store.get(self.version)

    def due(self) -> bool:
        """Whether the schedule asks for a newer version after the rounds played."""
        return self.schedule.target(self.batch, self.rounds) > self.version

    def move(self) -> None:
        """Takes the version then due, waiting until the learner has published it."""
        due = self.schedule.target(self.batch, self.rounds)
        self.params, self.policy, waited = self.store.get(due)
        self.version, self.wait_s = due, self.wait_s + waited
        self.switches += 1


class VersionedLoop:
    """Plays every task of ``loop`` under ``clock``'s weights (module docstring).

    Args:
      loop: a fresh ``AgentLoop`` built with ``clock.params``.
      clock: the batch's clock (counts the rounds; holds the weights).
      mode: ``"continue"``, ``"reprefill"`` or ``"abort"`` (``RLConfig.partial_rollout``).
      executor: runs ``env.step`` calls while the model decodes (None: each call runs when
        submitted; its observation is still recorded by the rule below).
      resolve_at: pending calls at which the observations are recorded (>= 1; also when no
        slot can decode); the executor's worker count keeps every worker busy.

    Raises:
      ValueError: an unknown ``mode`` or ``resolve_at`` < 1.
    """

    def __init__(
        self,
        loop: AgentLoop,
        clock: BatchClock,
        mode: str,
        executor: Executor | None = None,
        resolve_at: int = 1,
    ):
        if mode not in PARTIAL_ROLLOUTS:
            raise ValueError(f"mode={mode!r} must be one of {PARTIAL_ROLLOUTS}")
        if resolve_at < 1:
            raise ValueError(f"resolve_at={resolve_at} must be >= 1")
        self.loop, self.clock, self.mode, self.executor = loop, clock, mode, executor
        self.resolve_at = resolve_at
        # per task: (sampled tokens before the switch, version from there on)
        self.bounds = [[(0, clock.version)] for _ in loop.tasks]
        self.pending: list[tuple[int, list[int], Future]] = []

    def run(self) -> Trajectory:
        """Plays until every task is done; returns the trajectory with ``policy_versions``."""
        while not self.loop.done():
            self.round()
            self.clock.rounds += 1
            # a rollout with nothing left to sample does not wait for newer weights
            if not self.loop.done() and self.clock.due():
                self.clock.move()
                self.switch()
        traj = self.loop.trajectory()
        return traj.replace(policy_versions=self.token_versions(traj.length))

    def round(self) -> None:
        """Admit, prefill, decode (the submitted environment steps run meanwhile); submit the
        steps of the turns that ended; record the observations when ``resolve_at`` steps are
        pending or no slot had anything to decode."""
        loop, st = self.loop, self.loop.state
        loop.admit()
        loop.prefill()
        ended = loop.decode()  # None: every episode in play waits for an observation
        for s in ended or ():
            action = loop.close_turn(s)
            if loop.room(s) > 0:
                self.pending.append((s, action, self.submit(st.slots[s].env, action)))
            else:  # no room for an observation
                st.finish(s, truncated=True)
        if ended is None or len(self.pending) >= self.resolve_at:
            self.resolve()
        st.trim()

    def submit(self, env, action: list[int]) -> Future:
        if self.executor is not None:
            return self.executor.submit(env.step, action)
        done: Future = Future()
        done.set_result(env.step(action))
        return done

    def resolve(self) -> None:
        """Records the observations of the submitted steps, in submission order."""
        pending, self.pending = self.pending, []
        for s, action, future in pending:
            obs, res = future.result()
            self.loop.record_step(s, action, obs, res)

    # weight switches ---------------------------------------------------------------------------
    def live(self) -> dict[int, int]:
        """Episodes not finished: task index -> tokens sampled so far."""
        st = self.loop.state
        out = {}
        for item in [*st.slots, *st.queue]:
            if isinstance(item, EpisodeSlot):
                out[item.rec.task_index] = sum(item.rec.action) + len(item.turn_toks)
            elif item is not None:  # a task not started
                out[int(item)] = 0
        return out

    def switch(self) -> None:
        """Sets the clock's new weights; episodes in flight go on as ``mode`` says."""
        if self.mode != "continue":  # every episode at a turn boundary or mid-turn, none waiting
            self.resolve()
        live = self.live()
        for i, n in live.items():
            self.bounds[i].append((n, self.clock.version))
        self.loop.set_params(self.clock.params)
        st = self.loop.state
        busy = [s for s, sl in enumerate(st.slots) if sl is not None]
        if self.mode == "reprefill":
            for s in reversed(busy):  # to the queue's front, in slot order
                st.preempt(s)
            self.clock.reprefilled += len(busy)
        elif self.mode == "abort":
            self.abort(busy, live)

    def abort(self, busy: list[int], live: dict[int, int]) -> None:
        """Restarts the episodes in ``busy`` slots and the preempted ones from their prompts;
        their turns stay in the logs, marked ``aborted``."""
        st = self.loop.state
        restart = []
        for s in busy:
            restart.append(st.slots[s].rec.task_index)
            st.slots[s] = None
            if st.pool is not None:
                st.pool.release(s)
        rest = []
        for item in st.queue:
            if isinstance(item, EpisodeSlot):
                restart.append(item.rec.task_index)
            else:
                rest.append(item)
        restart.sort()
        st.queue = collections.deque([*restart, *rest])
        for i in restart:
            self.bounds[i] = [(0, self.clock.version)]
            self.clock.discarded_tokens += live[i]
        uids = set(restart)
        for row in st.logs:
            if row.get("episode") in uids and "aborted" not in row:
                row["aborted"] = True
        self.clock.aborted += len(restart)

    def token_versions(self, length: int) -> np.ndarray:
        """int32 [B, length]: each action token's version, -1 elsewhere (rows in task order)."""
        recs = [r for r in self.loop.state.records if r is not None]  # as trajectory() stacks
        out = np.full((len(recs), length), -1, np.int32)
        for i, rec in enumerate(recs):
            pos = np.flatnonzero(np.asarray(rec.action, bool))
            bounds = self.bounds[rec.task_index]
            counts, versions = (np.asarray(x) for x in zip(*bounds, strict=True))
            at = np.searchsorted(counts, np.arange(len(pos)), side="right") - 1
            out[i, pos] = versions[at]
        return out
