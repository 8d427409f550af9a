"""Asynchronous RL: the rollouts of later batches overlap the update of earlier ones
(``rl.max_staleness`` k > 0).

Two threads share one :class:`~agentrl_jax.train.rl_loop.RLRun`:

* the **rollout side** (a producer thread) owns the task pipeline. For batch ``b = 0, 1, ...``
  it waits for policy version ``max(0, b - k)`` (version ``v``: the parameters after ``v``
  updates), collects the batch exactly as the synchronous loop does (refill rounds, guidance,
  rollout keys ``fold_in(rollout_key, b)``), switching weights mid-batch every
  ``rl.sync_every_rounds`` rounds (``train/rollout_worker.py``), and queues the finished batch
  with the pipeline state after it;
* the **learner** (the caller's thread, :meth:`AsyncDriver.step`) takes batch ``s``, scores it,
  updates, and publishes version ``s + 1`` (a device-side copy: the next update donates the
  state). It waits only for the batch it trains on; the rollout side waits only for the
  version a batch needs. At most k batches wait in the queue.

Every token the update of step ``s`` trains on was sampled by a version in ``[s - k, s]``; the
batch records which (``policy_versions``) and the loss corrects for it per token through the
rollout logprobs (``rl/losses.py``). Where weights switch is fixed by batch index and round
count, never by timing, so what a run computes does not depend on thread scheduling.

Exact resume: a checkpoint after ``s`` steps holds, besides the learner state, the pipeline
state at the start of batch ``s`` and the k older versions ``s - k .. s - 1`` (saved as
``extra`` arrays; duplicates of version 0 early on). Batches rolled out but not trained on yet
are not stored: the resumed rollout side replays them from those versions, the pipeline state
and the rollout keys, bitwise (environments are deterministic given their actions; a sandbox
time limit hit under load is the exception).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rollout.agent_loop import AgentLoop
from agentrl_jax.rollout.loop_state import LoopOptions
from agentrl_jax.train.rollout_worker import (
    BatchClock,
    StoreClosed,
    VersionedLoop,
    VersionSchedule,
    WeightStore,
)

log = logging.getLogger(__name__)


class AsyncDriver:
    """The rollout side and the learner step of an asynchronous run (module docstring).

    Args:
      run: the ``RLRun`` (its learner state restored when resuming).
      versions: older versions restored from a checkpoint, ``{v: (params, policy)}``; None
        for a new run. The current parameters are version ``run.start_step``.
    """

    def __init__(self, run, versions: dict | None = None):
        self.run = run
        rl = run.rl_cfg
        self.k = rl.max_staleness
        self.schedule = VersionSchedule(rl.max_staleness, rl.sync_every_rounds)
        self.store = WeightStore()
        for v, (params, policy) in sorted((versions or {}).items()):
            self.store.publish(v, params, policy)
        self.store.publish(run.start_step, run.state.params, run.controller.active)
        self._data_state = run.pipeline.state()  # at the start of the next batch to train on
        self._cond = threading.Condition()
        self._ready: dict[int, object] = {}
        self._error: BaseException | None = None
        self._executor = ThreadPoolExecutor(run.loop.env_workers, thread_name_prefix="env")
        self._thread = threading.Thread(target=self._produce, name="rollout", daemon=True)

    # learner -----------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """Trains on batch ``step`` (waiting for it), publishes version ``step + 1``; returns
        the step's metrics (the synchronous loop's plus ``async/*``)."""
        run = self.run
        if not self._thread.ident:
            self._thread.start()
        t0 = time.perf_counter()
        c = self._take(step)
        waited = time.perf_counter() - t0
        self._data_state = c.extras["data_state"]
        with run.placement.host_context():  # as the synchronous loop scores (thread-local)
            run.log_tasks(step, c)
            batch = run.score(c.batch)
            guided = np.asarray(batch["guided"], bool)
            if guided.any():  # scored under the current parameters
                mask = batch["action_mask"][guided]
                batch["policy_versions"][guided] = np.where(mask, step, -1)
            sources = run.mismatch_sources(batch, step, self._version_params)
        t1 = time.perf_counter()
        metrics = run.update(batch)
        self.store.publish(step + 1, run.state.params, run.controller.active)
        self.store.drop_below(step + 1 - self.k)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out = run.metrics(metrics, c, batch, time.perf_counter() - t1)
        out.update(sources)
        out.update(self._metrics(step, batch, c, waited))
        return out

    def _version_params(self, v: int):
        params, policy, _ = self.store.get(v)
        return params, policy

    def _metrics(self, step: int, batch, c, waited: float) -> dict[str, float]:
        """``async/*``: the batch's lag behind the current version (mean and max over action
        tokens), its episodes sampled by more than one version, the waits and the rollout
        side's switches, aborts and re-prefills."""
        versions, mask = batch["policy_versions"], batch["action_mask"]
        lag = step - versions[mask]
        mixed = [len(np.unique(v[m])) > 1 for v, m in zip(versions, mask, strict=True)]
        x = c.extras
        return {
            "async/lag_mean": float(lag.mean()) if lag.size else 0.0,
            "async/lag_max": float(lag.max()) if lag.size else 0.0,
            "async/mixed_version_episodes": float(np.mean(mixed)),
            "async/learner_wait_s": waited,
            "async/rollout_wait_s": x["wait_s"],
            "async/weight_switches": float(x["switches"]),
            "async/aborted_episodes": float(x["aborted"]),
            "async/discarded_tokens": float(x["discarded_tokens"]),
            "async/reprefilled_episodes": float(x["reprefilled"]),
        }

    def _take(self, step: int):
        if not self.run.start_step <= step < self.run.loop.rl_steps:
            raise ValueError(
                f"step={step} is outside this run's steps [{self.run.start_step}, "
                f"train.rl_steps={self.run.loop.rl_steps})"
            )
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError("the rollout side failed") from self._error
                self._cond.wait()
            return self._ready.pop(step)

    # checkpoints -------------------------------------------------------------------------------
    def data_state(self) -> dict:
        """The task pipeline's state at the start of the next batch to train on."""
        return self._data_state

    def checkpoint_versions(self, step: int) -> tuple[list, dict]:
        """``(params of versions step-k .. step-1, meta)`` for checkpoint ``step`` (k entries,
        version 0 repeated while ``step < k``); meta names each entry's version and policy."""
        wanted = [max(0, step - self.k + i) for i in range(self.k)]
        got = [self.store.get(v) for v in wanted]
        meta = {"versions": wanted, "policies": [policy.name for _, policy, _ in got]}
        return [params for params, _, _ in got], meta

    def close(self) -> None:
        """Stops the rollout side (it is waiting or finishing a batch) and its env threads."""
        self.store.close()
        with self._cond:
            self._error = self._error or StoreClosed("closed")
            self._cond.notify_all()
        if self._thread.ident:
            self._thread.join()
        self._executor.shutdown(wait=True)

    # rollout side ------------------------------------------------------------------------------
    def _produce(self) -> None:
        run = self.run
        try:
            # the run's mesh on this thread too (the mesh context is thread-local): the sampler's
            # KV cache is sharded as in the synchronous loop (rollout/cache_sharding.py)
            with run.placement.host_context():
                self._produce_batches()
        except StoreClosed:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the learner, which raises it
            log.exception("the rollout side failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _produce_batches(self) -> None:
        run = self.run
        for b in range(run.start_step, run.loop.rl_steps):
            clock = BatchClock(self.store, self.schedule, b)
            c = run.collect(b, play=functools.partial(self._play, clock, b))
            c.extras = {
                "data_state": run.pipeline.state(),
                "wait_s": clock.wait_s,
                "switches": clock.switches,
                "aborted": clock.aborted,
                "discarded_tokens": clock.discarded_tokens,
                "reprefilled": clock.reprefilled,
                "rounds": clock.rounds,
            }
            with self._cond:
                self._ready[b] = c
                self._cond.notify_all()

    def _play(self, clock: BatchClock, batch: int, tasks: list, k: int, key, greedy):
        """``k`` episodes per task under the clock's weights (the ``play`` of ``RLRun.collect``
        for batch ``batch``), logged as rows of metrics step ``batch + 1``."""
        run = self.run
        opts = run.episode_options(tasks, k, greedy)
        group_ids, greedy_flags = opts.pop("group_ids"), opts.pop("greedy")
        loop = AgentLoop(
            Transformer(run.model_cfg, clock.policy),
            clock.params,
            [t for t in tasks for _ in range(k)],
            lambda: run.env.env(run.tokenizer),
            run.tokenizer,
            run.sampling,
            key,
            LoopOptions(**opts),
            group_ids=group_ids,
            greedy=greedy_flags,
        )
        workers = run.loop.env_workers
        mode = run.rl_cfg.partial_rollout
        traj = VersionedLoop(loop, clock, mode, self._executor, resolve_at=workers).run()
        run.account(traj, batch + 1)
        return traj
