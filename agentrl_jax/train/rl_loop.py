"""The main job: SFT warm start -> difficulty-filtered tasks -> rollouts -> credit assignment ->
one jitted update -> periodic held-out evaluation -> orbax checkpoints.

``agentrl train experiments/default.py`` (``make train``) runs :func:`run` and ends with one JSON
summary line (``heldout_success_before_rl``, ``heldout_success_after_rl`` (greedy),
``heldout_sampled_success_before_rl``, ``heldout_sampled_success_after_rl``,
``goal_adherence_after_rl``, ``heldout_gain`` (per mode: the paired difference after - before on
the same held-out tasks with its standard error and the tasks RL fixed / broke, see
``evaluate.paired_gain``), ``entropy_start``, ``entropy_end``, ``nonfinite_steps``, ``wall_s``,
``run_dir``). ``agentrl train SPEC --resume RUN_DIR`` continues a run from its latest RL
checkpoint: params, optimiser state, PRNG key, step, the task pipeline's iterator and
difficulty estimates, and the precision-fallback state are all restored, so the resumed run
computes the same parameters as an uninterrupted one.

Every RL step ``s`` is a pure function of the checkpointed state: rollout keys are
``fold_in(key(seed), s)`` and the update key is ``state.rng`` folded with ``s``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import ConfigDict, load_config, to_dataclass
from agentrl_jax.metrics import (
    MetricsWriter,
    ProgressBar,
    load_config_json,
    make_run_dir,
    memory_metrics,
    plain,
    save_config,
)
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.advantages import get_advantage
from agentrl_jax.rl.credit import CreditInputs
from agentrl_jax.rl.fallback import FallbackController
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.rollout.trajectory import history_state_ids
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The RL loop (config section ``train``).

    Attributes:
      rl_steps: update steps.
      sft: run the SFT stage first (else start from ``init_from`` or a fresh init).
      init_from: run dir or checkpoint dir whose SFT params start RL ('' = none).
      advantage: registered advantage estimator (``agentrl_jax.rl.advantages``).
      advantage_kwargs: its hyperparameters.
      process_weights: weight of each environment process signal (code repair:
        ``envs.coderepair.PROCESS_KEYS``) in ``process_rewards``; a missing key weighs 1.0.
        Only estimators that read process rewards use them (``episode_process``, ``prm_orm``,
        ``gigpo``, the discounted ones).
      max_turns: model turns per episode.
      eval_every: held-out evaluation every N steps (0: only before and after RL). Every
        evaluation writes ``eval/heldout_success``, ``..._truncated``, ``..._goal_adherence`` and
        ``eval/heldout_bug_type/<type>`` to the metrics; the mid-run results are kept whole in
        ``summary.json`` under ``eval_mid`` (by step), so paired gains can be computed later.
      ckpt_every: RL checkpoint every N steps (and at the end).
      log_tool_calls: append every tool call of every rollout to ``tool_calls.jsonl``.
      eval_before: evaluate the SFT checkpoint on the held-out split before RL. When False and
        ``init_from`` is a run dir whose ``summary.json`` holds its own before-RL evaluation
        of that SFT checkpoint under the same ``eval`` section and dtype policy, that
        evaluation is reused (``eval_before_from`` in the summary names it), so RL-only runs
        from one SFT run still report paired gains. It was computed by that run's code: after
        a change to the environment or the evaluation, set ``eval_before=True`` instead.
      greedy_member: the last rollout of each group decodes greedily (argmax, as greedy
        evaluation does) instead of sampling. Greedy-only failures (e.g. repeating a rejected
        call) then reach the gradient: a greedy member that fails where its sampled siblings
        succeed gets a negative advantage. Its logprobs are the untempered policy's, like every
        rollout's. One at most: two greedy members would play the same episode. Needs
        ``data.group_size >= 2``.
      guide_groups: off-policy guidance (LUFFY-style, 0 = off): in up to this many groups per
        step whose sampled members all failed, the first member's episode is replaced by the
        scripted expert's on the same task (``envs.coderepair.ExpertPolicy``, no detours). Its
        reward makes the group informative, so the expert's turns get a positive group-baselined
        advantage and the failed members a negative one. The expert's "rollout" logprobs are
        the current policy's teacher-forced ones (importance ratio 1 at the update's first
        epoch). Step metrics (``success``, ``reward``, ...) and the task pipeline's difficulty
        estimates see the sampled episodes only; ``guided_groups`` counts the replacements.
        Dense models only (a scripted episode has no recorded MoE routes).
      guide_source: where ``guide_groups``' successful episode comes from: ``"expert"`` (above)
        or ``"policy"``: ``guide_samples`` more episodes of the current policy on each such
        task (one batched rollout per round), the first success replacing the first member,
        with its own rollout logprobs and routes. On-policy rejection sampling on the tasks
        the group alone failed: the rare success gets the group's positive advantage.
      guide_samples: extra samples per all-failed group for ``guide_source="policy"``.
    """

    rl_steps: int = 40
    sft: bool = True
    init_from: str = ""
    advantage: str = "grpo"
    advantage_kwargs: dict = dataclasses.field(default_factory=dict)
    process_weights: dict = dataclasses.field(default_factory=dict)
    max_turns: int = 8
    eval_every: int = 0
    ckpt_every: int = 10
    log_tool_calls: bool = True
    eval_before: bool = True
    greedy_member: bool = False
    guide_groups: int = 0
    guide_source: str = "expert"
    guide_samples: int = 8

    def __post_init__(self):
        for name in (
            "rl_steps",
            "max_turns",
            "eval_every",
            "ckpt_every",
            "guide_groups",
            "guide_samples",
        ):
            if getattr(self, name) < (
                0 if name in ("rl_steps", "eval_every", "guide_groups") else 1
            ):
                raise ValueError(f"LoopConfig.{name}={getattr(self, name)} is out of range")
        if self.guide_source not in ("expert", "policy"):
            raise ValueError(
                f"LoopConfig.guide_source={self.guide_source!r} must be 'expert' or 'policy'"
            )
        get_advantage(self.advantage)  # ValueError lists the registered names
        from agentrl_jax.envs.coderepair import PROCESS_KEYS

        unknown = sorted(set(self.process_weights) - set(PROCESS_KEYS))
        if unknown:
            raise ValueError(
                f"LoopConfig.process_weights has unknown keys {unknown}; known: {PROCESS_KEYS}"
            )
        for k, w in self.process_weights.items():
            if not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ValueError(f"LoopConfig.process_weights[{k!r}]={w!r} must be a finite number")


# -- trajectories ------------------------------------------------------------------------------


def _rows(traj, idx: np.ndarray) -> dict[str, np.ndarray]:
    out = {}
    for f in dataclasses.fields(traj):
        v = getattr(traj, f.name)
        if f.name != "logs" and v is not None:
            out[f.name] = np.asarray(v)[idx]
    return out


def _with_first_member(rows: dict, one: dict, length: int) -> dict:
    """A copy of a group's ``rows`` padded to ``length`` whose first member is the one-row
    ``one`` (a guide's episode), flagged in ``guided``."""
    out = _concat([rows], length)
    for key, value in _concat([one], length).items():
        out[key][0] = value[0]
    out["guided"] = np.arange(len(out["guided"])) == 0
    return out


def _concat(parts: list[dict[str, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """Concatenates row dicts along the batch, padding time to ``length``."""
    out = {}
    for key in parts[0]:
        arrs = []
        for p in parts:
            a = p[key]
            if a.ndim >= 2:
                pad_value = (
                    -1
                    if key == "turn_ids"
                    else (
                        np.iinfo(np.int32).max
                        if key.startswith("kv_") and a.dtype == np.int32
                        else 0
                    )
                )
                a = np.pad(
                    a,
                    [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2),
                    constant_values=pad_value,
                )
            arrs.append(a)
        out[key] = np.concatenate(arrs, axis=0)
    return out


# -- the loop ------------------------------------------------------------------------------------


class RLRun:
    """State of one RL run (host side); ``step()`` runs one iteration."""

    def __init__(self, cfg: ConfigDict, run_dir: str, params, *, resume: bool):
        from agentrl_jax.data.pipeline import DataConfig, TaskPipeline
        from agentrl_jax.data.sources import make_task_factory
        from agentrl_jax.envs.coderepair import CodeRepairEnv, CodeTokenizer, make_task
        from agentrl_jax.rollout.sampler import SamplingConfig

        check_config(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        self.loop = to_dataclass(cfg.train, LoopConfig)
        self.rl_cfg = rl_config(cfg.rl)
        self.data_cfg = to_dataclass(cfg.data, DataConfig)
        self.sampling = to_dataclass(cfg.rollout, SamplingConfig)
        self.model_cfg = to_dataclass(cfg.model, ModelConfig)
        self.policy = get_policy(cfg.policy)
        self.tokenizer = CodeTokenizer()
        self.env_factory = lambda: CodeRepairEnv(self.tokenizer)
        self.pipeline = TaskPipeline(
            self.data_cfg, "train", task_factory=make_task_factory(make_task)
        )
        self.advantage_fn = jax.jit(
            lambda inputs: get_advantage(self.loop.advantage)(inputs, **self.loop.advantage_kwargs)
        )
        self.batch_size = self.data_cfg.batch_size * self.data_cfg.group_size
        self.controller = FallbackController(
            lambda p: make_update_fn(Transformer(self.model_cfg, p), self.rl_cfg, p, self.sampling),
            self.rl_cfg,
            self.policy,
        )
        self.ckpt = Checkpointer(stage_dir(run_dir, "rl"), resume=resume, max_to_keep=2)
        key = jax.random.key(cfg.seed)
        self.rollout_key = jax.random.fold_in(key, 1)
        self.state = init_train_state(
            jax.tree.map(jnp.copy, params), self.rl_cfg, jax.random.fold_in(key, 2)
        )
        # KL to the reference policy (loss.kl_coef > 0): the parameters RL started from (the SFT
        # checkpoint), frozen; their teacher-forced logprobs of each batch go in as ref_logprobs.
        self.ref_params = params if self.rl_cfg.loss.kl_coef > 0 else None
        self._ref_logprobs = jax.jit(
            functools.partial(_ref_logprobs, self.model_cfg, self.sampling), static_argnums=0
        )
        self._attn_mass = jax.jit(functools.partial(_attn_mass, self.model_cfg), static_argnums=0)
        self._values = jax.jit(
            functools.partial(_values, self.model_cfg, self.sampling), static_argnums=0
        )
        # The critic's targets: unwhitened GAE returns A_t + V_t with the advantage's gamma/lam.
        vkw = {k: v for k, v in self.loop.advantage_kwargs.items() if k != "whiten"}
        self._value_targets = jax.jit(
            lambda inputs: jnp.where(
                inputs.action_mask, get_advantage("gae")(inputs, **vkw) + inputs.values, 0.0
            )
        )
        self._guided: dict[int, dict] = {}  # train.guide_groups, per step (see step())
        self._guides_left = 0
        self.start_step = 0
        if resume and self.ckpt.latest_step() is not None:
            self._restore()

    # checkpoints -------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        s = self.state
        meta = {
            "data": self.pipeline.state(),
            "nonfinite_count": int(s.nonfinite_count),
            "consecutive_nonfinite": int(s.consecutive_nonfinite),
            "train_step": int(s.step),
            "fallback": {
                "active": self.controller.active.name,
                "consecutive": self.controller.consecutive,
                "remaining": self.controller.remaining,
                "calls": self.controller.calls,
            },
        }
        self.ckpt.save(step, params=s.params, opt_state=s.opt_state, rng=s.rng, meta=meta)

    def _restore(self) -> None:
        out = self.ckpt.restore(params=self.state.params, opt_state=self.state.opt_state)
        meta = out["meta"]
        self.pipeline.restore(meta["data"])
        i32 = lambda v: jnp.asarray(v, jnp.int32)
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
        c.active = get_policy(fb["active"]) if fb["active"] != c.primary.name else c.primary
        c.consecutive, c.remaining, c.calls = fb["consecutive"], fb["remaining"], fb["calls"]
        self.start_step = out["step"]
        log.info("resumed RL from step %d of %s", self.start_step, self.run_dir)

    # one iteration -----------------------------------------------------------------------------
    def _rollout(self, step: int, items: list[dict], round_index: int, store: list):
        g = self.data_cfg.group_size
        greedy = (np.arange(g) == g - 1) & self.loop.greedy_member  # per group member
        key = jax.random.fold_in(jax.random.fold_in(self.rollout_key, step), round_index)
        traj = self._play([it["task"] for it in items], g, key, np.tile(greedy, len(items)))
        expert = self.loop.guide_source == "expert"
        groups = []
        for i in range(len(items)):
            idx = np.arange(i * g, (i + 1) * g)
            rows = _rows(traj, idx)
            rows["greedy"] = greedy
            rows["guided"] = np.zeros(g, bool)
            store.append(rows)
            rewards = [float(r) for r in rows["outcome_reward"]]
            if expert and self._guides_left > 0 and not rows["success"].any():
                guided = self._guided_rows(items[i]["task"], rows, group_id=i)
                if guided is not None:  # train.guide_groups
                    self._guided[len(store) - 1] = guided
                    self._guides_left -= 1
                    rewards[0] = float(guided["outcome_reward"][0])
            groups.append(
                {
                    "rewards": rewards,  # with the expert's: decides whether the group is kept
                    "success": [bool(s) for s in rows["success"]],  # sampled: the estimates
                    "rows": len(store) - 1,
                }
            )
        if not expert and self._guides_left > 0:
            self._policy_guides(groups, items, store, jax.random.fold_in(key, 1))
        return groups

    def _play(self, tasks: list, k: int, key, greedy: np.ndarray):
        """``k`` episodes of the current policy per task (group ``i`` = task ``i``), counted in
        the rejected-call rate and logged to ``tool_calls.jsonl``."""
        from agentrl_jax.rollout.agent_loop import run_episodes

        log_path = (
            os.path.join(self.run_dir, "tool_calls.jsonl") if self.loop.log_tool_calls else None
        )
        traj = run_episodes(
            Transformer(self.model_cfg, self.controller.active),
            self.state.params,
            [t for t in tasks for _ in range(k)],
            self.env_factory,
            self.tokenizer,
            self.sampling,
            key,
            # One slot count for every call: fewer tasks (a refill round, a guide batch) leave
            # slots idle instead of compiling the sampler for another batch shape.
            n_slots=self.batch_size,
            max_turns=self.loop.max_turns,
            process_weights=self.loop.process_weights,
            group_ids=[i for i in range(len(tasks)) for _ in range(k)],
            log_path=log_path,
            greedy=[bool(x) for x in greedy],
        )
        self._calls[0] += len(traj.logs)
        self._calls[1] += sum(bool(r.get("error")) for r in traj.logs)
        return traj

    def _policy_guides(self, groups: list, items: list, store: list, key) -> None:
        """``guide_source="policy"``: more samples on the round's all-failed groups (up to the
        step's ``guide_groups`` left); a success replaces the group's first member."""
        failed = [i for i, gr in enumerate(groups) if not any(gr["success"])]
        failed = failed[: self._guides_left]
        if not failed:
            return
        k = self.loop.guide_samples
        per_call = max(self.batch_size // k, 1)  # <= n_slots episodes per rollout call
        for start in range(0, len(failed), per_call):
            part = failed[start : start + per_call]
            traj = self._play(
                [items[i]["task"] for i in part],
                k,
                jax.random.fold_in(key, start),
                np.zeros(len(part) * k, bool),
            )
            for j, i in enumerate(part):
                won = np.flatnonzero(np.asarray(traj.success)[j * k : (j + 1) * k])
                if len(won):
                    row = groups[i]["rows"]
                    one = _rows(traj, np.array([j * k + won[0]]))
                    self._guided[row] = _with_first_member(store[row], one, self.sampling.max_len)
                    groups[i]["rewards"][0] = float(one["outcome_reward"][0])
        self._guides_left -= len(failed)

    def _guided_rows(self, task, rows: dict, group_id: int) -> dict | None:
        """A copy of a group's rows (padded to ``max_len``) whose first member is the scripted
        expert's episode on ``task``; None when the expert does not succeed within the turn and
        token limits."""
        from agentrl_jax.envs.coderepair import ExpertPolicy
        from agentrl_jax.envs.episode import play_episode
        from agentrl_jax.rollout.trajectory import episode_record, stack_episodes

        policy = ExpertPolicy(task, self.tokenizer)
        ep = play_episode(self.env_factory(), task, policy, max_turns=self.loop.max_turns)
        if not ep.success or ep.n_tokens > self.sampling.max_len:
            return None
        rec = episode_record(
            ep, uid=0, group_id=group_id, process_weights=self.loop.process_weights
        )
        kv = "kv_evict_at" in rows
        one = _rows(stack_episodes([rec], pad_to=self.sampling.max_len, kv_masks=kv), [0])
        return _with_first_member(rows, one, self.sampling.max_len)

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        store: list[dict] = []
        rounds = [0]
        self._calls = [0, 0]  # model turns, turns answered by an error (this step's rollouts)
        self._guided = {}  # store index -> its rows with the expert's episode
        self._guides_left = self.loop.guide_groups

        def rollout_fn(items):
            out = self._rollout(step, items, rounds[0], store)
            rounds[0] += 1
            return out

        kept, data_metrics = self.pipeline.collect(rollout_fn)
        used = [g["rows"] for g in kept]
        # Keep the update's shape fixed: top up a short batch with all-equal groups (their
        # group-baselined advantages are zero, so they add no gradient).
        for i in range(len(store)):
            if len(used) >= self.data_cfg.batch_size:
                break
            if i not in used:
                used.append(i)
        parts = [self._guided.get(i, store[i]) for i in used]
        for j, p in enumerate(parts):
            p["group_ids"] = np.full_like(p["group_ids"], j)
        t_roll = time.perf_counter() - t0
        batch = _concat(parts, self.sampling.max_len)
        dev = {k: jnp.asarray(batch[k]) for k in ("tokens", "valid", "action_mask", "turn_ids")}
        guided = np.nonzero(batch["guided"])[0]
        if len(guided):  # the expert's tokens under the current policy: ratio 1 at epoch one
            pick = np.resize(guided, self.loop.guide_groups)  # one shape, one compile
            logp = self._ref_logprobs(
                self.controller.active, self.state.params, dev["tokens"][pick], dev["valid"][pick]
            )
            batch["rollout_logprobs"][guided] = np.where(
                batch["action_mask"][guided], np.asarray(logp)[: len(guided)], 0.0
            )
        attn_credit = None
        if self.loop.advantage == "attn_credit":  # attention mass of the current policy
            attn_credit = self._attn_mass(
                self.controller.active,
                self.state.params,
                dev["tokens"],
                dev["valid"],
                dev["action_mask"],
                dev["turn_ids"],
            )
        values = None
        if self.model_cfg.value_head:  # the critic's V before each token, current params
            values = self._values(
                self.controller.active, self.state.params, dev["tokens"], dev["valid"]
            )
        inputs = CreditInputs(
            action_mask=dev["action_mask"],
            turn_ids=dev["turn_ids"],
            outcome_reward=jnp.asarray(batch["outcome_reward"]),
            process_rewards=jnp.asarray(batch["process_rewards"]),
            group_ids=jnp.asarray(batch["group_ids"]),
            state_ids=jnp.asarray(
                history_state_ids(batch["tokens"], batch["action_mask"], batch["turn_ids"])
            ),
            attn_credit=attn_credit,
            values=values,
        )
        batch["advantages"] = np.asarray(self.advantage_fn(inputs))
        value_metrics = {}
        if values is not None:
            batch["old_values"] = np.asarray(values)
            batch["value_targets"] = np.asarray(self._value_targets(inputs))
            value_metrics = _explained_variance(
                batch["value_targets"], batch["old_values"], batch["action_mask"]
            )
        update_batch = {
            k: batch[k]
            for k in (
                "tokens",
                "valid",
                "action_mask",
                "advantages",
                "rollout_logprobs",
                "routes",
                "kv_evict_at",
                "kv_int8_at",
                "value_targets",
                "old_values",
            )
            if k in batch
        }
        if self.ref_params is not None:
            update_batch["ref_logprobs"] = self._ref_logprobs(
                self.controller.active, self.ref_params, dev["tokens"], dev["valid"]
            )
        t1 = time.perf_counter()
        self.state, metrics = self.controller(self.state, update_batch, None)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        t_upd = time.perf_counter() - t1
        n_tokens = float(batch["valid"].sum())
        all_rows = _concat(store, self.sampling.max_len)
        metrics.update(data_metrics)
        metrics.update(value_metrics)
        metrics.update(
            {
                "reward": float(np.mean(all_rows["outcome_reward"])),
                "success": float(np.mean(all_rows["success"])),
                "goal_adherence": float(np.mean(all_rows["goal_adhered"])),
                "truncated": float(np.mean(all_rows["truncated"])),
                "rejected_call_rate": self._calls[1] / max(self._calls[0], 1),
                "episode_tokens": float(all_rows["valid"].sum(1).mean()),
                "rollout_s": t_roll,
                "update_s": t_upd,
                "rollout_tokens_per_s": float(all_rows["valid"].sum()) / max(t_roll, 1e-9),
                "update_tokens_per_s": n_tokens / max(t_upd, 1e-9),
                "kv_bytes_per_seq_peak": float(
                    _kv_bytes(
                        self.model_cfg, self.controller.active, all_rows, self.sampling.page_size
                    )
                ),
            }
        )
        if self.loop.guide_groups:
            metrics["guided_groups"] = float(len(guided))
        if all_rows["greedy"].any():  # train.greedy_member
            metrics["greedy_member_success"] = float(all_rows["success"][all_rows["greedy"]].mean())
        metrics.update({k: float(v) for k, v in memory_metrics().items() if v is not None})
        return metrics


def _teacher_forced(model_cfg: ModelConfig, sampling, policy, params, tokens, valid):
    """``(logp [B, T-1], extras)`` of a no-entropy teacher-forced pass under ``policy``."""
    from agentrl_jax.model.chunked import as_chunk_spec, sequence_logprobs

    logp, _, extras = sequence_logprobs(
        Transformer(model_cfg, policy),
        params,
        tokens,
        valid=valid,
        chunk_spec=as_chunk_spec(sampling),
        with_entropy=False,
    )
    return logp, extras


def _ref_logprobs(model_cfg: ModelConfig, sampling, policy, params, tokens, valid) -> jax.Array:
    """Reference-policy logprobs f32 [B, T] of ``tokens`` under ``policy`` (column 0 is 0)."""
    logp, _ = _teacher_forced(model_cfg, sampling, policy, params, tokens, valid)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def _values(model_cfg: ModelConfig, sampling, policy, params, tokens, valid) -> jax.Array:
    """Value-head estimates f32 [B, T] aligned with the trajectory: entry t is V of the prefix
    before token t (the head's output at t - 1; column 0 is 0)."""
    _, extras = _teacher_forced(model_cfg, sampling, policy, params, tokens, valid)
    return jnp.pad(extras["values"][:, :-1], ((0, 0), (1, 0)))


def _explained_variance(targets, values, mask) -> dict[str, float]:
    """``value_explained_var`` = 1 - Var(R - V) / Var(R) over action tokens (1 = a perfect
    critic, 0 = no better than the mean, < 0 worse), and the targets' mean."""
    r, v = targets[mask.astype(bool)], values[mask.astype(bool)]
    if r.size == 0:
        return {}
    var = float(np.var(r))
    ev = 1.0 - float(np.var(r - v)) / var if var > 0 else float("nan")
    return {"value_explained_var": ev, "value_target_mean": float(np.mean(r))}


def _attn_mass(model_cfg: ModelConfig, policy, params, tokens, valid, action_mask, turn_ids):
    """Attention mass [B, T] of the final turn's action tokens (``rl.attention_credit``)."""
    from agentrl_jax.rl.attention_credit import attention_credit_mass

    model = Transformer(model_cfg, policy)
    return attention_credit_mass(model, params, tokens, valid, action_mask, turn_ids)


def _kv_bytes(model_cfg: ModelConfig, policy, rows, page_size: int) -> int:
    from agentrl_jax.rollout.kv_cache import kv_bytes_per_seq

    return kv_bytes_per_seq(model_cfg, policy, int(rows["valid"].sum(1).max()), page_size)


def rl_config(section) -> RLConfig:
    """RLConfig from its config section (the nested ``loss`` becomes a ``LossConfig``)."""
    from agentrl_jax.rl.losses import LossConfig

    data = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    data["loss"] = to_dataclass(data.get("loss", {}), LossConfig)
    return to_dataclass(data, RLConfig)


def _eval(model_cfg, policy, params, cfg: ConfigDict) -> dict[str, Any]:
    """``evaluate_split`` under ``cfg.eval`` (``cfg.data`` picks the ``"train"`` split's tasks)."""
    from agentrl_jax.data.pipeline import DataConfig
    from agentrl_jax.train.evaluate import EvalConfig, evaluate_split

    ev = to_dataclass(cfg.eval, EvalConfig)
    data = to_dataclass(cfg.data, DataConfig)
    return evaluate_split(Transformer(model_cfg, policy), params, ev, data=data)


def _eval_metrics(result: dict) -> dict[str, float]:
    """Metrics of an evaluation for the JSONL/TensorBoard writer (prefix ``eval``): the greedy
    (else first) mode's success, goal adherence, truncated fraction and per-bug-type and
    per-subtype success (``heldout_bug_subtype/logic/variable``)."""
    r = result[_main_mode(result)]
    out = {f"heldout_{k}": float(r[k]) for k in ("success", "goal_adherence", "truncated")}
    for key in ("bug_type", "bug_subtype"):
        out.update({f"heldout_{key}/{b}": float(v) for b, v in r.get(f"per_{key}", {}).items()})
    return out


def _main_mode(result: dict) -> str:
    """The mode a summary reports: ``greedy`` if evaluated, else the first one."""
    modes = [k for k in result if isinstance(result[k], dict)]
    return "greedy" if "greedy" in modes else modes[0]


def _mode(result: dict, key: str) -> float:
    return float(result[_main_mode(result)][key])


def check_config(cfg: ConfigDict) -> None:
    """Builds every section the main job reads, so a bad value fails before a run directory,
    SFT or an evaluation.

    Raises:
      ValueError (or TypeError): the first bad section, named by its own message; a data
        section whose train split has no tasks.
    """
    from agentrl_jax.data.pipeline import DataConfig
    from agentrl_jax.rollout.sampler import SamplingConfig
    from agentrl_jax.train.evaluate import EvalConfig, eval_data_config
    from agentrl_jax.train.sft import SFTConfig

    model = to_dataclass(cfg.model, ModelConfig)
    get_policy(cfg.policy)
    to_dataclass(cfg.sft, SFTConfig)
    loop = to_dataclass(cfg.train, LoopConfig)
    to_dataclass(cfg.rollout, SamplingConfig)
    ev = to_dataclass(cfg.eval, EvalConfig)
    data = to_dataclass(cfg.data, DataConfig)
    if not data.cells("train"):
        raise ValueError(
            f"data: no training tasks at difficulties={data.difficulties} with "
            f"bug_types={data.bug_types}: heldout_combo={data.heldout_combo} holds out every "
            "combination (set data.heldout_combo=() to hold out none)"
        )
    eval_data_config(ev.split, ev.difficulty, ev.n_episodes, seed=ev.seed, data=data)
    if loop.greedy_member and data.group_size < 2:
        raise ValueError(
            f"train.greedy_member needs data.group_size >= 2, not {data.group_size} "
            "(a group needs a sampled member)"
        )
    rl = rl_config(cfg.rl)
    if model.value_head and (loop.advantage != "gae" or rl.loss.vf_coef <= 0):
        raise ValueError(
            f"model.value_head={model.value_head!r} is a critic for train.advantage='gae' "
            f"trained with rl.loss.vf_coef > 0 (got advantage={loop.advantage!r}, "
            f"vf_coef={rl.loss.vf_coef})"
        )
    if rl.loss.vf_coef > 0 and not model.value_head:
        raise ValueError(
            f"rl.loss.vf_coef={rl.loss.vf_coef} needs a value head: set model.value_head to "
            "'shared' or 'detached'"
        )
    if loop.guide_groups and loop.guide_source == "expert" and model.is_moe:
        raise ValueError(
            f"train.guide_groups={loop.guide_groups} needs a dense model: a scripted expert "
            "episode has no MoE routes to replay or compare"
        )


def run(cfg: ConfigDict, *, resume_dir: str | None = None, progress: bool | None = None) -> dict:
    """Runs the main job; returns (and prints) the JSON summary."""
    from agentrl_jax.train.sft import SFTConfig, run_sft

    check_config(cfg)
    t_start = time.perf_counter()
    if resume_dir:
        run_dir = os.path.abspath(resume_dir)
        if not os.path.isdir(run_dir):
            raise ValueError(f"--resume {resume_dir!r} is not a run directory")
    else:
        run_dir = make_run_dir(cfg.workdir, cfg.name)
        save_config(run_dir, cfg)
    model_cfg = to_dataclass(cfg.model, ModelConfig)
    policy = get_policy(cfg.policy)
    loop = to_dataclass(cfg.train, LoopConfig)
    writer = MetricsWriter(run_dir)
    summary_path = os.path.join(run_dir, "summary.json")
    prior = json.load(open(summary_path)) if resume_dir and os.path.exists(summary_path) else {}

    # SFT warm start ------------------------------------------------------------------------
    sft_cfg = to_dataclass(cfg.sft, SFTConfig)
    sft_dir = stage_dir(run_dir, "sft")
    if loop.sft:
        done = resume_dir and os.path.isdir(sft_dir) and os.listdir(sft_dir)
        params, _ = run_sft(
            model_cfg, policy, sft_cfg, run_dir, resume=bool(done), writer=writer, progress=progress
        )
    elif loop.init_from:
        template = init_params(Transformer(model_cfg, policy), jax.random.key(cfg.seed))
        params = initial_params(loop.init_from, template)
    else:
        params = init_params(Transformer(model_cfg, policy), jax.random.key(cfg.seed))

    if loop.eval_before and "heldout_success_before_rl" not in prior:
        before = _eval(model_cfg, policy, params, cfg)
        prior["heldout_success_before_rl"] = _mode(before, "success")
        prior["goal_adherence_before_rl"] = _mode(before, "goal_adherence")
        prior["eval_before"] = before
        writer.write(0, _eval_metrics(before), prefix="eval")
        _dump(summary_path, prior)
        log.info("held-out before RL: %s", json.dumps(before))

    elif not loop.eval_before and loop.init_from and "eval_before" not in prior:
        stored = _stored_sft_eval(loop.init_from, cfg)
        if stored is not None:
            before, prior["eval_before_from"] = stored
            prior["heldout_success_before_rl"] = _mode(before, "success")
            prior["goal_adherence_before_rl"] = _mode(before, "goal_adherence")
            prior["eval_before"] = before
            _dump(summary_path, prior)
            log.info("held-out before RL: reused from %s", prior["eval_before_from"])

    # RL --------------------------------------------------------------------------------------
    rl = RLRun(cfg, run_dir, params, resume=bool(resume_dir))
    bar = ProgressBar(total=loop.rl_steps, initial=rl.start_step, desc="rl", enabled=progress)
    entropy = prior.get("entropies", [])
    for step in range(rl.start_step, loop.rl_steps):
        metrics = rl.step(step)
        entropy.append(metrics.get("entropy", float("nan")))
        writer.write(step + 1, metrics, prefix="rl")
        bar.update(
            1, reward=metrics["reward"], success=metrics["success"], ent=metrics.get("entropy", 0)
        )
        if loop.eval_every and (step + 1) % loop.eval_every == 0 and step + 1 < loop.rl_steps:
            mid = _eval(model_cfg, policy, rl.state.params, cfg)
            writer.write(step + 1, _eval_metrics(mid), prefix="eval")
            prior.setdefault("eval_mid", {})[str(step + 1)] = mid  # in summary.json
        if (step + 1) % loop.ckpt_every == 0 or step + 1 == loop.rl_steps:
            rl.save(step + 1)
            prior["entropies"] = entropy
            _dump(summary_path, prior)
    bar.close()
    after = _eval(model_cfg, policy, rl.state.params, cfg)
    writer.write(loop.rl_steps, _eval_metrics(after), prefix="eval")
    writer.close()
    finite = [e for e in entropy if np.isfinite(e)]
    summary = {
        "heldout_success_before_rl": prior.get("heldout_success_before_rl"),
        "heldout_success_after_rl": _mode(after, "success"),
        "goal_adherence_before_rl": prior.get("goal_adherence_before_rl"),
        "goal_adherence_after_rl": _mode(after, "goal_adherence"),
        "heldout_sampled_success_before_rl": prior.get("eval_before", {})
        .get("sampled", {})
        .get("success"),
        "heldout_sampled_success_after_rl": after.get("sampled", {}).get("success"),
        "heldout_gain": _gains(prior.get("eval_before"), after),
        "eval_before_from": prior.get("eval_before_from"),
        "eval_split": cfg.eval.split,
        "entropy_start": finite[0] if finite else None,
        "entropy_end": finite[-1] if finite else None,
        "nonfinite_steps": int(rl.state.nonfinite_count),
        "rl_steps": loop.rl_steps,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "run_dir": run_dir,
    }
    prior.update(summary, eval_after=after)
    _dump(summary_path, prior)
    rl.ckpt.close()
    return summary


def initial_params(source: str, template):
    """Params RL starts from (``train.init_from``): a run dir (its SFT stage), a stage dir (its
    latest step) or a step dir, restored onto ``template``. A value head the template has and
    the checkpoint lacks (a critic added after SFT) keeps the template's fresh one.

    Raises:
      ValueError: no checkpoint at ``source``.
    """
    from agentrl_jax.train.checkpoint import restore_params

    if os.path.isdir(os.path.join(source, "checkpoints")):  # a run dir: its SFT stage
        source = stage_dir(source, "sft")
    head = template["params"].get("value_head")
    try:
        return restore_params(source, template)[0]
    except ValueError:  # with a head: the checkpoint's tree may lack it (fewer leaves)
        if head is None:
            raise
        trunk = {
            **template,
            "params": {k: v for k, v in template["params"].items() if k != "value_head"},
        }
        params, _ = restore_params(source, trunk)
        log.info("%s has no value head: the critic starts from its initialisation", source)
        return {**params, "params": {**params["params"], "value_head": head}}


def _stored_sft_eval(source: str, cfg: ConfigDict) -> tuple[dict, str] | None:
    """``(evaluation, summary path)`` of the SFT checkpoint a run dir ``source`` holds, when its
    summary has the before-RL evaluation and its config the same ``eval`` section and dtype
    policy as ``cfg`` (same tasks, same decoding), and for ``eval.split="train"`` the same
    ``data`` section (which picks those tasks); else None."""
    summary = os.path.join(source, "summary.json")
    if not (os.path.isfile(summary) and os.path.isfile(os.path.join(source, "config.json"))):
        return None
    src = load_config_json(source)
    before = json.load(open(summary)).get("eval_before")
    same = plain(cfg.eval) == src.get("eval")
    if cfg.eval.split == "train":  # the run's own training tasks: its data section picks them
        same = same and plain(cfg.data) == src.get("data")
    if not before or not same or src.get("policy") != cfg.policy:
        return None
    return before, os.path.abspath(summary)


def _gains(before: dict | None, after: dict) -> dict[str, Any] | None:
    """``{mode: paired_gain}`` for each mode evaluated before and after (None without a before
    evaluation; a mode whose before result predates ``episode_success`` is left out)."""
    from agentrl_jax.train.evaluate import paired_gain

    if not before:
        return None
    return {
        mode: {
            k: round(v, 4) if isinstance(v, float) else v
            for k, v in paired_gain(before[mode], after[mode]).items()
        }
        for mode in after
        if isinstance(after[mode], dict) and "episode_success" in before.get(mode, {})
    }


def _dump(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=float)
    os.replace(tmp, path)


def run_from_cli(args) -> int:
    """``agentrl train SPEC [--set k=v ...] [--resume RUN_DIR]``."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    from agentrl_jax.sharding import maybe_initialize_distributed

    maybe_initialize_distributed()  # multi-host launch: one JAX process group
    resume = getattr(args, "resume", None)
    overrides = getattr(args, "set", None) or []
    if resume and not args.spec:
        cfg = ConfigDict(load_config_json(resume))
    else:
        cfg = load_config(args.spec, overrides)
    summary = run(cfg, resume_dir=resume)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
