"""Code-repair environment: time per step, episode length and expert success per difficulty.

Prints one JSON line per (difficulty, variant). ``variant`` is ``expert`` (no detours) or
``expert_detour`` (detour probability 0.3). ``us_per_step`` is the median over repetitions of the
mean wall time of ``env.step`` (tool execution, test runs, tokenization); task generation is
reported separately as ``make_task_us``.

Usage: python benchmarks/env.py [--episodes 20] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import Timing, env_fields

from agentrl_jax.envs.coderepair.config import DIFFICULTIES
from agentrl_jax.envs.coderepair.env import CodeRepairEnv
from agentrl_jax.envs.coderepair.expert import ExpertPolicy
from agentrl_jax.envs.coderepair.task import make_task
from agentrl_jax.envs.episode import play_episode


class _TimedEnv(CodeRepairEnv):
    """Accumulates the wall time spent in ``step``."""

    step_s = 0.0
    steps = 0

    def step(self, action_tokens):
        t0 = time.perf_counter()
        out = super().step(action_tokens)
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        return out


def measure(difficulty: int, detour: float, episodes: int, reps: int) -> dict:
    t0 = time.perf_counter()
    tasks = [make_task(seed, difficulty) for seed in range(episodes)]
    make_task_us = (time.perf_counter() - t0) / episodes * 1e6
    per_step, tokens, turns, success, adhered, prompt = [], [], [], [], [], []
    for rep in range(reps + 1):  # rep 0 warms up
        env = _TimedEnv()
        for k, task in enumerate(tasks):
            ep = play_episode(env, task, ExpertPolicy(task, detour_prob=detour, seed=k))
            if rep == 1:
                tokens.append(ep.n_tokens)
                turns.append(ep.n_turns)
                success.append(ep.success)
                adhered.append(ep.goal_adhered)
                prompt.append(int((ep.turn_ids == 0).sum()))
        if rep:
            per_step.append(env.step_s / env.steps * 1e3)  # ms per step
    t = Timing.from_ms(per_step)
    return {
        "bench": "env",
        "variant": "expert_detour" if detour else "expert",
        "difficulty": difficulty,
        "episodes": episodes,
        "us_per_step": round(t.median_ms * 1e3, 1),
        "us_per_step_min": round(t.min_ms * 1e3, 1),
        "us_per_step_max": round(t.max_ms * 1e3, 1),
        "make_task_us": round(make_task_us, 1),
        "mean_episode_tokens": round(statistics.mean(tokens), 1),
        "max_episode_tokens": max(tokens),
        "mean_prompt_tokens": round(statistics.mean(prompt), 1),
        "mean_turns": round(statistics.mean(turns), 2),
        "expert_success_rate": statistics.mean(success),
        "goal_adherence": statistics.mean(adhered),
        "vocab_size": CodeRepairEnv().tokenizer.vocab_size,
        **env_fields(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    for difficulty in range(len(DIFFICULTIES)):
        for detour in (0.0, 0.3):
            print(json.dumps(measure(difficulty, detour, args.episodes, args.reps)), flush=True)


if __name__ == "__main__":
    main()
