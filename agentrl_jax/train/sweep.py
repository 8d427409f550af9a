"""``agentrl sweep``: run an experiment's ``sweep(add)`` points, then tabulate and plot them.

    agentrl sweep experiments/sweep_lr.py:smoke=True [--set k=v ...]
    agentrl sweep runs/sweep_lr-sweep-20250101-120000       (re-run: finished points are skipped)

Layout: ``<workdir>/<name>-sweep-<timestamp>/`` holds ``sweep.json`` (spec, overrides, one entry per
point with its status), ``sweep.csv`` (point, final held-out success, reward, entropy, wall time),
``curves_<metric>.png`` and one run directory per point (``p00``, ``p01``, ...; a retry that
cannot continue its directory gets a fresh one, nothing is overwritten).

Two modes:
  * sequential (default): each point is a full ``rl_loop.run`` in its own run directory; a
    crashed point is recorded (``error.txt`` in its directory) and the sweep moves on; re-running
    the sweep continues unfinished points from their checkpoints.
  * vectorised (the experiment sets ``cfg.sweep_vectorized = True``): allowed when every point
    only changes keys in ``VMAP_KEYS`` (checked before anything runs). What is vectorised: the
    learner (``agentrl_jax.train.sweep_vmap``). SFT runs once, shared (it depends only on
    ``sft.*``, which points cannot change); without SFT or ``init_from`` each point starts from
    ``init_params`` with its own seed, as a sequential run would. Every RL step plays each
    point's rollouts with that point's own parameters and seed (host loop, sequential:
    environments are Python) and applies ONE jitted ``jax.vmap``-ed update to all points at
    once, the swept values (lr, weight decay, PPO clip bounds) being traced arrays [P] - one
    compile for the whole sweep instead of one per point. Each point then gets the run
    directory a sequential run would write: metrics, summary and a final RL checkpoint (params,
    optimiser state in ``make_optimizer``'s layout, data-pipeline state); its numbers equal a
    sequential run's up to float rounding (``tests/train/test_sweep_vmap.py``). A point whose
    config is invalid or whose rollouts raise is recorded as failed (``error.txt``) and dropped
    from the group; the others go on. Not vectorised: rollouts, advantages, evaluation (per
    point, sequential), intermediate checkpoints (an interrupted group re-runs its unfinished
    points from the start), the precision fallback (non-finite updates are still skipped) and
    multi-update steps (needs ppo_epochs = n_minibatches = 1 and old_logprobs = 'recompute',
    the default experiment's setting). Entropy / KL coefficients are not vectorisable:
    ``policy_loss`` branches on them in Python.
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

import jax
import jax.numpy as jnp

from agentrl_jax.config import ConfigDict, apply_overrides, load_config, sweep_points
from agentrl_jax.metrics import make_run_dir, save_config
from agentrl_jax.report import load_series, plot_sweep_curves, write_sweep_table
from agentrl_jax.train.sweep_vmap import (
    VMAP_KEYS,
    VecState,
    check_vectorizable,
    hyperparams,
    make_vmapped_update,
    sequential_opt_state,
    take_points,
)

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
        (default ``rl_loop.run``; tests substitute a stub).
      progress: progress bars of the runs.

    Raises:
      ValueError: no sweep(add) in the experiment, a continued sweep whose spec or overrides
        differ, or a vectorised sweep over keys outside ``VMAP_KEYS`` or whose points differ in
        RL settings that are not traced (raised before the sweep directory is created).
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
        vectorized = bool(base.get("sweep_vectorized", False))
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
        from agentrl_jax.train.rl_loop import run as run_fn
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
    from agentrl_jax.train.rl_loop import rl_config

    keys = {k for p in points for k in p}
    check_vectorizable([], keys)  # the keys first: cheap, before any config is built
    rl_cfgs = []
    for p in points:
        try:
            rl_cfgs.append(rl_config(apply_overrides(load_config(spec, overrides), p).rl))
        except Exception:  # noqa: BLE001, S112 - reported per point when the group runs
            continue
    check_vectorizable(rl_cfgs, keys)


def _record_failure(entry: dict, exc: BaseException) -> None:
    """Marks ``entry`` failed; writes the traceback to ``error.txt`` (call inside ``except``)."""
    entry.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    log.error("sweep point p%02d (%s) failed: %s", entry["index"], entry["label"], entry["error"])
    if entry.get("run_dir") and os.path.isdir(entry["run_dir"]):
        with open(os.path.join(entry["run_dir"], "error.txt"), "w") as f:
            f.write(traceback.format_exc())


class _Capture:
    """Stands in for RLRun's update controller: keeps the batch, leaves the state alone (the
    fallback controller's other attributes, read by checkpoints, are passed through)."""

    def __init__(self, controller):
        self._controller = controller
        self.batch = None

    def __getattr__(self, name):
        return getattr(self._controller, name)

    def __call__(self, state, batch, rng):
        self.batch = batch
        return state, {}


@dataclasses.dataclass
class _Point:
    """One live point of a vectorised group (host side)."""

    entry: dict
    cfg: ConfigDict
    rl_cfg: Any
    init_key: Any = None  # which initial parameters (None: shared)
    rl: Any = None  # RLRun
    writer: Any = None
    entropies: list = dataclasses.field(default_factory=list)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.rl is not None and self.rl.ckpt is not None:
            self.rl.ckpt.close()
            self.rl.ckpt = None


def _run_vectorized(spec, overrides, sweep_dir, state, todo, progress) -> None:
    from agentrl_jax.config import to_dataclass
    from agentrl_jax.metrics import MetricsWriter
    from agentrl_jax.model.config import ModelConfig
    from agentrl_jax.model.transformer import Transformer, init_params
    from agentrl_jax.precision import get_policy
    from agentrl_jax.train.checkpoint import stage_dir
    from agentrl_jax.train.rl_loop import (
        LoopConfig,
        RLRun,
        _eval,
        _mode,
        initial_params,
        rl_config,
    )
    from agentrl_jax.train.sft import SFTConfig, run_sft

    t0 = time.perf_counter()
    points: list[_Point] = []
    for e in todo:  # a point whose config does not build fails alone
        try:
            c = _point_config(spec, overrides, e)
            points.append(_Point(e, c, rl_config(c.rl)))
        except Exception as exc:  # noqa: BLE001
            _record_failure(e, exc)
    try:
        if not points:
            raise _GroupDone
        keys = {k for p in points for k in p.entry["overrides"]}
        check_vectorizable([p.rl_cfg for p in points], keys)
        base = load_config(spec, overrides)
        model_cfg = to_dataclass(base.model, ModelConfig)
        policy = get_policy(base.policy)
        model = Transformer(model_cfg, policy)
        loop = to_dataclass(base.train, LoopConfig)
        # initial parameters: shared SFT / init_from, else each point's own seed (as rl_loop.run)
        initial: dict[Any, Any] = {}
        if loop.sft:
            shared = os.path.join(sweep_dir, "shared")
            os.makedirs(shared, exist_ok=True)
            done = os.path.isdir(stage_dir(shared, "sft")) and os.listdir(stage_dir(shared, "sft"))
            sft_cfg = to_dataclass(base.sft, SFTConfig)
            initial[None], _ = run_sft(
                model_cfg, policy, sft_cfg, shared, resume=bool(done), progress=progress
            )
        elif loop.init_from:
            template = init_params(model, jax.random.key(base.seed))
            initial[None] = initial_params(loop.init_from, template)
        else:
            for p in points:
                p.init_key = int(p.cfg.seed)
                if p.init_key not in initial:
                    initial[p.init_key] = init_params(model, jax.random.key(p.init_key))
        before = (
            {k: _eval(model_cfg, policy, v, base) for k, v in initial.items()}
            if loop.eval_before
            else {}
        )
        for p in list(points):
            e = p.entry
            try:
                e["run_dir"] = _new_point_dir(sweep_dir, f"p{e['index']:02d}")
                e["status"] = "running"
                save_config(e["run_dir"], p.cfg)
                p.rl = RLRun(p.cfg, e["run_dir"], initial[p.init_key], resume=False)
                p.rl.controller = _Capture(p.rl.controller)
                p.writer = MetricsWriter(e["run_dir"])
                if p.init_key in before:
                    ev = {"heldout_success": _mode(before[p.init_key], "success")}
                    p.writer.write(0, ev, prefix="eval")
            except Exception as exc:  # noqa: BLE001
                _record_failure(e, exc)
                p.close()
                points.remove(p)
        _save_state(sweep_dir, state)
        if not points:
            raise _GroupDone
        init_fn, update_fn = make_vmapped_update(model, points[0].rl_cfg, points[0].rl.sampling)
        vstate = init_fn(_stack([jax.tree.map(jnp.copy, initial[p.init_key]) for p in points]))
        hp = hyperparams([p.rl_cfg for p in points])
        for step in range(loop.rl_steps):
            vstate, hp = _vec_step(points, step, vstate, hp, update_fn, model)
            _save_state(sweep_dir, state)
            if not points:
                raise _GroupDone
            log.info("vectorised sweep step %d/%d done", step + 1, loop.rl_steps)
        for i, p in enumerate(points):
            try:
                _finish_point(p, i, vstate, loop, before, t0)
            except Exception as exc:  # noqa: BLE001
                _record_failure(p.entry, exc)
            p.close()
    except _GroupDone:
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


def _row(tree, i: int):
    return jax.tree.map(lambda a: a[i], tree)


def _stack(trees: list):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


class _GroupDone(Exception):
    """No live point left in a vectorised group."""


def _vec_step(points, step, vstate, hp, update_fn, model):
    """One RL step of a vectorised group: per-point rollouts, then one vmapped update. Points
    whose rollouts raise are recorded, closed and dropped (``points`` is updated in place)."""
    from agentrl_jax.rl.update import prepare_batch

    metrics, data, alive = [], [], []
    for i, p in enumerate(points):
        try:
            p.rl.state = p.rl.state._replace(params=_row(vstate.params, i))
            metrics.append(p.rl.step(step))
            data.append(prepare_batch(p.rl.controller.batch, p.rl.rl_cfg, model))
            alive.append(i)
        except Exception as exc:  # noqa: BLE001 - one point's crash must not stop the others
            _record_failure(p.entry, exc)
            p.close()
    if len(alive) < len(points):
        vstate, hp = take_points(vstate, alive), take_points(hp, alive)
        points[:] = [points[i] for i in alive]
        if not points:
            return vstate, hp
    t1 = time.perf_counter()
    vstate, vm = update_fn(vstate, _stack(data), hp)
    vm = jax.device_get(vm)
    upd_s = (time.perf_counter() - t1) / len(points)
    for i, (p, m) in enumerate(zip(points, metrics)):
        m = m | {k: float(v[i]) for k, v in vm.items()}
        m["update_s"] = upd_s
        m.pop("update_tokens_per_s", None)
        p.rl.state = p.rl.state._replace(step=p.rl.state.step + 1)
        p.entropies.append(m["entropy"])
        p.writer.write(step + 1, m, prefix="rl")
    return vstate, hp


def _finish_point(p: _Point, i: int, vstate: VecState, loop, before: dict, t0: float) -> None:
    """Evaluation after RL, the final checkpoint and the summary of live point ``i``."""
    from agentrl_jax.train.rl_loop import _eval, _mode

    e = p.entry
    final = _row(vstate.params, i)
    after = _eval(p.rl.model_cfg, p.rl.policy, final, p.cfg)
    p.writer.write(loop.rl_steps, {"heldout_success": _mode(after, "success")}, prefix="eval")
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    p.rl.state = p.rl.state._replace(
        params=final,
        opt_state=sequential_opt_state(p.rl_cfg, final, vstate, i),
        nonfinite_count=i32(vstate.nonfinite[i]),
    )
    p.rl.save(loop.rl_steps)
    b = before.get(p.init_key)
    summary = {
        "heldout_success_before_rl": _mode(b, "success") if b else None,
        "heldout_success_after_rl": _mode(after, "success"),
        "goal_adherence_before_rl": _mode(b, "goal_adherence") if b else None,
        "goal_adherence_after_rl": _mode(after, "goal_adherence"),
        "heldout_sampled_success_after_rl": after.get("sampled", {}).get("success"),
        "entropy_start": p.entropies[0] if p.entropies else None,
        "entropy_end": p.entropies[-1] if p.entropies else None,
        "nonfinite_steps": int(vstate.nonfinite[i]),
        "rl_steps": loop.rl_steps,
        "wall_s": round(time.perf_counter() - t0, 1),
        "run_dir": e["run_dir"],
        "vectorized": True,
    }
    with open(os.path.join(e["run_dir"], "summary.json"), "w") as f:
        json.dump(summary, f, default=float)
    e.update(status="done", error=None, summary=_plain_summary(summary))


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


__all__ = [
    "COLUMNS",
    "VMAP_KEYS",
    "SweepResult",
    "VecState",
    "check_vectorizable",
    "hyperparams",
    "make_vmapped_update",
    "point_label",
    "run_from_cli",
    "run_sweep",
]
