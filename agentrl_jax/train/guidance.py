"""Guidance for groups whose sampled members all failed (``train.guide_groups``).

In up to ``guide_groups`` groups per RL step whose sampled members all failed, the group's first
member is replaced by a successful episode on the same task, which makes the group informative:
its turns get a positive group-baselined advantage and the failed members a negative one.

* ``guide_source="expert"`` (off-policy, LUFFY-style): the environment's scripted expert plays
  the task (no detours). Its "rollout" logprobs are filled in by the RL loop with the current
  policy's teacher-forced ones (importance ratio 1 at the update's first epoch). Dense models
  only: a scripted episode has no MoE routes.
* ``guide_source="policy"`` (on-policy rejection sampling): ``guide_samples`` more episodes of
  the current policy on each such task, the first success replacing the first member with its
  own logprobs and routes.

Step metrics and the task pipeline's difficulty estimates see the sampled episodes only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from agentrl_jax.envs.episode import play_episode
from agentrl_jax.envs.registry import EnvSpec
from agentrl_jax.rollout.trajectory import (
    Rows,
    episode_record,
    select_rows,
    stack_episodes,
    with_first_row,
)

# (tasks, episodes per task, key, greedy flags) -> Trajectory of the current policy
PlayFn = Callable[[list, int, Any, np.ndarray], Any]


class Guidance:
    """One RL step's guidance (module docstring): which stored groups got a guide's episode.

    Args:
      loop: the ``TrainConfig`` (``guide_groups``, ``guide_source``, ``guide_samples``,
        ``max_turns``, ``process_weights``).
      env: the environment (its expert and episodes for ``guide_source="expert"``).
      tokenizer: the shared tokenizer.
      max_len: padded episode length of the RL batch.
      n_slots: episodes one rollout call decodes together (``guide_source="policy"``).
      play: plays episodes of the current policy (``guide_source="policy"``).

    Attributes:
      replaced: stored-group index -> that group's rows with the guide's episode first.
    """

    def __init__(self, loop, env: EnvSpec, tokenizer, max_len: int, n_slots: int, play: PlayFn):
        self.loop, self.env, self.tokenizer = loop, env, tokenizer
        self.max_len, self.n_slots, self.play = max_len, n_slots, play
        self.left = loop.guide_groups
        self.replaced: dict[int, Rows] = {}

    def apply(self, tasks: list, groups: list[dict], store: list[Rows], key) -> None:
        """Guides a round's all-failed groups (``groups[i]`` played ``tasks[i]``; its rows are
        ``store[groups[i]["rows"]]``); the guide's reward becomes the group's first reward."""
        if self.left <= 0:
            return
        if self.loop.guide_source == "expert":
            for i, (task, group) in enumerate(zip(tasks, groups, strict=True)):
                if self.left > 0 and not any(group["success"]):
                    rows = self._expert_rows(task, store[group["rows"]], group_id=i)
                    if rows is not None:
                        self._replace(group, rows)
        else:
            self._policy(tasks, groups, store, key)

    def _replace(self, group: dict, rows: Rows) -> None:
        self.replaced[group["rows"]] = rows
        group["rewards"][0] = float(rows["outcome_reward"][0])
        self.left -= 1

    def _expert_rows(self, task, rows: Rows, group_id: int) -> Rows | None:
        """``rows`` (padded to ``max_len``) with the expert's episode on ``task`` first; None
        when the expert does not succeed within the turn and token limits."""
        policy = self.env.expert(task, self.tokenizer)
        ep = play_episode(self.env.env(self.tokenizer), task, policy, max_turns=self.loop.max_turns)
        if not ep.success or ep.n_tokens > self.max_len:
            return None
        rec = episode_record(
            ep, uid=0, group_id=group_id, process_weights=self.loop.process_weights
        )
        kv = "kv_evict_at" in rows
        one = select_rows(stack_episodes([rec], pad_to=self.max_len, kv_masks=kv), [0])
        return with_first_row(rows, one, self.max_len)

    def _policy(self, tasks: list, groups: list[dict], store: list[Rows], key) -> None:
        """More samples of the current policy on the round's all-failed groups (up to the
        step's guides left); a success replaces the group's first member."""
        failed = [i for i, g in enumerate(groups) if not any(g["success"])][: self.left]
        k = self.loop.guide_samples
        per_call = max(self.n_slots // k, 1)  # <= n_slots episodes per rollout call
        for start in range(0, len(failed), per_call):
            part = failed[start : start + per_call]
            traj = self.play(
                [tasks[i] for i in part],
                k,
                jax.random.fold_in(key, start),
                np.zeros(len(part) * k, bool),
            )
            for j, i in enumerate(part):
                won = np.flatnonzero(np.asarray(traj.success)[j * k : (j + 1) * k])
                if len(won):
                    one = select_rows(traj, np.array([j * k + won[0]]))
                    rows = with_first_row(store[groups[i]["rows"]], one, self.max_len)
                    self.replaced[groups[i]["rows"]] = rows
                    groups[i]["rewards"][0] = float(one["outcome_reward"][0])
        self.left -= len(failed)
