"""agentrl_jax.envs.pyrepair: repairing real Python (HumanEval) with tools, run in a sandbox.

Modules: ``config`` (levels, bug types, splits), ``problems`` (HumanEval programs and tests),
``mutations`` (``ast`` bug injection), ``refactor`` (helper extraction), ``execution`` (sandboxed
test runs; ``judge`` runs inside the sandbox, ``plain`` is the values it exchanges with the
solution, ``report`` renders its results), ``task`` (``make_task``), ``prompts``, ``tools``
(view/run_tests/edit/submit), ``env`` (``PyRepairEnv``), ``hack_check`` (``env/hack_suspect``),
``redteam`` (the reward hacks it is tested against), ``tokenizer`` (``ByteTokenizer``),
``expert`` (scripted demonstrations), ``spec`` (the ``EnvSpec`` registered as ``"pyrepair"``).
"""

from agentrl_jax.envs.pyrepair.config import (
    BUG_TYPES,
    BUGS_PER_DIFFICULTY,
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
from agentrl_jax.envs.pyrepair.env import PROCESS_KEYS, PyRepairEnv
from agentrl_jax.envs.pyrepair.expert import ExpertPolicy, expert_calls
from agentrl_jax.envs.pyrepair.spec import PYREPAIR
from agentrl_jax.envs.pyrepair.task import Mutation, Task, make_task
from agentrl_jax.envs.pyrepair.tokenizer import ByteTokenizer
from agentrl_jax.envs.registry import register_env

register_env(PYREPAIR)

__all__ = [
    "BUGS_PER_DIFFICULTY",
    "BUG_TYPES",
    "DIFFICULTIES",
    "HELDOUT_COMBO",
    "HELDOUT_SEED_START",
    "MAX_SEED",
    "PROCESS_KEYS",
    "PYREPAIR",
    "ByteTokenizer",
    "EnvConfig",
    "ExpertPolicy",
    "Mutation",
    "PyRepairEnv",
    "Task",
    "difficulty_config",
    "expert_calls",
    "is_heldout_combo",
    "make_task",
    "seed_range",
    "split_of",
]
