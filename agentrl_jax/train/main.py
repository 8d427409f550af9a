"""The main job: SFT warm start -> held-out evaluation -> RL -> evaluation, in one run directory.

``agentrl train EXPERIMENT`` (``make train``: ``experiments/smollm2_rl.py``) runs :func:`run`
and ends with one JSON summary line (``heldout_success_before_rl``,
``heldout_success_after_rl`` (greedy),
``heldout_sampled_success_before_rl``, ``heldout_sampled_success_after_rl``,
``goal_adherence_after_rl``, ``heldout_gain`` (per mode: the paired difference after - before on
the same held-out tasks with its standard error and the tasks RL fixed / broke, see
``eval_stats.paired_gain``), ``eval_split``, ``entropy_start``, ``entropy_end``,
``nonfinite_steps``, ``wall_s``, ``run_dir``).

``agentrl train [SPEC] --resume RUN_DIR`` continues a run from its newest intact checkpoint:
params, optimiser state, PRNG key, step, the task pipeline's iterator and difficulty estimates,
and the precision-fallback state are all restored, so the resumed run computes the same
parameters as an uninterrupted one. The run keeps its own config (``train/runs.py`` says which
keys a resume may change and where the changes are recorded); a finished run is left as it is.
``docs/runs.md`` has the whole contract.

The stages are ``train/stages.py`` (shared with sweeps); one RL iteration is
``train/rl_loop.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time

import jax

from agentrl_jax import multihost
from agentrl_jax.config import ConfigDict, apply_overrides, load_config
from agentrl_jax.experiment import Sections, build
from agentrl_jax.metrics import MetricsWriter, ProgressBar, make_run_dir, save_config
from agentrl_jax.model import dispatch
from agentrl_jax.sharding import maybe_initialize_distributed
from agentrl_jax.train import runs, stages
from agentrl_jax.train.placement import Placement
from agentrl_jax.train.rl_loop import RLRun

log = logging.getLogger(__name__)


def run(cfg: ConfigDict, *, resume_dir: str | None = None, progress: bool | None = None) -> dict:
    """Runs the main job, or resumes the run in ``resume_dir``; returns the JSON summary (also
    in ``summary.json``). A resumed run that already finished is left untouched and its stored
    summary returned.

    On a multi-process run (``jax.distributed`` initialised) every process calls this with the
    same config: process 0 makes the run directory (or checks the resumed one), holds its lock
    and writes its files; the others share the directory and write only their checkpoint
    shards.

    Args:
      cfg: the experiment's config; on resume the config asked for, checked against the run's
        own (``runs.resume_config``).
      resume_dir: a run directory to continue (None: a new run under ``cfg.workdir``).
      progress: force progress bars on/off (default: on for a TTY).

    Raises:
      ValueError: a bad config (before anything is written); on resume: ``resume_dir`` is not a
        run, a config change a resume may not make, no intact checkpoint of a stage, or another
        process training in the run (``runs.RunBusy``).
    """
    t_start = time.perf_counter()
    changes: dict = {}
    if resume_dir:
        run_dir = runs.check_run_dir(resume_dir)
        cfg, changes = runs.resume_config(run_dir, cfg)
    sections = build(cfg)
    place = Placement(sections.mesh, sections.model, sections.policy)  # the mesh fits, or fail
    log.info("%s", sections.policy.describe())
    ro = sections.rollout
    paths = dispatch.describe(
        sections.model,
        sections.policy,
        seq_len=ro.max_len,
        page_size=ro.page_size,
        decode_kernel=ro.decode_kernel,
    )
    log.info("%s", paths)
    rl = sections.rl
    kwargs = f" {dict(rl.advantage_kwargs)}" if rl.advantage_kwargs else ""
    log.info("advantage %r%s, policy loss %r", rl.advantage, kwargs, rl.loss.name)
    if resume_dir:
        done = _on_primary(lambda: _finished(run_dir, sections))
        if done is not None:
            return done
    else:
        run_dir = _on_primary(lambda: make_run_dir(cfg.workdir, cfg.name))
    with contextlib.ExitStack() as stack:

        def begin():  # process 0: the lock, then the attempt (or a run finished meanwhile)
            stack.enter_context(runs.RunLock(run_dir))
            if resume_dir:
                done = _finished(run_dir, sections)  # another process may have finished it
                if done is not None:
                    return done, 0
            else:
                save_config(run_dir, cfg)
            return None, runs.begin_attempt(run_dir, changes)

        done, attempt = _on_primary(begin)
        if done is not None:
            return done
        return _job(cfg, sections, place, run_dir, attempt, bool(resume_dir), progress, t_start)


def _on_primary(fn):
    """``fn()`` run by process 0, its result (or its error, as a ValueError) on every process;
    just ``fn()`` with one process."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if multihost.is_primary():
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others hear of it
            error = e
    shared = multihost.broadcast_object((result, None if error is None else str(error)))
    if error is not None:
        raise error
    if shared[1] is not None:
        raise ValueError(shared[1])
    return shared[0]


def _finished(run_dir: str, sections: Sections) -> dict | None:
    stored = runs.finished_summary(run_dir, sections.train.rl_steps)
    if stored is None:
        return None
    log.info(
        "run %s has finished its %d RL steps; nothing to do (raise train.rl_steps to continue)",
        run_dir,
        stored["rl_steps"],
    )
    return {k: stored.get(k) for k in stages.SUMMARY_KEYS}


def _job(
    cfg, sections: Sections, place, run_dir: str, attempt: int, resume: bool, progress, t_start
):
    """SFT (or the initial params), the evaluation before RL, RL, the evaluation after it, with
    the arrays placed by ``place`` (``train/placement.py``)."""
    loop = sections.train
    progress = progress if place.primary else False
    writer = MetricsWriter(run_dir, attempt=attempt, enabled=place.primary)
    summary_path = os.path.join(run_dir, runs.SUMMARY_FILE)
    prior = _on_primary(lambda: _prior_summary(summary_path) if resume else {})

    params = stages.start_params(
        sections,
        cfg.seed,
        run_dir,
        resume=resume,
        writer=writer,
        progress=progress,
        placement=place,
    )
    stages.before_rl(cfg, sections, params, prior, writer, summary_path, place)

    rl = RLRun(
        sections, run_dir, params, seed=cfg.seed, resume=resume, attempt=attempt, placement=place
    )
    bar = ProgressBar(total=loop.rl_steps, initial=rl.start_step, desc="rl", enabled=progress)
    entropy = prior.get("entropies", [])[: rl.start_step]  # a replayed step's entry comes again
    for step in range(rl.start_step, loop.rl_steps):
        metrics = rl.step(step)
        entropy.append(metrics.get("entropy", float("nan")))
        writer.write(step + 1, metrics, prefix="rl")
        bar.update(
            1, reward=metrics["reward"], success=metrics["success"], ent=metrics.get("entropy", 0)
        )
        if loop.eval_every and (step + 1) % loop.eval_every == 0 and step + 1 < loop.rl_steps:
            mid = stages.evaluate_run(sections, rl.state.params, place)
            writer.write(step + 1, stages.eval_metrics(mid), prefix="eval")
            prior.setdefault("eval_mid", {})[str(step + 1)] = mid  # in summary.json
        if (step + 1) % loop.ckpt_every == 0 or step + 1 == loop.rl_steps:
            # summary first: a kill between the two leaves entries a resume cuts back to its step
            prior["entropies"] = entropy
            stages.dump_json(summary_path, prior)
            rl.save(step + 1)
    bar.close()
    after = stages.evaluate_run(sections, rl.state.params, place)
    writer.write(loop.rl_steps, stages.eval_metrics(after), prefix="eval")
    writer.close()
    summary = stages.summary(
        prior,
        after,
        model=stages.model_name(cfg, rl.state.params),
        eval_split=sections.eval.split,
        entropies=entropy,
        nonfinite_steps=int(rl.state.nonfinite_count),
        rl_steps=loop.rl_steps,
        wall_s=time.perf_counter() - t_start,
        run_dir=run_dir,
    )
    prior.update(summary, eval_after=after)
    stages.dump_json(summary_path, prior)
    rl.close()
    return summary


def _prior_summary(summary_path: str) -> dict:
    """The summary a resumed run wrote so far (empty if none)."""
    if not os.path.exists(summary_path):
        return {}
    with open(summary_path) as f:
        prior = json.load(f)
    if "eval_after" in prior:  # finished with fewer RL steps: its last evaluation is kept
        prior.setdefault("eval_mid", {})[str(prior["rl_steps"])] = prior.pop("eval_after")
    return prior


def run_from_cli(args) -> int:
    """``agentrl train SPEC [--set k=v ...]`` or ``agentrl train [SPEC] --resume RUN_DIR
    [--set k=v ...]`` (without SPEC a resume starts from the run's own config).

    Raises:
      ValueError: neither SPEC nor ``--resume``, and everything :func:`run` raises.
    """
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    # multi-process launch (explicit flags or cluster variables): one JAX process group
    maybe_initialize_distributed(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        detect=bool(getattr(args, "distributed", False)),
    )
    resume = getattr(args, "resume", None)
    overrides = getattr(args, "set", None) or []
    spec = getattr(args, "spec", None)
    if resume:
        run_dir = runs.check_run_dir(resume)
        if spec:
            cfg = load_config(spec, overrides)
        else:
            cfg = apply_overrides(runs.load_run_config(run_dir), overrides)
    elif spec:
        cfg = load_config(spec, overrides)
    else:
        raise ValueError("agentrl train needs an experiment SPEC (or --resume RUN_DIR)")
    summary = run(cfg, resume_dir=resume)
    if multihost.is_primary():
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0
