"""agentrl_jax.envs.coderepair: procedurally generated code repair with verifiable rewards.

Modules: ``language`` (lexicon, parser), ``interpreter`` (budgeted evaluation), ``generator``
(programs and tests), ``bugs`` (labelled injection), ``task`` (``make_task``), ``evaluation``
(test runs), ``tools`` (run/view/edit/sub/submit), ``env`` (``CodeRepairEnv``), ``tokenizer``
(``CodeTokenizer``), ``expert`` (scripted demonstrations), ``config`` (difficulty and splits),
``spec`` (the ``EnvSpec`` registered as ``"coderepair"``).
"""

from agentrl_jax.envs.coderepair.config import (
    BUG_TYPES,
    DIFFICULTIES,
    HELDOUT_COMBO,
    HELDOUT_SEED_START,
    MAX_SEED,
    EnvConfig,
    difficulty_config,
    is_heldout_combo,
    seed_range,
    split_of,
)
from agentrl_jax.envs.coderepair.env import PROCESS_KEYS, CodeRepairEnv
from agentrl_jax.envs.coderepair.expert import ExpertPolicy, expert_plan, expert_plan_detours
from agentrl_jax.envs.coderepair.spec import CODEREPAIR
from agentrl_jax.envs.coderepair.task import Task, make_task
from agentrl_jax.envs.coderepair.tokenizer import CodeTokenizer
from agentrl_jax.envs.registry import register_env

register_env(CODEREPAIR)

__all__ = [
    "BUG_TYPES",
    "CODEREPAIR",
    "DIFFICULTIES",
    "HELDOUT_COMBO",
    "HELDOUT_SEED_START",
    "MAX_SEED",
    "PROCESS_KEYS",
    "CodeRepairEnv",
    "CodeTokenizer",
    "EnvConfig",
    "ExpertPolicy",
    "Task",
    "difficulty_config",
    "expert_plan",
    "expert_plan_detours",
    "is_heldout_combo",
    "make_task",
    "seed_range",
    "split_of",
]
