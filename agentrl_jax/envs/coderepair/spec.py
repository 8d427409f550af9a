"""The code-repair environment as the trainer sees it (``cfg.env = "coderepair"``)."""

from __future__ import annotations

from agentrl_jax.envs.coderepair.config import BUG_TYPES, difficulty_config
from agentrl_jax.envs.coderepair.env import PROCESS_KEYS, CodeRepairEnv
from agentrl_jax.envs.coderepair.expert import ExpertPolicy
from agentrl_jax.envs.coderepair.task import make_task
from agentrl_jax.envs.coderepair.tokenizer import CodeTokenizer
from agentrl_jax.envs.registry import EnvSpec


def _check_difficulty(level: int) -> None:
    difficulty_config(level)  # ValueError names the allowed range


CODEREPAIR = EnvSpec(
    name="coderepair",
    tokenizer=CodeTokenizer,
    env=CodeRepairEnv,
    make_task=make_task,
    expert=ExpertPolicy,
    bug_types=BUG_TYPES,
    process_keys=PROCESS_KEYS,
    fix_tools=("edit", "sub"),
    check_difficulty=_check_difficulty,
    max_turns=lambda task: task.config.max_turns,
)
