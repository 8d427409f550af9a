"""Environments by name: what the trainer, the evaluator and the config checks need from one.

An experiment names its environment (``cfg.env = "coderepair"``); the training loop, SFT
demonstrations, evaluation and config checks ask :func:`get_env` for an :class:`EnvSpec` and
never import an environment module themselves, so a new environment plugs in without touching
``train/``::

    spec = get_env("coderepair")
    tokenizer = spec.tokenizer()
    task = spec.make_task(seed=3, difficulty=1, bug_types=("logic",))
    obs = spec.env(tokenizer).reset(task)

Built-in environments register when their package is imported; :func:`get_env` imports a
built-in package by its module name on first use (no import edge from here to it). A task of any
registered environment has ``seed``, ``difficulty``, ``bug_types`` (one type per bug) and
``bugs`` (dataclasses with a ``type`` and, where the environment has them, a ``subtype``), which
evaluation groups results by.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from agentrl_jax.envs.base import Env, PolicyFn, Tokenizer

# name -> module that registers it on import
_BUILTIN = {
    "coderepair": "agentrl_jax.envs.coderepair",
    "pyrepair": "agentrl_jax.envs.pyrepair",
}
_REGISTRY: dict[str, EnvSpec] = {}
DEFAULT_ENV = "coderepair"


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """Everything the trainer needs from one environment family.

    Attributes:
      name: registry name (``cfg.env``).
      tokenizer: ``() -> Tokenizer`` shared by environment, expert and model.
      env: ``(tokenizer) -> Env``, a fresh environment (one per episode).
      make_task: ``(seed, difficulty, *, bug_types) -> task`` (deterministic).
      expert: ``(task, tokenizer, *, detour_prob, seed, max_guesses) -> policy``: a scripted
        policy that solves ``task``; the policy has ``detour_turns`` and ``guess_turns`` (1-based
        turns of deliberate mistakes, empty when the expert makes none).
      bug_types: the bug-type names tasks are drawn over.
      process_keys: the per-turn process signals ``StepResult.process`` carries.
      fix_tools: tools whose turns change the code (the SFT loss's ``fix_mask``).
      check_difficulty: ``(level) -> None``, raising ``ValueError`` for an unknown level.
      max_turns: ``(task) -> int``, the environment's turn limit of that task.
      data_defaults: ``DataConfig`` fields of the environment's fixed evaluation benchmark
        (bug types, held-out combination, seed ranges) where they differ from the defaults.
    """

    name: str
    tokenizer: Callable[[], Tokenizer]
    env: Callable[[Tokenizer], Env]
    make_task: Callable[..., Any]
    expert: Callable[..., PolicyFn]
    bug_types: tuple[str, ...]
    process_keys: tuple[str, ...]
    fix_tools: tuple[str, ...]
    check_difficulty: Callable[[int], None]
    max_turns: Callable[[Any], int]
    data_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def task_factory(self) -> Callable[[dict[str, Any]], Any]:
        """``spec -> task`` for the data pipeline (a task spec: seed, difficulty, bug_types)."""
        make = self.make_task
        return lambda s: make(int(s["seed"]), int(s["difficulty"]), bug_types=tuple(s["bug_types"]))


def register_env(spec: EnvSpec) -> EnvSpec:
    """Adds ``spec`` under ``spec.name``. Raises ``ValueError`` if the name is taken."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"environment {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def env_names() -> tuple[str, ...]:
    """Registered and built-in environment names, sorted."""
    return tuple(sorted(set(_REGISTRY) | set(_BUILTIN)))


def get_env(name: str) -> EnvSpec:
    """The environment registered as ``name`` (a built-in is imported on first use).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in _REGISTRY and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    if name not in _REGISTRY:
        raise ValueError(f"env={name!r} is not a registered environment; known: {env_names()}")
    return _REGISTRY[name]


def as_env(env: EnvSpec | str | None) -> EnvSpec:
    """``env`` itself, the environment registered under that name, or (None) the default one.

    Raises:
      ValueError: an unknown name.
    """
    if isinstance(env, EnvSpec):
        return env
    return get_env(DEFAULT_ENV if env is None else env)
