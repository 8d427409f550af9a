"""The main job: SFT warm start -> held-out evaluation -> RL -> evaluation, in one run directory.

``agentrl train experiments/default.py`` (``make train``) runs :func:`run` and ends with one JSON
summary line (``heldout_success_before_rl``, ``heldout_success_after_rl`` (greedy),
``heldout_sampled_success_before_rl``, ``heldout_sampled_success_after_rl``,
``goal_adherence_after_rl``, ``heldout_gain`` (per mode: the paired difference after - before on
the same held-out tasks with its standard error and the tasks RL fixed / broke, see
``eval_stats.paired_gain``), ``eval_split``, ``entropy_start``, ``entropy_end``,
``nonfinite_steps``, ``wall_s``, ``run_dir``). ``agentrl train SPEC --resume RUN_DIR``
continues a run from its latest checkpoint: params, optimiser state, PRNG key, step, the task
pipeline's iterator and difficulty estimates, and the precision-fallback state are all restored,
so the resumed run computes the same parameters as an uninterrupted one.

The stages are ``train/stages.py`` (shared with sweeps); one RL iteration is
``train/rl_loop.py``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from agentrl_jax.config import ConfigDict, load_config
from agentrl_jax.experiment import build, from_saved
from agentrl_jax.metrics import (
    MetricsWriter,
    ProgressBar,
    load_config_json,
    make_run_dir,
    save_config,
)
from agentrl_jax.sharding import maybe_initialize_distributed
from agentrl_jax.train import stages
from agentrl_jax.train.rl_loop import RLRun

log = logging.getLogger(__name__)


def run(cfg: ConfigDict, *, resume_dir: str | None = None, progress: bool | None = None) -> dict:
    """Runs the main job; returns the JSON summary (also in ``summary.json``).

    Raises:
      ValueError: a bad config (before anything is written), or ``resume_dir`` that is not a
        directory.
    """
    sections = build(cfg)
    t_start = time.perf_counter()
    if resume_dir:
        run_dir = os.path.abspath(resume_dir)
        if not os.path.isdir(run_dir):
            raise ValueError(f"--resume {resume_dir!r} is not a run directory")
    else:
        run_dir = make_run_dir(cfg.workdir, cfg.name)
        save_config(run_dir, cfg)
    loop = sections.train
    writer = MetricsWriter(run_dir)
    summary_path = os.path.join(run_dir, "summary.json")
    prior = {}
    if resume_dir and os.path.exists(summary_path):
        with open(summary_path) as f:
            prior = json.load(f)

    params = stages.start_params(
        sections, cfg.seed, run_dir, resume=bool(resume_dir), writer=writer, progress=progress
    )
    stages.before_rl(cfg, sections, params, prior, writer, summary_path)

    rl = RLRun(sections, run_dir, params, seed=cfg.seed, resume=bool(resume_dir))
    bar = ProgressBar(total=loop.rl_steps, initial=rl.start_step, desc="rl", enabled=progress)
    entropy = prior.get("entropies", [])
    for step in range(rl.start_step, loop.rl_steps):
        metrics = rl.step(step)
        entropy.append(metrics.get("entropy", float("nan")))
        writer.write(step + 1, metrics, prefix="rl")
        bar.update(
            1, reward=metrics["reward"], success=metrics["success"], ent=metrics.get("entropy", 0)
        )
        if loop.eval_every and (step + 1) % loop.eval_every == 0 and step + 1 < loop.rl_steps:
            mid = stages.evaluate_run(sections, rl.state.params)
            writer.write(step + 1, stages.eval_metrics(mid), prefix="eval")
            prior.setdefault("eval_mid", {})[str(step + 1)] = mid  # in summary.json
        if (step + 1) % loop.ckpt_every == 0 or step + 1 == loop.rl_steps:
            rl.save(step + 1)
            prior["entropies"] = entropy
            stages.dump_json(summary_path, prior)
    bar.close()
    after = stages.evaluate_run(sections, rl.state.params)
    writer.write(loop.rl_steps, stages.eval_metrics(after), prefix="eval")
    writer.close()
    summary = stages.summary(
        prior,
        after,
        eval_split=sections.eval.split,
        entropies=entropy,
        nonfinite_steps=int(rl.state.nonfinite_count),
        rl_steps=loop.rl_steps,
        wall_s=time.perf_counter() - t_start,
        run_dir=run_dir,
    )
    prior.update(summary, eval_after=after)
    stages.dump_json(summary_path, prior)
    rl.ckpt.close()
    return summary


def run_from_cli(args) -> int:
    """``agentrl train SPEC [--set k=v ...] [--resume RUN_DIR]``."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    maybe_initialize_distributed()  # multi-host launch: one JAX process group
    resume = getattr(args, "resume", None)
    overrides = getattr(args, "set", None) or []
    if resume and not args.spec:
        cfg = from_saved(load_config_json(resume), overrides)
    else:
        cfg = load_config(args.spec, overrides)
    summary = run(cfg, resume_dir=resume)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
