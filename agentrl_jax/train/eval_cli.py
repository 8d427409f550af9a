"""``agentrl eval RUN_DIR_OR_CHECKPOINT``: evaluate a checkpoint of a run, print one JSON line.

    agentrl eval runs/toy-20260101-120000 [--split heldout] [--difficulty 1] [--episodes N]
        [--seed S] [--pass-k K] [--transcripts PATH] [--set eval.modes='("greedy",)']

The run's own config (its ``config.json`` with the changes its resumes recorded, ``--set``
overrides it, ``--config SPEC`` replaces it) decides the model, the dtype policy, the
environment and the evaluation; the checkpoint is the given step, else the newest intact step
of the run's RL, else SFT stage (a newer step that does not load or fails its checksums is
reported in one line and skipped). Nothing in the run is written: a run may be training.
The printed object holds a ``greedy`` and a ``sampled`` section (and ``pass_at_k`` with
``--pass-k``); ``--transcripts`` writes every episode's bugs, outcome and tool calls to a
new JSONL file, one line per episode and mode (an existing file is an error, never
overwritten).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import jax

from agentrl_jax.config import apply_overrides, load_config
from agentrl_jax.experiment import build
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.train.checkpoint import existing_steps, restore_params, stage_dir
from agentrl_jax.train.evaluate import EvalConfig, eval_tasks, evaluate_split, pass_at_k
from agentrl_jax.train.runs import load_run_config


def find_run_dir(path: str) -> str:
    """The run directory of ``path`` (a run dir, a stage dir or a step dir under it).

    Raises:
      ValueError: no ``config.json`` in ``path`` or up to three levels above it.
    """
    p = os.path.abspath(path)
    for _ in range(4):
        if os.path.isfile(os.path.join(p, "config.json")):
            return p
        p = os.path.dirname(p)
    raise ValueError(
        f"{path!r} is neither a run directory nor a checkpoint inside one (no config.json found)"
    )


def checkpoint_path(path: str, run_dir: str) -> str:
    """The checkpoint to load: ``path`` if it is one, else the run's RL, then SFT stage.

    Raises:
      ValueError: no checkpoint under ``run_dir``.
    """
    p = os.path.abspath(path)
    if os.path.basename(p).isdigit() or existing_steps(p):
        return p
    for stage in ("rl", "sft"):
        d = stage_dir(run_dir, stage)
        if existing_steps(d):
            return d
    raise ValueError(f"no checkpoint under {run_dir!r} (looked in checkpoints/rl and /sft)")


def _eval_config(base: EvalConfig, args: argparse.Namespace) -> EvalConfig:
    """``base`` with the command line's --split, --difficulty, --episodes and --seed."""
    changes: dict[str, Any] = {}
    if getattr(args, "split", None):
        changes["split"] = args.split
    if getattr(args, "difficulty", None) is not None:
        try:
            changes["difficulty"] = int(args.difficulty)
        except ValueError:
            raise ValueError(f"--difficulty={args.difficulty!r} must be an integer level") from None
    if getattr(args, "episodes", None):
        changes["n_episodes"] = int(args.episodes)
    if getattr(args, "seed", None) is not None:
        changes["seed"] = int(args.seed)
    return dataclasses.replace(base, **changes)


def _check_transcripts(path: str | None) -> None:
    if path and os.path.exists(path):
        raise ValueError(f"--transcripts {path!r} exists; it would be overwritten")
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"--transcripts {path!r}: its directory does not exist")


def run_from_cli(args: argparse.Namespace) -> int:
    """``agentrl eval``: loads the checkpoint and config, evaluates, prints one JSON line.

    Raises:
      ValueError: no run directory / checkpoint, no intact checkpoint, one that does not fit
        the config (another model), a bad split, difficulty or override, an existing
        ``--transcripts`` file.
    """
    path = args.run_dir_or_checkpoint
    run_dir = find_run_dir(path)
    transcript_path = getattr(args, "transcripts", None)
    _check_transcripts(transcript_path)
    overrides = list(getattr(args, "set", None) or [])
    if getattr(args, "spec", None):
        cfg = load_config(args.spec, overrides)
    else:  # the run's own config, with --set applied to it
        cfg = apply_overrides(load_run_config(run_dir), overrides)
    sections = build(cfg)
    model = Transformer(sections.model, sections.policy)
    template = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    ckpt = checkpoint_path(path, run_dir)
    params, step = restore_params(ckpt, template)
    ev = _eval_config(sections.eval, args)
    env, data = sections.env, sections.data
    result = {"checkpoint": ckpt, "step": step, "seed": ev.seed}
    result.update(
        evaluate_split(
            model, params, ev, env=env, data=data, with_transcripts=bool(transcript_path)
        )
    )
    if transcript_path:
        with open(transcript_path, "x") as f:
            for mode in ev.modes:
                for rec in result[mode].pop("transcripts"):
                    f.write(json.dumps({"mode": mode, **rec}) + "\n")
    k = getattr(args, "pass_k", None)
    if k:
        tasks = eval_tasks(ev.split, ev.difficulty, ev.n_episodes, seed=ev.seed, data=data, env=env)
        result["pass_at_k"] = pass_at_k(model, params, tasks, k=k, env=env, cfg=ev)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0
