"""The RL loop: one iteration reads collect -> score -> advantages -> update -> metrics.

``RLRun(cfg, sections, run_dir, params, resume=...)`` holds one run's host-side state (the task
pipeline, the sampler's environment, the learner state and its checkpointer); ``RLRun.step(s)``
is one iteration:

  1. ``collect``: the task pipeline draws groups (difficulty band, bug-type balance, refill
     rounds); each round's tasks are played by the current policy (``rollout.agent_loop``), all
     groups of a round in one batched rollout; optional guidance replaces the first member of
     all-failed groups (``train/guidance.py``); the kept groups become the batch;
  2. ``score``: teacher-forced passes the batch needs: an expert episode's logprobs under the
     current policy, attention mass (``rl.advantage="attn_credit"``), the critic's values
     (``train/critic.py``), the reference policy's logprobs (``train/reference.py``);
  3. advantages: the registered estimator (``rl.advantages``) on the batch's credit inputs;
  4. ``update``: one jitted update (``rl.update``) behind the precision-fallback controller;
  5. ``metrics``: reward, success, entropy, mismatch, throughput, KV bytes, memory.

The main job around it (SFT, evaluations, checkpoints, the summary) is ``train/main.py``. Every
step ``s`` is a pure function of the checkpointed state: rollout keys are
``fold_in(fold_in(key(seed), 1), s)`` and the update key is ``state.rng`` folded with ``s``.
With ``rl.max_staleness`` > 0 the rollouts run ahead of the update on another thread
(``train/async_rl.py``); ``step`` then trains on a batch rolled out earlier.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.metrics import JsonlWriter, memory_metrics
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.advantages import get_advantage
from agentrl_jax.rl.attention_credit import attention_credit_mass
from agentrl_jax.rl.credit import CreditInputs
from agentrl_jax.rl.fallback import FallbackController
from agentrl_jax.rl.state import rl_optimizer
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.trajectory import Rows, concat_rows, history_state_ids, select_rows
from agentrl_jax.train import critic, reference
from agentrl_jax.train.async_rl import AsyncDriver
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir
from agentrl_jax.train.guidance import Guidance, PlayFn
from agentrl_jax.train.loop_config import TrainConfig  # noqa: F401 - the section's home name
from agentrl_jax.train.mismatch_sources import SourcePasses
from agentrl_jax.train.placement import Placement, play_sharded

log = logging.getLogger(__name__)

TOOL_CALLS_FILE = "tool_calls.jsonl"
HACK_SUSPECTS_FILE = "hack_suspects.jsonl"
TASKS_FILE = "tasks.jsonl"
TASK_KEYS = ("seed", "difficulty", "bug_types", "split")  # a task's identity in tasks.jsonl

# batch fields the update reads (when present)
UPDATE_KEYS = (
    "tokens",
    "valid",
    "action_mask",
    "advantages",
    "rollout_logprobs",
    "routes",
    "kv_evict_at",
    "kv_int8_at",
    "sparse_blocks",
    "value_targets",
    "old_values",
)


@dataclasses.dataclass
class Collected:
    """What one step's rollouts produced (host side).

    Attributes:
      store: every rolled-out group's rows (sampled episodes), in rollout order.
      batch: the update batch's rows: the kept groups (with guides' episodes where guidance
        replaced a member), topped up with all-equal groups to ``data.batch_size`` groups,
        padded to ``rollout.max_len``; ``group_ids`` renumbered 0..G-1.
      data_metrics: the task pipeline's metrics of the step.
      calls, rejected_calls: model turns, and turns answered by an error.
      hack_suspect_calls: turns whose code the environment flagged as a suspected reward hack
        (``StepResult.log["hack_suspect"]``).
      seconds: wall time of the rollouts.
      specs: the task of every rolled-out group (``TASK_KEYS``), in rollout order.
      used: the ``store`` index of each update-batch group.
      extras: what the asynchronous rollout side adds: the pipeline state after this batch
        (``data_state``) and the batch's rollout counters (``train/async_rl.py``).
    """

    store: list[Rows]
    batch: Rows
    data_metrics: dict[str, float]
    calls: int
    rejected_calls: int
    seconds: float
    specs: list[dict] = dataclasses.field(default_factory=list)
    used: list[int] = dataclasses.field(default_factory=list)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    hack_suspect_calls: int = 0


class RLRun:
    """Host-side state of one RL run; ``step(s)`` runs one iteration (module docstring).

    Args:
      sections: the experiment's built sections (``experiment.build``).
      run_dir: the run directory (tool-call log, ``checkpoints/rl``).
      params: the parameters RL starts from (copied: the update donates its state).
      seed: the run's seed (rollout keys, the learner's PRNG key).
      resume: continue from the newest intact RL checkpoint in ``run_dir`` if there is one
        (newer unusable ones are set aside: ``Checkpointer.restore``).
      attempt: the process's attempt at the run (``train/runs.py``), written into every
        ``tool_calls.jsonl`` and ``tasks.jsonl`` row.
      placement: the run's mesh (``train/placement.py``; default: the default device).

    With ``rl.max_staleness`` > 0 or ``train.overlap_env``, ``driver`` is the asynchronous
    rollout side (``train/async_rl.py``), started by the first ``step``; :meth:`close` stops it.

    Raises:
      ValueError: ``resume`` and no RL checkpoint of the run is intact, or the checkpoint does
        not fit the config.
    """

    def __init__(
        self,
        sections,
        run_dir: str,
        params,
        *,
        seed: int,
        resume: bool,
        attempt: int = 1,
        placement: Placement | None = None,
    ):
        from agentrl_jax.data.pipeline import TaskPipeline

        s = self.sections = sections
        self.run_dir = run_dir
        self.loop, self.rl_cfg, self.data_cfg = s.train, s.rl, s.data
        self.sampling, self.model_cfg, self.policy, self.env = s.rollout, s.model, s.policy, s.env
        self.tokenizer = s.env.tokenizer()
        self.pipeline = TaskPipeline(s.data, "train", task_factory=s.env.task_factory())
        advantage = get_advantage(s.rl.advantage)
        kwargs = s.rl.advantage_kwargs
        self.advantage_fn = jax.jit(lambda inputs: advantage(inputs, **kwargs))
        self.batch_size = s.data.batch_size * s.data.group_size
        self.placement = placement or Placement.default_device(s.model, s.policy)  # mesh hook
        asynchronous = s.rl.max_staleness > 0 or s.train.overlap_env
        if asynchronous and self.placement.multi_process:
            raise ValueError(
                "rl.max_staleness > 0 and train.overlap_env run on one process; this run has "
                f"{jax.process_count()} processes (set rl.max_staleness=0 and "
                "train.overlap_env=False; docs/async.md, 'Under a mesh')"
            )
        tx = rl_optimizer(s.rl, s.model.frozen_groups)
        shard = self.placement.step_shardings(tx, self.batch_size)
        self.controller = FallbackController(
            lambda p: make_update_fn(Transformer(s.model, p), s.rl, p, s.rollout, shard),
            s.rl,
            s.policy,
        )
        self.ckpt = Checkpointer(stage_dir(run_dir, "rl"), resume=resume, max_to_keep=2)
        key = jax.random.key(seed)
        self.rollout_key = jax.random.fold_in(key, 1)
        self.state = self.placement.init_state(
            jax.tree.map(jnp.copy, params), s.rl, jax.random.fold_in(key, 2), tx
        )
        # KL to the reference policy (loss.kl_coef > 0): the parameters RL started from (the SFT
        # checkpoint), frozen; their teacher-forced logprobs of each batch go in as ref_logprobs.
        self.ref_params = params if s.rl.loss.kl_coef > 0 else None
        self._logprobs = reference.make_logprobs_fn(s.model, s.rollout)
        self._attn_mass = jax.jit(self._attention_mass, static_argnums=0)
        self._values = critic.make_values_fn(s.model, s.rollout)
        self._value_targets = critic.make_targets_fn(kwargs)
        self.start_step = 0
        self.attempt = attempt
        self._log_step = 0  # the metrics step of the iteration running (tool-call rows)
        self._sources = SourcePasses(s.model, s.rollout, s.rl) if s.rl.mismatch_sources else None
        self.driver = None  # the asynchronous rollout side (rl.max_staleness > 0)
        versions = None
        if resume and self.ckpt.latest_step() is not None:
            versions = self._restore()
            self.state = self.placement.place_state(self.state, tx)
        if asynchronous:
            self.driver = AsyncDriver(self, versions)
        # the synchronous loop steps a round's environments at once on a pool (same results:
        # each environment steps alone and the results come back in order)
        workers = 0 if asynchronous else s.train.env_workers
        self._env_pool = ThreadPoolExecutor(workers, "env") if workers > 1 else None

    # checkpoints -------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Writes RL checkpoint ``step``: the learner state, the task pipeline, the fallback; with
        ``rl.max_staleness`` > 0 also the older policy versions the batches to come start from
        (their rollouts are replayed from these, the pipeline state and the rollout keys)."""
        s, c = self.state, self.controller
        meta = {
            "data": self.pipeline.state() if self.driver is None else self.driver.data_state(),
            "nonfinite_count": int(s.nonfinite_count),
            "consecutive_nonfinite": int(s.consecutive_nonfinite),
            "train_step": int(s.step),
            "fallback": {
                "active": c.active.name,
                "consecutive": c.consecutive,
                "remaining": c.remaining,
                "calls": c.calls,
            },
        }
        extra = None
        if self.driver is not None:
            extra, meta["async"] = self.driver.checkpoint_versions(step)
            extra = extra or None  # k = 0: no older version
        self.ckpt.save(
            step, params=s.params, opt_state=s.opt_state, rng=s.rng, meta=meta, extra=extra
        )

    def _restore(self) -> dict | None:
        """Restores the newest intact checkpoint; returns the older policy versions it holds
        (``{version: (params, policy)}``, asynchronous runs) or None."""
        k = self.rl_cfg.max_staleness
        out = self.ckpt.restore(
            params=self.state.params,
            opt_state=self.state.opt_state,
            set_aside=True,
            extra=[self.state.params] * k if k else None,
        )
        meta = out["meta"]
        self.pipeline.restore(meta["data"])
        i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
        self.state = self.state._replace(
            step=i32(meta["train_step"]),
            params=out["params"],
            opt_state=out["opt_state"],
            rng=out["rng"],
            nonfinite_count=i32(meta["nonfinite_count"]),
            consecutive_nonfinite=i32(meta["consecutive_nonfinite"]),
        )
        fb = meta["fallback"]
        c = self.controller
        c.active = c.fallback if fb["active"] != c.primary.name else c.primary
        c.consecutive, c.remaining, c.calls = fb["consecutive"], fb["remaining"], fb["calls"]
        self.start_step = out["step"]
        log.info("resumed RL from step %d of %s", self.start_step, self.run_dir)
        if not k:
            return None
        saved = meta["async"]
        return {
            int(v): (params, get_policy(name))
            for v, name, params in zip(saved["versions"], saved["policies"], out["extra"])
        }

    def close(self) -> None:
        """Stops the asynchronous rollout side (if any) and closes the checkpointer."""
        if self.driver is not None:
            self.driver.close()
        if self._env_pool is not None:
            self._env_pool.shutdown(wait=True)
        self.ckpt.close()

    # one iteration -----------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One RL iteration (module docstring); returns its metrics."""
        if self.driver is not None:
            return self.driver.step(step)
        self._log_step = step + 1
        with self.placement.host_context():
            collected = self.collect(step)
            self.log_tasks(step, collected)
            batch = self.score(collected.batch)
            sources = self.mismatch_sources(batch, step, lambda v: None)
        t1 = time.perf_counter()
        metrics = self.update(batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        return self.metrics(metrics, collected, batch, time.perf_counter() - t1) | sources

    def update(self, batch: Rows) -> dict[str, jax.Array]:
        """The update on a scored batch (behind the precision fallback); returns its metrics."""
        update_in = self.placement.place_batch(update_batch(batch))
        self.state, metrics = self.controller(self.state, update_in, None)
        return metrics

    def collect(self, step: int, play: PlayFn | None = None) -> Collected:
        """Plays the step's task groups (refill rounds included) and assembles the batch;
        ``play`` plays episodes (default :meth:`play`, the current parameters)."""
        play = play or self.play
        t0 = time.perf_counter()
        store: list[Rows] = []
        specs: list[dict] = []
        self._calls = [0, 0]
        self._suspect_calls = 0
        self._kv_peak = 0  # largest per-episode KV bytes on the live pools this step
        guidance = Guidance(
            self.loop, self.env, self.tokenizer, self.sampling.max_len, self.batch_size, play
        )
        rounds = [0]

        def rollout_round(items):
            key = jax.random.fold_in(jax.random.fold_in(self.rollout_key, step), rounds[0])
            rounds[0] += 1
            specs.extend({k: it[k] for k in TASK_KEYS if k in it} for it in items)
            return self._round(items, key, store, guidance, play, step)

        kept, data_metrics = self.pipeline.collect(rollout_round)
        used = [g["rows"] for g in kept]
        # Keep the update's shape fixed: top up a short batch with all-equal groups (their
        # group-baselined advantages are zero, so they add no gradient).
        for i in range(len(store)):
            if len(used) >= self.data_cfg.batch_size:
                break
            if i not in used:
                used.append(i)
        parts = [guidance.replaced.get(i, store[i]) for i in used]
        for j, p in enumerate(parts):
            p["group_ids"] = np.full_like(p["group_ids"], j)
        batch = concat_rows(parts, self.sampling.max_len)
        return Collected(
            store,
            batch,
            data_metrics,
            *self._calls,
            seconds=time.perf_counter() - t0,
            specs=specs,
            used=used,
            hack_suspect_calls=self._suspect_calls,
        )

    def log_tasks(self, step: int, c: Collected) -> None:
        """Appends the step's tasks to ``tasks.jsonl``: every group rolled out (``drawn``, in
        rollout order) and the ones the update used (``used``: indices into ``drawn``)."""
        if not self.placement.primary:
            return
        row = {"step": step + 1, "attempt": self.attempt, "drawn": c.specs, "used": c.used}
        with JsonlWriter(os.path.join(self.run_dir, TASKS_FILE)) as f:
            f.write(row)

    def mismatch_sources(self, batch: Rows, step: int, version_params) -> dict[str, float]:
        """``mismatch_src/*`` of the batch (``rl.mismatch_sources``; else empty): the policy
        version ``step``'s parameters are the current ones, ``version_params(v)`` gives an
        older version's ``(params, policy)``."""
        if self._sources is None:
            return {}
        current = (self.state.params, self.controller.active)
        return self._sources(batch, step, current, version_params)

    def _round(
        self, items: list[dict], key, store: list[Rows], guidance: Guidance, play, step: int
    ) -> list[dict]:
        """One rollout round: ``group_size`` episodes per task (the last one greedy with
        ``train.greedy_member``); returns the pipeline's group records."""
        g = self.data_cfg.group_size
        greedy = (np.arange(g) == g - 1) & self.loop.greedy_member  # per group member
        tasks = [it["task"] for it in items]
        traj = play(tasks, g, key, np.tile(greedy, len(items)))
        groups = []
        for i in range(len(items)):
            rows = select_rows(traj, np.arange(i * g, (i + 1) * g))
            if "policy_versions" not in rows:  # sampled by the parameters of version ``step``
                rows["policy_versions"] = np.where(rows["action_mask"], step, -1).astype(np.int32)
            rows["greedy"] = greedy
            rows["guided"] = np.zeros(g, bool)
            store.append(rows)
            groups.append(
                {
                    "rewards": [float(r) for r in rows["outcome_reward"]],  # with a guide's
                    "success": [bool(s) for s in rows["success"]],  # sampled: the estimates
                    "rows": len(store) - 1,
                }
            )
        guidance.apply(tasks, groups, store, jax.random.fold_in(key, 1))
        return groups

    def episode_options(self, tasks: list, k: int, greedy: np.ndarray) -> dict[str, Any]:
        """The agent-loop arguments of ``k`` episodes per task (besides model, params, tasks,
        environment, sampling and key): slots, turn limit, process weights, groups, greedy."""
        return dict(
            # One slot count for every call: fewer tasks (a refill round, a guide batch) leave
            # slots idle instead of compiling the sampler for another batch shape.
            n_slots=self.batch_size,
            max_turns=self.loop.max_turns,
            process_weights=self.loop.process_weights,
            group_ids=[i for i in range(len(tasks)) for _ in range(k)],
            greedy=[bool(x) for x in greedy],
        )

    def play(self, tasks: list, k: int, key, greedy: np.ndarray):
        """``k`` episodes of the current policy per task (group ``i`` = task ``i``), counted in
        the rejected-call rate and logged to ``tool_calls.jsonl`` (with step and attempt). With
        several processes each plays its block of the episodes (``placement.play_sharded``)."""
        episodes = [t for t in tasks for _ in range(k)]
        opts = self.episode_options(tasks, k, greedy)

        def play_block(lo: int, hi: int):
            return run_episodes(
                Transformer(self.model_cfg, self.controller.active),
                self.placement.host_params(self.state.params),
                episodes[lo:hi],
                lambda: self.env.env(self.tokenizer),
                self.tokenizer,
                self.sampling,
                key,
                **{**opts, "group_ids": opts["group_ids"][lo:hi], "greedy": opts["greedy"][lo:hi]},
                first_uid=lo,
                env_executor=self._env_pool,
            )

        traj = play_sharded(play_block, len(episodes))
        self.account(traj, self._log_step)
        return traj

    def account(self, traj, log_step: int) -> None:
        """Counts ``traj``'s calls, rejected calls and suspected hacks and logs them to
        ``tool_calls.jsonl`` as rows of metrics step ``log_step``; every episode with a suspected
        hack goes whole to ``hack_suspects.jsonl`` (process 0 writes)."""
        if self.loop.log_tool_calls and self.placement.primary:
            with JsonlWriter(os.path.join(self.run_dir, TOOL_CALLS_FILE)) as f:
                for row in traj.logs:
                    f.write({"step": log_step, "attempt": self.attempt, **row})
        flagged = {r["episode"] for r in traj.logs if r.get("hack_suspect")}
        self._suspect_calls += sum(bool(r.get("hack_suspect")) for r in traj.logs)
        if flagged and self.placement.primary:
            with JsonlWriter(os.path.join(self.run_dir, HACK_SUSPECTS_FILE)) as f:
                for uid in sorted(flagged):
                    turns = [r for r in traj.logs if r["episode"] == uid]
                    reasons = sorted({x for r in turns for x in r.get("hack_suspect", ())})
                    f.write(
                        {"step": log_step, "attempt": self.attempt, "episode": uid}
                        | {"reasons": reasons, "turns": turns}
                    )
        self._calls[0] += len(traj.logs)
        self._kv_peak = max([self._kv_peak, *(r["kv_bytes"] for r in traj.logs)])
        self._calls[1] += sum(bool(r.get("error")) for r in traj.logs)

    def score(self, batch: Rows) -> Rows:
        """The batch with ``advantages`` (and the critic's ``old_values`` / ``value_targets``,
        the reference's ``ref_logprobs``, guides' logprobs) filled in by teacher-forced passes
        of the current (or reference) parameters."""
        policy, params = self.controller.active, self.placement.host_params(self.state.params)
        dev = {k: jnp.asarray(batch[k]) for k in ("tokens", "valid", "action_mask", "turn_ids")}
        guided = np.nonzero(batch["guided"])[0]
        if len(guided):  # the expert's tokens under the current policy: ratio 1 at epoch one
            pick = np.resize(guided, self.loop.guide_groups)  # one shape, one compile
            logp = self._logprobs(policy, params, dev["tokens"][pick], dev["valid"][pick])
            batch["rollout_logprobs"][guided] = np.where(
                batch["action_mask"][guided], np.asarray(logp)[: len(guided)], 0.0
            )
        attn = None
        if self.rl_cfg.advantage == "attn_credit":  # attention mass of the current policy
            attn = self._attn_mass(
                policy, params, dev["tokens"], dev["valid"], dev["action_mask"], dev["turn_ids"]
            )
        values = None
        if self.model_cfg.value_head:  # the critic's V before each token, current params
            values = self._values(policy, params, dev["tokens"], dev["valid"])
        inputs = CreditInputs(
            action_mask=dev["action_mask"],
            turn_ids=dev["turn_ids"],
            outcome_reward=jnp.asarray(batch["outcome_reward"]),
            process_rewards=jnp.asarray(batch["process_rewards"]),
            group_ids=jnp.asarray(batch["group_ids"]),
            state_ids=jnp.asarray(
                history_state_ids(batch["tokens"], batch["action_mask"], batch["turn_ids"])
            ),
            attn_credit=attn,
            values=values,
        )
        batch["advantages"] = np.asarray(self.advantage_fn(inputs))
        if values is not None:
            batch["old_values"] = np.asarray(values)
            batch["value_targets"] = np.asarray(self._value_targets(inputs))
        if self.ref_params is not None:
            ref = self.placement.host_params(self.ref_params)
            batch["ref_logprobs"] = self._logprobs(policy, ref, dev["tokens"], dev["valid"])
        return batch

    def _attention_mass(self, policy, params, tokens, valid, action_mask, turn_ids):
        model = Transformer(self.model_cfg, policy)
        return attention_credit_mass(model, params, tokens, valid, action_mask, turn_ids)

    def metrics(self, update: dict, c: Collected, batch: Rows, update_s: float) -> dict:
        """The step's metrics: the update's, the pipeline's, and the rollouts' (over every
        sampled episode of the step, not only the batch's)."""
        rows = concat_rows(c.store, self.sampling.max_len)
        tokens = float(rows["valid"].sum())
        out = dict(update)
        out.update(c.data_metrics)
        if "old_values" in batch:
            v_targets, v_old = batch["value_targets"], batch["old_values"]
            out.update(critic.explained_variance(v_targets, v_old, batch["action_mask"]))
        out.update(
            {
                "reward": float(np.mean(rows["outcome_reward"])),
                "success": float(np.mean(rows["success"])),
                "goal_adherence": float(np.mean(rows["goal_adhered"])),
                "truncated": float(np.mean(rows["truncated"])),
                "rejected_call_rate": c.rejected_calls / max(c.calls, 1),
                "env/hack_suspect": c.hack_suspect_calls / max(c.calls, 1),
                "episode_tokens": float(rows["valid"].sum(1).mean()),
                "rollout_s": c.seconds,
                "update_s": update_s,
                "rollout_tokens_per_s": tokens / max(c.seconds, 1e-9),
                "update_tokens_per_s": float(batch["valid"].sum()) / max(update_s, 1e-9),
                "kv_bytes_per_seq_peak": float(self._kv_peak),
            }
        )
        if self.loop.guide_groups:
            out["guided_groups"] = float(np.count_nonzero(batch["guided"]))
        if rows["greedy"].any():  # train.greedy_member
            out["greedy_member_success"] = float(rows["success"][rows["greedy"]].mean())
        out.update({k: float(v) for k, v in memory_metrics().items() if v is not None})
        return out


def update_batch(batch: Rows) -> dict[str, Any]:
    """The fields of a scored batch that the update reads."""
    out = {k: batch[k] for k in UPDATE_KEYS if k in batch}
    if "ref_logprobs" in batch:
        out["ref_logprobs"] = batch["ref_logprobs"]
    return out
