"""Evaluation: play episodes with the model through the rollout engine and summarise them.

``evaluate(model, params, tasks, greedy=...)`` plays one episode per task with
``rollout.agent_loop.run_episodes`` (KV-cached decoding, the code-repair environment) and
returns a flat dict:

  * ``success``: fraction of episodes solved (all tests, hidden included, pass at submit and the
    rule is kept); ``success_stderr``: its binomial standard error sqrt(p (1 - p) / n);
    ``episode_success``: 0/1 per episode in task order (for paired comparisons, ``paired_gain``);
  * ``goal_adherence``: fraction of episodes whose rule (constraint) held at the end;
  * ``mean_turns``, ``mean_tokens``: model turns and total tokens per episode;
  * ``truncated``: fraction stopped by the turn / token cap before the environment ended them;
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
``--transcripts`` writes every episode's bugs, outcome and turns (``transcripts``) to a new JSONL
file, one line per episode and mode.

``paired_gain(before, after)`` compares two results on the same tasks (e.g. before and after RL):
the success difference, its paired standard error, and how many tasks each side alone solved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from agentrl_jax.data import DataConfig, TaskPipeline, make_task_factory
from agentrl_jax.envs.coderepair import (
    BUG_TYPES,
    CodeRepairEnv,
    CodeTokenizer,
    difficulty_config,
    make_task,
)
from agentrl_jax.model.transformer import Transformer

logger = logging.getLogger(__name__)

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
      difficulty: environment level (1 = medium).
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
        difficulty_config(self.difficulty)  # ValueError names the allowed range
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
    split: str, difficulty: int, n: int, *, seed: int = 0, data: DataConfig | None = None
) -> DataConfig:
    """The task settings ``eval_tasks`` draws ``n`` tasks of ``split`` with, validated.

    The held-out splits are the fixed benchmark: ``DataConfig()``'s seed range and bug types,
    whatever a run trains on, so every run is scored on the same tasks. ``"train"`` is the
    run's own training distribution when ``data`` (its ``data`` section) is given: its
    ``train_seeds``, bug types and held-out combinations (``difficulties`` is replaced by
    ``difficulty``). With ``data.train_seeds=(0, 128)`` at difficulty 1 that is the 512 tasks
    such a run trains on, so ``n=512`` scores a policy on exactly its training tasks (the
    ceiling of what RL on them reaches, README session 20).

    Raises:
      ValueError: bad split / difficulty / n, a split without tasks at this difficulty, or
        ``n`` above the number of distinct tasks of the split (a task would count twice).
    """
    if split not in EVAL_SPLITS:
        raise ValueError(f"split={split!r} must be one of {EVAL_SPLITS}")
    difficulty_config(difficulty)
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    base = data if data is not None and split == "train" else DataConfig()
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
    split: str, difficulty: int, n: int, *, seed: int = 0, data: DataConfig | None = None
) -> list:
    """The first ``n`` tasks of ``split`` at ``difficulty`` (bug types balanced; deterministic;
    ``data``: see ``eval_data_config``).

    Raises:
      ValueError: see ``eval_data_config``.
    """
    cfg = eval_data_config(split, difficulty, n, seed=seed, data=data)
    pipe = TaskPipeline(cfg, split, task_factory=make_task_factory(make_task), adaptive=False)
    return [item["task"] for item in pipe.next_batch(n)]


def _bug_labels(task) -> tuple[list[str], list[str]]:
    """A task's distinct bug types and ``"type/subtype"`` labels (none for a task without bugs)."""
    types = sorted(set(task.bug_types))
    subtypes = sorted({f"{b.type}/{b.subtype}" for b in getattr(task, "bugs", ())})
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
        "per_bug_type": _means(per_type),
        "per_bug_type_n": {t: len(v) for t, v in per_type.items()},
        "per_bug_subtype": _means(per_sub),
        "per_bug_subtype_n": {t: len(v) for t, v in per_sub.items()},
        "n_episodes": len(tasks),
        "greedy": bool(greedy),
    }


def transcripts(traj, tasks: Sequence[Any]) -> list[dict[str, Any]]:
    """One JSON-able record per episode of ``traj`` (played on ``tasks``, same order): ``index``,
    ``task_seed``, ``difficulty``, ``bugs`` (``envs.coderepair.Bug`` fields: type, subtype,
    line, original and mutated line as words, the expert's fix), ``success``, ``truncated``,
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


def paired_gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Success of ``after`` minus ``before`` on the same tasks, with its paired standard error.

    With per-task differences d_i = a_i - b_i in {-1, 0, 1} over n tasks, ``fixed`` = #(d_i = 1)
    (solved only after), ``broken`` = #(d_i = -1):

      delta = (fixed - broken) / n
      stderr = sqrt(s^2 / n),  s^2 = (fixed + broken - (fixed - broken)^2 / n) / (n - 1)

    (the sample variance of d, never negative; 0 when n = 1). Pairing removes the variance of
    task difficulty that two independent binomial errors would count twice.

    Args:
      before, after: result dicts of ``evaluate`` (need ``episode_success``) on the same tasks.

    Returns:
      ``{"delta", "stderr", "fixed", "broken", "n"}``.

    Raises:
      ValueError: a result without ``episode_success``, or different episode counts.
    """
    for name, res in (("before", before), ("after", after)):
        if "episode_success" not in res:
            raise ValueError(f"{name} has no episode_success (a result of an older evaluate?)")
    b = np.asarray(before["episode_success"], int)
    a = np.asarray(after["episode_success"], int)
    if b.shape != a.shape or b.ndim != 1 or not len(b):
        raise ValueError(f"before and after must cover the same tasks: {len(b)} vs {len(a)}")
    n = len(b)
    fixed, broken = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    delta = (fixed - broken) / n
    var = (fixed + broken - (fixed - broken) ** 2 / n) / (n - 1) if n > 1 else 0.0
    return {
        "delta": delta,
        "stderr": float(np.sqrt(var / n)),
        "fixed": fixed,
        "broken": broken,
        "n": n,
    }


def evaluate(
    model: Transformer,
    params: Any,
    tasks: Sequence[Any],
    *,
    greedy: bool = True,
    cfg: EvalConfig = EvalConfig(),
    rng: jax.Array | None = None,
    with_transcripts: bool = False,
) -> dict[str, Any]:
    """Plays one episode per task with the model (its own dtype policy) and summarises them.

    Args:
      model: the ``Transformer`` (carries the dtype policy the sampler uses).
      params: its parameters.
      tasks: code-repair tasks (e.g. ``eval_tasks(...)``); all of one difficulty or not.
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
    from agentrl_jax.rollout.agent_loop import run_episodes
    from agentrl_jax.rollout.sampler import SamplingConfig

    if not tasks:
        raise ValueError("tasks must be non-empty")
    tokenizer = CodeTokenizer()
    sampling = SamplingConfig(
        temperature=cfg.temperature,
        greedy=greedy,
        max_new_tokens=cfg.max_new_tokens,
        chunk=cfg.chunk,
        prefill_chunk=cfg.prefill_chunk,
        max_len=cfg.max_len,
    )
    max_turns = max(t.config.max_turns for t in tasks)
    traj = run_episodes(
        model,
        params,
        list(tasks),
        lambda: CodeRepairEnv(tokenizer),
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


def pass_at_estimates(successes: np.ndarray, j: int) -> np.ndarray:
    """Unbiased pass@j per task from ``n`` samples of which ``c`` succeeded (Chen et al. 2021):

      pass@j = 1 - C(n - c, j) / C(n, j)

    the chance that ``j`` of the ``n`` samples, drawn without replacement, hold a success.

    Args:
      successes: bool/int [n, T], sample x task.
      j: 1 <= j <= n.

    Returns:
      f64 [T].
    """
    s = np.asarray(successes, bool)
    n = s.shape[0]
    if not 1 <= j <= n:
        raise ValueError(f"j={j} must be in [1, {n}] (the samples per task)")
    fails = n - s.sum(axis=0)
    # C(f, j) / C(n, j) = prod_{i<j} (f - i) / (n - i), 0 once i reaches f
    ratio = np.prod([np.clip(fails - i, 0, None) / (n - i) for i in range(j)], axis=0)
    return 1.0 - ratio


def pass_at_k(
    model: Transformer,
    params: Any,
    tasks: Sequence[Any],
    *,
    k: int,
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
    res = evaluate(model, params, list(tasks) * k, greedy=False, cfg=cfg, rng=rng)
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
    data: DataConfig | None = None,
    with_transcripts: bool = False,
) -> dict[str, Any]:
    """Runs every mode of ``cfg.modes`` on ``eval_tasks(cfg.split, cfg.difficulty, ...)``
    (``data``: the run's data section, which picks the ``"train"`` split's tasks).

    Returns ``{"split", "difficulty", "<mode>": result dict, ...}`` (see ``evaluate`` for
    ``with_transcripts``).
    """
    tasks = eval_tasks(cfg.split, cfg.difficulty, cfg.n_episodes, seed=cfg.seed, data=data)
    out: dict[str, Any] = {"split": cfg.split, "difficulty": cfg.difficulty}
    for mode in cfg.modes:
        out[mode] = evaluate(
            model,
            params,
            tasks,
            greedy=mode == "greedy",
            cfg=cfg,
            with_transcripts=with_transcripts,
        )
    return out


# -- CLI ------------------------------------------------------------------------------------------


def _find_run_dir(path: str) -> str:
    """The run directory of ``path`` (a run dir, a stage dir or a step dir under it)."""
    p = os.path.abspath(path)
    for _ in range(4):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
        p = os.path.dirname(p)
    raise ValueError(
        f"{path!r} is neither a run directory nor a checkpoint inside one (no config.json found)"
    )


def _checkpoint_path(path: str, run_dir: str) -> str:
    """The checkpoint to load: ``path`` if it is one, else the run's RL, then SFT stage."""
    from agentrl_jax.train.checkpoint import existing_steps, stage_dir

    p = os.path.abspath(path)
    if os.path.basename(p).isdigit() or existing_steps(p):
        return p
    for stage in ("rl", "sft"):
        d = stage_dir(run_dir, stage)
        if existing_steps(d):
            return d
    raise ValueError(f"no checkpoint under {run_dir!r} (looked in checkpoints/rl and /sft)")


def _eval_config(cfg_dict: dict[str, Any], args: argparse.Namespace) -> EvalConfig:
    section = dict(cfg_dict.get("eval") or {})
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    section = {k: v for k, v in section.items() if k in known}
    if getattr(args, "split", None):
        section["split"] = args.split
    if getattr(args, "difficulty", None) is not None:
        try:
            section["difficulty"] = int(args.difficulty)
        except ValueError:
            raise ValueError(f"--difficulty={args.difficulty!r} must be an integer level") from None
    if getattr(args, "episodes", None):
        section["n_episodes"] = int(args.episodes)
    if getattr(args, "seed", None) is not None:
        section["seed"] = int(args.seed)
    if "modes" in section:
        section["modes"] = tuple(section["modes"])
    return EvalConfig(**section)


def run_from_cli(args: argparse.Namespace) -> int:
    """``agentrl eval``: loads the checkpoint and config, evaluates, prints one JSON line.

    Raises:
      ValueError: no run directory / checkpoint, bad split or difficulty.
    """
    from agentrl_jax.config import ConfigDict, apply_overrides, load_config, to_dataclass
    from agentrl_jax.metrics import load_config_json
    from agentrl_jax.model.config import ModelConfig
    from agentrl_jax.model.transformer import init_params
    from agentrl_jax.precision import get_policy
    from agentrl_jax.train.checkpoint import restore_params

    path = args.run_dir_or_checkpoint
    run_dir = _find_run_dir(path)
    transcript_path = getattr(args, "transcripts", None)
    if transcript_path and os.path.exists(transcript_path):
        raise ValueError(f"--transcripts {transcript_path!r} exists; it would be overwritten")
    if transcript_path and not os.path.isdir(os.path.dirname(os.path.abspath(transcript_path))):
        raise ValueError(f"--transcripts {transcript_path!r}: its directory does not exist")
    overrides = list(getattr(args, "set", None) or [])
    if getattr(args, "spec", None):
        cfg_dict = load_config(args.spec, overrides).to_dict()
    else:  # the run's own config, with --set applied to it
        cfg_dict = apply_overrides(ConfigDict(load_config_json(run_dir)), overrides).to_dict()
    model_cfg = to_dataclass(cfg_dict["model"], ModelConfig)
    model = Transformer(model_cfg, get_policy(cfg_dict.get("policy", "fp32")))
    template = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    ckpt = _checkpoint_path(path, run_dir)
    params, step = restore_params(ckpt, template)
    cfg = _eval_config(cfg_dict, args)
    data = to_dataclass(cfg_dict["data"], DataConfig) if cfg_dict.get("data") else None
    result = {"checkpoint": ckpt, "step": step, "seed": cfg.seed}
    result.update(
        evaluate_split(model, params, cfg, data=data, with_transcripts=bool(transcript_path))
    )
    if transcript_path:
        with open(transcript_path, "x") as f:
            for mode in cfg.modes:
                for rec in result[mode].pop("transcripts"):
                    f.write(json.dumps({"mode": mode, **rec}) + "\n")
    k = getattr(args, "pass_k", None)
    if k:
        tasks = eval_tasks(cfg.split, cfg.difficulty, cfg.n_episodes, seed=cfg.seed, data=data)
        result["pass_at_k"] = pass_at_k(model, params, tasks, k=k, cfg=cfg)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


__all__ = [
    "BUG_TYPES",
    "EvalConfig",
    "eval_tasks",
    "evaluate",
    "evaluate_split",
    "paired_gain",
    "pass_at_estimates",
    "pass_at_k",
    "run_from_cli",
    "summarize",
    "transcripts",
]
