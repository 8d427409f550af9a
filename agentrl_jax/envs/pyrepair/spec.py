"""The Python repair environment as the trainer sees it (``cfg.env = "pyrepair"``)."""

from __future__ import annotations

from agentrl_jax.envs.pyrepair.config import (
    BUG_TYPES,
    BUGS_PER_DIFFICULTY,
    HELDOUT_COMBO,
    difficulty_config,
)
from agentrl_jax.envs.pyrepair.env import PROCESS_KEYS, PyRepairEnv
from agentrl_jax.envs.pyrepair.expert import ExpertPolicy
from agentrl_jax.envs.pyrepair.task import make_task
from agentrl_jax.envs.pyrepair.tokenizer import ByteTokenizer
from agentrl_jax.envs.registry import EnvSpec


def _check_difficulty(level: int) -> None:
    difficulty_config(level)  # ValueError names the allowed range


def _expert(task, tokenizer, *, detour_prob: float = 0.0, seed: int = 0, max_guesses: int = 1):
    """The scripted expert; it repairs from the recorded mutations and makes no detours.

    Raises:
      ValueError: ``detour_prob`` > 0 (set ``sft.detour_prob=0`` for this environment).
    """
    del seed, max_guesses  # no detours, nothing to randomise
    if detour_prob > 0:
        raise ValueError(
            f"sft.detour_prob={detour_prob}: the pyrepair expert makes no detours (set it to 0)"
        )
    return ExpertPolicy(task, tokenizer)


PYREPAIR = EnvSpec(
    name="pyrepair",
    tokenizer=ByteTokenizer,
    env=PyRepairEnv,
    make_task=make_task,
    expert=_expert,
    bug_types=BUG_TYPES,
    process_keys=PROCESS_KEYS,
    fix_tools=("edit",),
    check_difficulty=_check_difficulty,
    max_turns=lambda task: task.config.max_turns,
    data_defaults={
        "difficulties": tuple(range(len(BUGS_PER_DIFFICULTY))),
        "bug_types": BUG_TYPES,
        "bugs_per_difficulty": BUGS_PER_DIFFICULTY,
        "heldout_combo": tuple(sorted(HELDOUT_COMBO)),
    },
)
