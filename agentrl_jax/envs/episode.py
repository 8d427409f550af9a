"""Playing a policy through an environment: the token stream of one episode with its masks.

Format of an ``Episode`` (T = total tokens, K = model turns):
  * ``tokens`` int32 [T]: ``reset`` ids, then for each turn the model's ids followed by the
    environment's observation ids (the last observation ends with ``<eos>``);
  * ``action_mask`` bool [T]: True on tokens the policy emitted (losses and log-probs apply
    there), False on prompt and observation tokens;
  * ``turn_ids`` int32 [T]: 0 on the prompt, k on the k-th model turn and on the observation
    that answers it (k = 1..K);
  * ``turn_ends`` int32 [K]: index of the last token of each model turn (where per-turn process
    rewards are credited); ``process`` is the per-turn ``StepResult.process`` dict;
  * ``outcome_reward``, ``success``, ``goal_adhered``: from the final step;
  * ``logs``: per-turn tool records (``StepResult.log``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from agentrl_jax.envs.base import Env, PolicyFn, Tokenizer


@dataclasses.dataclass(frozen=True)
class Episode:
    """One played episode (see module docstring for the array layouts)."""

    tokens: np.ndarray
    action_mask: np.ndarray
    turn_ids: np.ndarray
    turn_ends: np.ndarray
    process: tuple[dict[str, float], ...]
    logs: tuple[dict[str, Any], ...]
    outcome_reward: float
    success: bool
    goal_adhered: bool
    done: bool

    @property
    def n_turns(self) -> int:
        return len(self.turn_ends)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def play_episode(
    env: Env, task: Any, policy: PolicyFn, *, max_turns: int = 1000, max_action_tokens: int = 512
) -> Episode:
    """Plays ``policy`` on ``task`` until the environment says done (or ``max_turns``).

    Args:
      env: the environment (reset here).
      task: handed to ``env.reset``.
      policy: maps the token stream so far (list of ids) to its next turn's ids.
      max_turns: safety cap on turns (environments also cap turns themselves).
      max_action_tokens: longer turns are truncated to this many tokens.

    Returns:
      The ``Episode``.

    Raises:
      ValueError: if ``max_turns`` or ``max_action_tokens`` is < 1.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    if max_action_tokens < 1:
        raise ValueError(f"max_action_tokens={max_action_tokens} must be >= 1")
    tokens = list(env.reset(task))
    mask = [False] * len(tokens)
    turns = [0] * len(tokens)
    ends, process, logs = [], [], []
    outcome, success, adhered, done = 0.0, False, True, False
    for k in range(1, max_turns + 1):
        action = list(policy(list(tokens)))[:max_action_tokens]
        tokens += action
        mask += [True] * len(action)
        turns += [k] * len(action)
        ends.append(len(tokens) - 1)
        obs, res = env.step(action)
        tokens += obs
        mask += [False] * len(obs)
        turns += [k] * len(obs)
        process.append(dict(res.process))
        logs.append(dict(res.log))
        if res.done:
            outcome = res.outcome_reward
            success = bool(res.log.get("success", outcome > 0))
            adhered = bool(res.log.get("goal_adhered", True))
            done = True
            break
    return Episode(
        tokens=np.asarray(tokens, np.int32),
        action_mask=np.asarray(mask, bool),
        turn_ids=np.asarray(turns, np.int32),
        turn_ends=np.asarray(ends, np.int32),
        process=tuple(process),
        logs=tuple(logs),
        outcome_reward=float(outcome),
        success=success,
        goal_adhered=adhered,
        done=done,
    )


def render_episode(episode: Episode, tokenizer: Tokenizer) -> str:
    """Human-readable text of an episode; model turns are prefixed with ``>>``."""
    out, start = [], 0
    ids = episode.tokens.tolist()
    mask = episode.action_mask.tolist()
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i])
            out.append(">> " + text if mask[start] else text)
            start = i
    return "\n".join(out)
