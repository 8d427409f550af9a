"""Evaluation: play episodes with the model through the rollout engine and summarise them.

``evaluate(model, params, tasks, env=..., greedy=...)`` plays one episode per task with
``rollout.agent_loop.run_episodes`` (KV-cached decoding, the run's environment from
``envs.registry``; code repair by default) and returns a flat dict:

  * ``success``: fraction of episodes solved (all tests, hidden included, pass at submit and the
    rule is kept); ``success_stderr``: its binomial standard error sqrt(p (1 - p) / n);
    ``episode_success``: 0/1 per episode in task order (for paired comparisons, ``paired_gain``);
  * ``goal_adherence``: fraction of episodes whose rule (constraint) held at the end;
  * ``mean_turns``, ``mean_tokens``: model turns and total tokens per episode;
  * ``truncated``: fraction stopped by the turn / token cap before the environment ended them;
  * ``rejected_turns``: fraction of model turns the environment answered with an error (a
    malformed tool call, a reply without a code block, a call its tools refuse);
  * ``per_bug_type``: ``{bug type: success rate}`` (a task counts once under each type it has);
    ``per_bug_type_n``: episodes per type;
  * ``per_bug_subtype``, ``per_bug_subtype_n``: the same per ``"type/subtype"`` of the injected
    bugs (``"logic/variable"``; see ``envs.coderepair.bugs``);
  * ``n_episodes``, ``greedy``.

``pass_at_k(model, params, tasks, k=...)`` samples ``k`` episodes per task and returns the
unbiased pass@j estimates (j = 1, 2, 4, ... k) overall, per bug type and per subtype: how much of
what the sampled policy can solve greedy decoding leaves on the table, the room that sharpening
the policy (RL on its own samples) has at most.

``eval_tasks(split, difficulty, n)`` is the fixed evaluation set: the first ``n`` tasks of a fresh
``data.TaskPipeline`` over ``split`` (bug types balanced round-robin; another ``seed``, another
set). ``run_from_cli`` backs ``agentrl eval <run_dir or checkpoint> [--split heldout]
[--difficulty 1] [--episodes N] [--seed S] [--pass-k K] [--transcripts PATH]`` and prints one
JSON object with a ``greedy`` and a ``sampled`` section (and ``pass_at_k`` with ``--pass-k``);
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from agentrl_jax.data import DataConfig, TaskPipeline
from agentrl_jax.envs.registry import EnvSpec, as_env
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.sampler import RolloutConfig
from agentrl_jax.train.eval_stats import pass_at_estimates

EVAL_SPLITS = ("train", "heldout", "heldout_combo")
MODES = ("greedy", "sampled")
RESULT_KEYS = (
    "success",
    "success_stderr",
    "episode_success",
    "goal_adherence",
    "mean_turns",
    "mean_tokens",
    "truncated",
    "rejected_turns",
    "per_bug_type",
    "per_bug_type_n",
    "per_bug_subtype",
    "per_bug_subtype_n",
    "n_episodes",
    "greedy",
)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation settings (config section ``eval``). Bad values raise ``ValueError``.

    Attributes:
      split: task split, one of ``EVAL_SPLITS``.
      difficulty: environment level (1 = medium; the environment checks it, ``experiment.build``).
      n_episodes: episodes (tasks) per mode.
      modes: which of ``("greedy", "sampled")`` the CLI runs.
      temperature: sampling temperature of the ``sampled`` mode.
      max_len: tokens per episode (KV cache capacity; longer episodes are truncated = failed).
      max_new_tokens: tokens per model turn.
      n_slots: episodes decoded together.
      chunk: decode chunk rows; prefill_chunk: prefill rows (non-parity policies).
      seed: task order and sampling key.
    """

    split: str = "heldout"
    difficulty: int = 1
    n_episodes: int = 64
    modes: tuple[str, ...] = MODES
    temperature: float = 1.0
    max_len: int = 512
    max_new_tokens: int = 48
    n_slots: int = 32
    chunk: int = 4
    prefill_chunk: int = 64
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(self.modes))
        if self.split not in EVAL_SPLITS:
            raise ValueError(f"EvalConfig.split={self.split!r} must be one of {EVAL_SPLITS}")
        if not isinstance(self.difficulty, int) or self.difficulty < 0:
            raise ValueError(f"EvalConfig.difficulty={self.difficulty!r} must be an int >= 0")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"EvalConfig.modes={self.modes} must be a non-empty subset of {MODES}")
        for name in ("n_episodes", "max_new_tokens", "n_slots", "chunk", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"EvalConfig.temperature={self.temperature} must be > 0")
        if self.max_len < 64 or self.max_len % 16:
            raise ValueError(f"EvalConfig.max_len={self.max_len} must be >= 64, a multiple of 16")


def eval_data_config(
    split: str,
    difficulty: int,
    n: int,
    *,
    seed: int = 0,
    data: DataConfig | None = None,
    env: EnvSpec | None = None,
) -> DataConfig:
    """The task settings ``eval_tasks`` draws ``n`` tasks of ``split`` with, validated.

    The held-out splits are the environment's fixed benchmark (``DataConfig`` with the
    environment's ``data_defaults``: seed ranges and bug types), whatever a run trains on, so
    every run is scored on the same tasks. ``"train"`` is the run's own training distribution
    when ``data`` (its ``data`` section) is given: its ``train_seeds``, bug types and held-out
    combinations (``difficulties`` is replaced by ``difficulty``). With
    ``data.train_seeds=(0, 128)`` at difficulty 1 that is the 512 tasks such a run trains on,
    so ``n=512`` scores a policy on exactly its training tasks (the ceiling of what RL on them
    reaches, docs/experiments.md). ``env`` defaults to code repair.

    Raises:
      ValueError: bad split / difficulty / n, a split without tasks at this difficulty, or
        ``n`` above the number of distinct tasks of the split (a task would count twice).
    """
    if split not in EVAL_SPLITS:
        raise ValueError(f"split={split!r} must be one of {EVAL_SPLITS}")
    env = as_env(env)
    env.check_difficulty(difficulty)
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if data is not None and split == "train":
        base = data
    else:
        base = DataConfig(**env.data_defaults)
    cfg = dataclasses.replace(base, difficulties=(difficulty,), shuffle_seed=seed)
    lo, hi = cfg.train_seeds if split == "train" else cfg.heldout_seeds
    cells = len(cfg.cells(split))
    if n > cells * (hi - lo):
        raise ValueError(
            f"n={n} is more than the {cells * (hi - lo)} distinct {split!r} tasks at difficulty "
            f"{difficulty} (seeds [{lo}, {hi}) x {cells} bug-type cells)"
        )
    return cfg


def eval_tasks(
    split: str,
    difficulty: int,
    n: int,
    *,
    seed: int = 0,
    data: DataConfig | None = None,
    env: EnvSpec | None = None,
) -> list:
    """The first ``n`` tasks of ``split`` at ``difficulty`` (bug types balanced; deterministic;
    ``data``, ``env``: see ``eval_data_config``).

    Raises:
      ValueError: see ``eval_data_config``.
    """
    env = as_env(env)
    cfg = eval_data_config(split, difficulty, n, seed=seed, data=data, env=env)
    pipe = TaskPipeline(cfg, split, task_factory=env.task_factory(), adaptive=False)
    return [item["task"] for item in pipe.next_batch(n)]


def _bug_labels(task) -> tuple[list[str], list[str]]:
    """A task's distinct bug types and ``"type/subtype"`` labels (none for a task without bugs)."""
    types = sorted(set(task.bug_types))
    subtypes = sorted(
        {
            f"{b.type}/{b.subtype}"
            for b in getattr(task, "bugs", ())
            if getattr(b, "subtype", None) is not None
        }
    )
    return types, subtypes


def _group_by_label(values: Sequence[Any], tasks: Sequence[Any]) -> tuple[dict, dict]:
    """``values`` (one per task) grouped by bug type and by ``"type/subtype"``, keys sorted."""
    by_type: dict[str, list] = {}
    by_sub: dict[str, list] = {}
    for v, task in zip(values, tasks, strict=True):
        types, subtypes = _bug_labels(task)
        for t in types:
            by_type.setdefault(t, []).append(v)
        for t in subtypes:
            by_sub.setdefault(t, []).append(v)
    return dict(sorted(by_type.items())), dict(sorted(by_sub.items()))


def _means(groups: dict[str, list]) -> dict[str, float]:
    return {t: float(np.mean(v)) for t, v in groups.items()}


def summarize(traj, tasks: Sequence[Any], *, greedy: bool) -> dict[str, Any]:
    """The result dict (module docstring) of a ``Trajectory`` played on ``tasks`` (same order)."""
    success = np.asarray(traj.success, bool)
    valid = np.asarray(traj.valid, bool)
    turns = np.asarray(traj.turn_ids).max(axis=1)
    p = float(success.mean())
    per_type, per_sub = _group_by_label(success.tolist(), tasks)
    return {
        "success": p,
        "success_stderr": float(np.sqrt(p * (1 - p) / len(success))),
        "episode_success": success.astype(int).tolist(),
        "goal_adherence": float(np.asarray(traj.goal_adhered, bool).mean()),
        "mean_turns": float(turns.mean()),
        "mean_tokens": float(valid.sum(axis=1).mean()),
        "truncated": float(np.asarray(traj.truncated, bool).mean()),
        # model turns answered by an error (a malformed tool call, no code block, a bad path)
        "rejected_turns": float(np.mean([bool(r["error"]) for r in traj.logs] or [0.0])),
        "per_bug_type": _means(per_type),
        "per_bug_type_n": {t: len(v) for t, v in per_type.items()},
        "per_bug_subtype": _means(per_sub),
        "per_bug_subtype_n": {t: len(v) for t, v in per_sub.items()},
        "n_episodes": len(tasks),
        "greedy": bool(greedy),
    }


def transcripts(traj, tasks: Sequence[Any]) -> list[dict[str, Any]]:
    """One JSON-able record per episode of ``traj`` (played on ``tasks``, same order): ``index``,
    ``task_seed``, ``difficulty``, ``bugs`` (the task's bug dataclasses, e.g.
    ``envs.coderepair.Bug``: type, subtype, line, original and mutated line, the expert's fix),
    ``success``, ``truncated``,
    ``goal_adhered`` and ``turns``: every model turn's ``tool``, ``args``, the environment's
    ``output`` and ``error``."""
    turns: list[list[dict[str, Any]]] = [[] for _ in tasks]
    for rec in traj.logs:
        turns[rec["episode"]].append({k: rec[k] for k in ("tool", "args", "output", "error")})
    out = []
    for i, task in enumerate(tasks):
        out.append(
            {
                "index": i,
                "task_seed": task.seed,
                "difficulty": task.difficulty,
                "bugs": [dataclasses.asdict(b) for b in task.bugs],
                "success": bool(traj.success[i]),
                "truncated": bool(traj.truncated[i]),
                "goal_adhered": bool(traj.goal_adhered[i]),
                "turns": turns[i],
            }
        )
    return out


def evaluate(
    model: Transformer,
    params: Any,
    tasks: Sequence[Any],
    *,
    env: EnvSpec | None = None,
    greedy: bool = True,
    cfg: EvalConfig = EvalConfig(),
    rng: jax.Array | None = None,
    with_transcripts: bool = False,
) -> dict[str, Any]:
    """Plays one episode per task with the model (its own dtype policy) and summarises them.

    Args:
      model: the ``Transformer`` (carries the dtype policy the sampler uses).
      params: its parameters.
      tasks: tasks of ``env`` (e.g. ``eval_tasks(...)``); all of one difficulty or not.
      env: the environment (default: code repair).
      greedy: argmax decoding, else sampling at ``cfg.temperature``.
      cfg: cache / batching settings (``split``, ``difficulty``, ``n_episodes`` are ignored).
      rng: sampling key (default ``jax.random.key(cfg.seed)``).
      with_transcripts: also return every episode's record (``transcripts``) under the key
        ``"transcripts"``.

    Returns:
      The result dict (keys ``RESULT_KEYS``, plus ``"transcripts"`` if asked for).

    Raises:
      ValueError: empty ``tasks``.
    """
    if not tasks:
        raise ValueError("tasks must be non-empty")
    env = as_env(env)
    tokenizer = env.tokenizer()
    sampling = RolloutConfig(
        temperature=cfg.temperature,
        greedy=greedy,
        max_new_tokens=cfg.max_new_tokens,
        chunk=cfg.chunk,
        prefill_chunk=cfg.prefill_chunk,
        max_len=cfg.max_len,
    )
    max_turns = max(env.max_turns(t) for t in tasks)
    traj = run_episodes(
        model,
        params,
        list(tasks),
        lambda: env.env(tokenizer),
        tokenizer,
        sampling,
        jax.random.key(cfg.seed) if rng is None else rng,
        n_slots=min(cfg.n_slots, len(tasks)),
        max_turns=max_turns,
    )
    result = summarize(traj, tasks, greedy=greedy)
    if with_transcripts:
        result["transcripts"] = transcripts(traj, tasks)
    return result


def pass_at_k(
    model: Transformer,
    params: Any,
    tasks: Sequence[Any],
    *,
    k: int,
    env: EnvSpec | None = None,
    cfg: EvalConfig = EvalConfig(),
    rng: jax.Array | None = None,
) -> dict[str, Any]:
    """Samples ``k`` episodes of every task (temperature ``cfg.temperature``) and estimates pass@j.

    The ``k * len(tasks)`` episodes run as one ``run_episodes`` call (sample ``s`` of task ``i``
    is episode ``s * len(tasks) + i``, each with its own key folded from ``rng``).

    Returns:
      ``{"k", "n_tasks", "pass_at": {"1": .., "2": .., "4": .., ..., "k": ..},
      "per_bug_type": {type: pass@k}, "per_bug_subtype": {"type/subtype": pass@k},
      "solved_samples": [#successes of each task]}``; pass@j uses ``pass_at_estimates``.

    Raises:
      ValueError: ``k < 1`` or empty ``tasks``.
    """
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    res = evaluate(model, params, list(tasks) * k, env=env, greedy=False, cfg=cfg, rng=rng)
    succ = np.asarray(res["episode_success"], bool).reshape(k, len(tasks))
    js = sorted({2**e for e in range(k.bit_length()) if 2**e <= k} | {k})
    at_k = pass_at_estimates(succ, k).tolist()
    per_type, per_sub = _group_by_label(at_k, tasks)
    return {
        "k": k,
        "n_tasks": len(tasks),
        "pass_at": {str(j): float(pass_at_estimates(succ, j).mean()) for j in js},
        "per_bug_type": _means(per_type),
        "per_bug_subtype": _means(per_sub),
        "solved_samples": succ.sum(axis=0).astype(int).tolist(),
    }


def evaluate_split(
    model: Transformer,
    params: Any,
    cfg: EvalConfig,
    *,
    env: EnvSpec | None = None,
    data: DataConfig | None = None,
    with_transcripts: bool = False,
) -> dict[str, Any]:
    """Runs every mode of ``cfg.modes`` on ``eval_tasks(cfg.split, cfg.difficulty, ...)``
    (``data``: the run's data section, which picks the ``"train"`` split's tasks; ``env``:
    default code repair).

    Returns ``{"split", "difficulty", "<mode>": result dict, ...}`` (see ``evaluate`` for
    ``with_transcripts``).
    """
    env = as_env(env)
    tasks = eval_tasks(cfg.split, cfg.difficulty, cfg.n_episodes, seed=cfg.seed, data=data, env=env)
    out: dict[str, Any] = {"split": cfg.split, "difficulty": cfg.difficulty}
    for mode in cfg.modes:
        out[mode] = evaluate(
            model,
            params,
            tasks,
            env=env,
            greedy=mode == "greedy",
            cfg=cfg,
            with_transcripts=with_transcripts,
        )
    return out


__all__ = [
    "EvalConfig",
    "eval_data_config",
    "eval_tasks",
    "evaluate",
    "evaluate_split",
    "pass_at_k",
    "summarize",
    "transcripts",
]
