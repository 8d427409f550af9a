"""``agentrl sweep``: run an experiment's ``sweep(add)`` points, then tabulate and plot them.

    agentrl sweep experiments/sweep_lr.py:smoke=True [--set k=v ...]
    agentrl sweep runs/sweep_lr-sweep-20250101-120000       (re-run: finished points are skipped)

Layout: ``<workdir>/<name>-sweep-<timestamp>/`` holds ``sweep.json`` (spec, overrides, one entry per
point with its status), ``sweep.csv`` (point, final held-out success, reward, entropy, wall time),
``curves_<metric>.png`` and one run directory per point (``p00``, ``p01``, ...; a retry that
cannot continue its directory gets a fresh one, nothing is overwritten).

Two modes:
  * sequential (default): each point is a full ``train.main.run`` in its own run directory; a
    crashed point is recorded (``error.txt`` in its directory) and the sweep moves on; re-running
    the sweep continues unfinished points from their checkpoints.
  * vectorised (the experiment sets ``cfg.sweep_vectorized = True``): allowed when every point
    only changes keys in ``sweep_vmap.vmap_keys()`` (checked before anything runs): one compiled
    learner, ``jax.vmap`` of the RL update over the points' stacked states; SFT runs once,
    shared; rollouts and evaluations stay per point (``agentrl_jax.train.sweep_vmap``). Each
    point gets the run directory a sequential run would write; its numbers equal a sequential
    run's up to float rounding (``tests/train/test_sweep_vmap.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentrl_jax.config import ConfigDict, apply_overrides, load_config, sweep_points
from agentrl_jax.experiment import build, rl_config
from agentrl_jax.metrics import make_run_dir, save_config
from agentrl_jax.report import load_series, plot_sweep_curves, write_sweep_table
from agentrl_jax.train import sweep_vmap

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
TABLE_FILE = "sweep.csv"
COLUMNS = ("point", "label", "status", "heldout_success", "reward", "entropy", "wall_s")
PLOT_METRICS = ("rl/reward", "rl/entropy", "eval/heldout_success")
RunFn = Callable[..., dict]


def point_label(overrides: Mapping[str, Any]) -> str:
    """``{"rl.lr": 1e-4}`` -> ``"rl.lr=0.0001"`` (keys sorted)."""
    return ",".join(f"{k}={overrides[k]}" for k in sorted(overrides)) or "base"


# -- sweep state ---------------------------------------------------------------------------------


def _load_state(sweep_dir: str) -> dict:
    path = os.path.join(sweep_dir, SWEEP_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{sweep_dir!r} is not a sweep directory (no {SWEEP_FILE})")
    with open(path) as f:
        return json.load(f)


def _save_state(sweep_dir: str, state: dict) -> None:
    path = os.path.join(sweep_dir, SWEEP_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1, default=float)
    os.replace(path + ".tmp", path)


def _new_point_dir(sweep_dir: str, name: str) -> str:
    for k in range(1000):
        path = os.path.join(sweep_dir, name if k == 0 else f"{name}.{k}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"no free point directory for {name} in {sweep_dir}")


def _is_done(entry: dict) -> bool:
    return entry["status"] == "done" and os.path.isfile(
        os.path.join(entry.get("run_dir") or "", "summary.json")
    )


# -- the driver ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """What :func:`run_sweep` produced: the sweep directory, table rows and text, PNG paths."""

    sweep_dir: str
    rows: list[dict[str, Any]]
    table: str
    plots: list[str]


def run_sweep(
    spec: str | None,
    overrides: Sequence[str] = (),
    *,
    sweep_dir: str | None = None,
    run_fn: RunFn | None = None,
    progress: bool | None = False,
) -> SweepResult:
    """Runs (or continues) a sweep; see the module docstring.

    Args:
      spec: ``experiments/x.py[:arg]`` (None when continuing ``sweep_dir``).
      overrides: ``--set`` overrides applied to every point before its own.
      sweep_dir: an existing sweep directory to continue (its spec and overrides are used;
        finished points are skipped).
      run_fn: ``run_fn(cfg, resume_dir=..., progress=...) -> summary`` for sequential points
        (default ``train.main.run``; tests substitute a stub).
      progress: progress bars of the runs.

    Raises:
      ValueError: no sweep(add) in the experiment, a continued sweep whose spec or overrides
        differ, or a vectorised sweep over keys outside ``sweep_vmap.vmap_keys()`` or whose points
        differ in RL settings that are not traced (raised before the sweep directory is made).
    """
    if sweep_dir is not None:
        state = _load_state(sweep_dir)
        if spec is not None and spec != state["spec"]:
            raise ValueError(f"sweep {sweep_dir!r} ran {state['spec']!r}, not {spec!r}")
        if overrides and list(overrides) != state["overrides"]:
            raise ValueError(f"sweep {sweep_dir!r} ran with --set {state['overrides']}")
        spec = state["spec"]
    else:
        if spec is None:
            raise ValueError("give an experiment spec or a sweep directory")
        points = sweep_points(spec)
        if not points:
            raise ValueError(f"experiment {spec!r} has no sweep(add) points")
        base = load_config(spec, overrides)
        vectorized = bool(base.sweep_vectorized)
        if vectorized:
            _check_vectorized_points(spec, overrides, points)
        sweep_dir = make_run_dir(base.workdir, f"{base.name}-sweep")
        state = {
            "spec": spec,
            "overrides": list(overrides),
            "vectorized": vectorized,
            "points": [
                {"index": i, "label": point_label(p), "overrides": p, "status": "pending"}
                for i, p in enumerate(points)
            ],
        }
        _save_state(sweep_dir, state)
    overrides = state["overrides"]
    todo = [e for e in state["points"] if not _is_done(e)]
    log.info("sweep %s: %d points, %d to run", sweep_dir, len(state["points"]), len(todo))
    if todo and state["vectorized"]:
        _run_vectorized(spec, overrides, sweep_dir, state, todo, progress)
    else:
        for entry in todo:
            _run_point(spec, overrides, sweep_dir, state, entry, run_fn, progress)
    return _finish(sweep_dir, state)


def _point_config(spec: str, overrides: Sequence[str], entry: dict) -> ConfigDict:
    cfg = load_config(spec, overrides)
    return apply_overrides(cfg, entry["overrides"])


def _run_point(spec, overrides, sweep_dir, state, entry, run_fn, progress) -> None:
    if run_fn is None:
        from agentrl_jax.train.main import run as run_fn
    name = f"p{entry['index']:02d}"
    t0 = time.perf_counter()
    try:
        cfg = _point_config(spec, overrides, entry)
        if not entry.get("run_dir") or not os.path.isdir(entry["run_dir"]):
            entry["run_dir"] = _new_point_dir(sweep_dir, name)
            save_config(entry["run_dir"], cfg)
        entry["status"] = "running"
        _save_state(sweep_dir, state)
        log.info("sweep point %s (%s) -> %s", name, entry["label"], entry["run_dir"])
        summary = run_fn(cfg, resume_dir=entry["run_dir"], progress=progress)
        entry.update(status="done", error=None, summary=_plain_summary(summary))
    except Exception as e:  # noqa: BLE001 - a crashed point must not stop the sweep
        _record_failure(entry, e)
    entry["wall_s"] = round(time.perf_counter() - t0, 2)
    _save_state(sweep_dir, state)


def _plain_summary(summary: Mapping[str, Any]) -> dict:
    keep = ("heldout_success_after_rl", "entropy_end", "nonfinite_steps", "wall_s")
    return {k: summary.get(k) for k in keep}


def _last(series: dict, key: str) -> float | None:
    if key not in series:
        return None
    return float(series[key][1][-1])


def _finish(sweep_dir: str, state: dict) -> SweepResult:
    rows = []
    for e in state["points"]:
        s = e.get("summary") or {}
        series = {}
        if e.get("run_dir"):
            try:
                series = load_series(e["run_dir"])
            except ValueError:
                series = {}
        rows.append(
            {
                "point": f"p{e['index']:02d}",
                "label": e["label"],
                "status": e["status"] if e["status"] != "failed" else f"failed: {e['error']}",
                "heldout_success": s.get("heldout_success_after_rl"),
                "reward": _last(series, "rl/reward"),
                "entropy": s.get("entropy_end", _last(series, "rl/entropy")),
                "wall_s": e.get("wall_s"),
            }
        )
    table = write_sweep_table(rows, os.path.join(sweep_dir, TABLE_FILE), columns=COLUMNS)
    plots = []
    dirs = [e["run_dir"] for e in state["points"] if e.get("run_dir")]
    labels = [e["label"] for e in state["points"] if e.get("run_dir")]
    for metric in PLOT_METRICS:
        path = os.path.join(sweep_dir, f"curves_{metric.replace('/', '_')}.png")
        try:
            plots.append(plot_sweep_curves(dirs, metric, path, labels=labels))
        except ValueError as e:
            log.info("sweep plot of %s skipped: %s", metric, e)
    return SweepResult(sweep_dir=sweep_dir, rows=rows, table=table, plots=plots)


# -- vectorised driver ----------------------------------------------------------------------------


def _check_vectorized_points(spec: str, overrides: Sequence[str], points: list[dict]) -> None:
    """Up-front ``check_vectorizable`` over the points whose config builds (the others fail
    individually when the group runs)."""
    keys = {k for p in points for k in p}
    sweep_vmap.check_vectorizable([], keys)  # the keys first: cheap, before any config is built
    rl_cfgs = []
    for p in points:
        try:
            rl_cfgs.append(rl_config(apply_overrides(load_config(spec, overrides), p).rl))
        except Exception:  # noqa: BLE001, S112 - reported per point when the group runs
            continue
    sweep_vmap.check_vectorizable(rl_cfgs, keys)


def _record_failure(entry: dict, exc: BaseException) -> None:
    """Marks ``entry`` failed; writes the traceback to ``error.txt`` (call inside ``except``)."""
    entry.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    log.error("sweep point p%02d (%s) failed: %s", entry["index"], entry["label"], entry["error"])
    if entry.get("run_dir") and os.path.isdir(entry["run_dir"]):
        with open(os.path.join(entry["run_dir"], "error.txt"), "w") as f:
            f.write(traceback.format_exc())


def _run_vectorized(spec, overrides, sweep_dir, state, todo, progress) -> None:
    """Runs the points ``todo`` as one vectorised group (``sweep_vmap.run_group``)."""
    t0 = time.perf_counter()
    points: list[sweep_vmap.Point] = []
    for e in todo:  # a point whose config does not build fails alone
        try:
            cfg = _point_config(spec, overrides, e)
            points.append(sweep_vmap.Point(e, cfg, build(cfg)))
        except Exception as exc:  # noqa: BLE001
            _record_failure(e, exc)
    failed = lambda p, exc: _record_failure(p.entry, exc)  # noqa: E731
    try:
        for p in points:
            p.entry.update(run_dir=_new_point_dir(sweep_dir, f"p{p.entry['index']:02d}"))
            p.entry["status"] = "running"
        _save_state(sweep_dir, state)
        if not points:
            raise sweep_vmap.GroupDone
        base = load_config(spec, overrides)
        done = sweep_vmap.run_group(points, base, sweep_dir, failed, progress)
        for p in points:
            if p.entry["index"] in done:
                summary = _plain_summary(done[p.entry["index"]])
                p.entry.update(status="done", error=None, summary=summary)
    except sweep_vmap.GroupDone:
        pass
    except Exception as exc:  # noqa: BLE001 - a shared stage failed: report the group's points
        log.error("vectorised sweep group failed: %s", exc)
        for p in points:
            if p.entry["status"] != "done":
                _record_failure(p.entry, exc)
            p.close()
    wall = round(time.perf_counter() - t0, 2)
    for e in todo:
        e["wall_s"] = wall  # one shared learner: the group's wall time
    _save_state(sweep_dir, state)


def run_from_cli(args) -> int:
    """``agentrl sweep SPEC|SWEEP_DIR [--set k=v ...] [--resume SWEEP_DIR]``.

    Prints the table and the sweep directory; exit code 1 if any point failed.
    """
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    overrides = list(getattr(args, "set", None) or [])
    resume = getattr(args, "resume", None)
    spec = args.spec
    if resume is None and spec and os.path.isdir(spec):
        resume, spec = spec, None
    result = run_sweep(spec, overrides, sweep_dir=resume, progress=None)
    print(result.table)
    print(f"sweep: {result.sweep_dir}")
    for path in result.plots:
        print(f"plot: {path}")
    failed = [r for r in result.rows if str(r["status"]).startswith("failed")]
    return 1 if failed else 0


__all__ = ["COLUMNS", "SweepResult", "point_label", "run_from_cli", "run_sweep"]
