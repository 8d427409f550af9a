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
    only changes keys in ``VMAP_KEYS``. What is vectorised: the learner. SFT and the held-out
    evaluation before RL run once (shared); then every RL step plays each point's rollouts with
    that point's own parameters and seed (host loop, sequential: environments are Python) and
    applies ONE jitted ``jax.vmap``-ed update to all points at once, the swept values
    (lr, weight decay, PPO clip bounds) being traced arrays [P] - one compile for the whole
    sweep instead of one per point. What is not: rollouts, advantages, evaluation after RL
    (per point, sequential), checkpoints (a vectorised group is all-or-nothing: an interrupted
    group re-runs its unfinished points from the start), the precision fallback (non-finite
    updates are still skipped) and multi-update steps (needs ppo_epochs = n_minibatches = 1 and
    old_logprobs = 'recompute', the default experiment's setting). Entropy / KL coefficients are
    not vectorisable: ``policy_loss`` branches on them in Python.
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from agentrl_jax.config import ConfigDict, apply_overrides, load_config, sweep_points
from agentrl_jax.metrics import make_run_dir, save_config
from agentrl_jax.report import load_series, plot_sweep_curves, write_sweep_table

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.json"
TABLE_FILE = "sweep.csv"
COLUMNS = ("point", "label", "status", "heldout_success", "reward", "entropy", "wall_s")
PLOT_METRICS = ("rl/reward", "rl/entropy", "eval/heldout_success")
# swept key -> name of the traced hyperparameter of the vectorised learner ("" = host side only)
VMAP_KEYS = {
    "rl.lr": "lr",
    "rl.weight_decay": "weight_decay",
    "rl.loss.clip_low": "clip_low",
    "rl.loss.clip_high": "clip_high",
    "seed": "",
}
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
        differ, or a vectorised sweep over keys outside ``VMAP_KEYS``.
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
        sweep_dir = make_run_dir(base.workdir, f"{base.name}-sweep")
        state = {
            "spec": spec,
            "overrides": list(overrides),
            "vectorized": bool(base.get("sweep_vectorized", False)),
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
        entry.update(status="failed", error=f"{type(e).__name__}: {e}")
        log.error("sweep point %s (%s) failed: %s", name, entry["label"], entry["error"])
        if entry.get("run_dir") and os.path.isdir(entry["run_dir"]):
            with open(os.path.join(entry["run_dir"], "error.txt"), "w") as f:
                f.write(traceback.format_exc())
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


# -- vectorised learner ---------------------------------------------------------------------------


class VecState(NamedTuple):
    """Per-point learner state, every leaf stacked over the P sweep points.

    Attributes:
      params: model parameters [P, ...].
      opt_state: clip + Adam moments [P, ...] (the learning rate and weight decay are applied
        outside, from the swept values).
      count: int32 [P], applied optimiser updates (drives the warmup/cosine schedule).
      nonfinite: int32 [P], skipped (non-finite) updates.
    """

    params: Any
    opt_state: Any
    count: jax.Array
    nonfinite: jax.Array


def _core_tx(rl_cfg) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(rl_cfg.grad_clip)] if rl_cfg.grad_clip is not None else []
    parts.append(optax.scale_by_adam(b1=rl_cfg.b1, b2=rl_cfg.b2, eps=rl_cfg.eps))
    return optax.chain(*parts)


def _traced_rl_config(rl_cfg, clip_low, clip_high):
    """A copy of ``rl_cfg`` whose loss clip bounds are traced values (no validation: the
    per-point configs were validated on the host; ``policy_loss`` uses them arithmetically)."""
    from agentrl_jax.rl.losses import LossConfig
    from agentrl_jax.rl.state import RLConfig

    loss = object.__new__(LossConfig)
    for f in dataclasses.fields(LossConfig):
        object.__setattr__(loss, f.name, getattr(rl_cfg.loss, f.name))
    object.__setattr__(loss, "clip_low", clip_low)
    object.__setattr__(loss, "clip_high", clip_high)
    out = object.__new__(RLConfig)
    for f in dataclasses.fields(RLConfig):
        object.__setattr__(out, f.name, getattr(rl_cfg, f.name))
    object.__setattr__(out, "loss", loss)
    return out


def make_vmapped_update(model, rl_cfg, sampling_meta=None):
    """``(init_fn, update_fn)`` of a learner vectorised over P sweep points.

    ``init_fn(params_stacked) -> VecState``; ``update_fn(state, data, hp) -> (state, metrics)``
    is one jitted ``jax.vmap`` of a single RL update (fused logprob recompute, one optimiser
    update, non-finite skip), identical in value to ``rl.update.make_update_fn`` with the
    point's config: clip_by_global_norm -> Adam -> ``-(lr * schedule(count)) * (u + wd * p)``
    (decay on ndim >= 2 parameters), i.e. optax.adamw with the swept values as traced inputs.

    Args:
      model: the Transformer (shared architecture and dtype policy).
      rl_cfg: the base RLConfig (non-swept knobs, static).
      sampling_meta: chunk geometry for parity policies.

    ``data`` is ``rl.update.prepare_batch`` output stacked over points ([P, B, ...]); ``hp`` maps
    ``lr``, ``weight_decay``, ``clip_low``, ``clip_high`` to f32 [P]. Metrics are f32 [P].

    Raises:
      ValueError: ppo_epochs or n_minibatches != 1, or old_logprobs != 'recompute'.
    """
    from agentrl_jax.rl.logprobs import as_chunk_spec
    from agentrl_jax.rl.mismatch import mismatch_metrics
    from agentrl_jax.rl.state import learning_rate_schedule
    from agentrl_jax.rl.update import make_grad_fn

    for field, want in (("ppo_epochs", 1), ("n_minibatches", 1), ("old_logprobs", "recompute")):
        if getattr(rl_cfg, field) != want:
            raise ValueError(
                f"vectorised sweeps need RLConfig.{field}={want!r}, got {getattr(rl_cfg, field)!r}"
            )
    spec = as_chunk_spec(sampling_meta)
    core = _core_tx(rl_cfg)
    unit_schedule = learning_rate_schedule(rl_cfg.replace(lr=1.0))

    def init_fn(params_stacked) -> VecState:
        p = jax.tree.leaves(params_stacked)[0].shape[0]
        zero = jnp.zeros((p,), jnp.int32)
        return VecState(params_stacked, jax.vmap(core.init)(params_stacked), zero, zero + 0)

    def one(state: VecState, data: dict, hp: dict):
        grad_fn = make_grad_fn(
            model, _traced_rl_config(rl_cfg, hp["clip_low"], hp["clip_high"]), None, spec
        )
        rows = {k: v for k, v in data.items() if k != "rollout_routes"}
        grads, metrics, aux = grad_fn(state.params, rows)
        gnorm = optax.global_norm(grads)
        u, new_opt = core.update(grads, state.opt_state, state.params)
        lr = hp["lr"] * unit_schedule(state.count)
        u = jax.tree.map(
            lambda g, p: -lr * (g + hp["weight_decay"] * p) if jnp.ndim(p) >= 2 else -lr * g,
            u,
            state.params,
        )
        ok = (
            jnp.isfinite(metrics["loss"]) & jnp.isfinite(gnorm) & jnp.isfinite(optax.global_norm(u))
        )
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        new_state = VecState(
            params=keep(optax.apply_updates(state.params, u), state.params),
            opt_state=keep(new_opt, state.opt_state),
            count=state.count + ok.astype(jnp.int32),
            nonfinite=state.nonfinite + (~ok).astype(jnp.int32),
        )
        metrics = dict(metrics, grad_norm=gnorm, skipped=(~ok).astype(jnp.float32))
        if "logp_rollout" in data:
            mm = mismatch_metrics(aux["logp"], data["logp_rollout"], data["mask"])
            metrics |= {f"mismatch/{k}": v for k, v in mm.items()}
        return new_state, metrics

    return init_fn, jax.jit(jax.vmap(one))


def hyperparams(rl_cfgs: Sequence[Any]) -> dict[str, jax.Array]:
    """The traced hyperparameters (f32 [P]) of the vectorised learner from per-point RLConfigs."""
    return {
        "lr": jnp.asarray([c.lr for c in rl_cfgs], jnp.float32),
        "weight_decay": jnp.asarray([c.weight_decay for c in rl_cfgs], jnp.float32),
        "clip_low": jnp.asarray([c.loss.clip_low for c in rl_cfgs], jnp.float32),
        "clip_high": jnp.asarray([c.loss.clip_high for c in rl_cfgs], jnp.float32),
    }


def check_vectorizable(rl_cfgs: Sequence[Any], keys: set[str]) -> None:
    """Raises ``ValueError`` if a swept key is not vectorisable or the static knobs differ."""
    bad = sorted(k for k in keys if k not in VMAP_KEYS)
    if bad:
        raise ValueError(
            f"sweep_vectorized=True cannot vectorise {bad}; allowed keys: {sorted(VMAP_KEYS)} "
            "(set sweep_vectorized=False to run the points sequentially)"
        )
    traced = {"lr", "weight_decay"}
    strip = lambda c: c.replace(
        loss=dataclasses.replace(c.loss, clip_low=0.5, clip_high=0.5),
        **{k: getattr(rl_cfgs[0], k) for k in traced},
    )
    if len({strip(c) for c in rl_cfgs}) != 1:
        raise ValueError("vectorised points differ in RL settings that are not traced")


def _row(tree, p: int):
    return jax.tree.map(lambda a: a[p], tree)


class _Capture:
    """Stands in for RLRun's update controller: keeps the batch, leaves the state alone."""

    def __init__(self, active):
        self.active = active
        self.batch = None

    def __call__(self, state, batch, rng):
        self.batch = batch
        return state, {}


def _run_vectorized(spec, overrides, sweep_dir, state, todo, progress) -> None:
    from agentrl_jax.config import to_dataclass
    from agentrl_jax.metrics import MetricsWriter
    from agentrl_jax.model.config import ModelConfig
    from agentrl_jax.model.transformer import Transformer, init_params
    from agentrl_jax.precision import get_policy
    from agentrl_jax.rl.update import prepare_batch
    from agentrl_jax.train.checkpoint import stage_dir
    from agentrl_jax.train.rl_loop import LoopConfig, RLRun, _eval, _mode, rl_config
    from agentrl_jax.train.sft import SFTConfig, run_sft

    t0 = time.perf_counter()
    try:
        base = load_config(spec, overrides)
        cfgs = [_point_config(spec, overrides, e) for e in todo]
        rl_cfgs = [rl_config(c.rl) for c in cfgs]
        check_vectorizable(rl_cfgs, {k for e in todo for k in e["overrides"]})
        model_cfg = to_dataclass(base.model, ModelConfig)
        policy = get_policy(base.policy)
        loop = to_dataclass(base.train, LoopConfig)
        shared = os.path.join(sweep_dir, "shared")
        os.makedirs(shared, exist_ok=True)
        if loop.sft:
            done = os.path.isdir(stage_dir(shared, "sft")) and os.listdir(stage_dir(shared, "sft"))
            sft_cfg = to_dataclass(base.sft, SFTConfig)
            params, _ = run_sft(
                model_cfg, policy, sft_cfg, shared, resume=bool(done), progress=progress
            )
        else:
            params = init_params(Transformer(model_cfg, policy), jax.random.key(base.seed))
        before = _eval(model_cfg, policy, params, base.eval) if loop.eval_before else None
        runs, writers = [], []
        for e, c in zip(todo, cfgs):
            e["run_dir"] = _new_point_dir(sweep_dir, f"p{e['index']:02d}")
            e["status"] = "running"
            save_config(e["run_dir"], c)
            runs.append(RLRun(c, e["run_dir"], params, resume=False))
            runs[-1].controller = _Capture(runs[-1].controller.active)
            writers.append(MetricsWriter(e["run_dir"]))
            if before is not None:
                writers[-1].write(0, {"heldout_success": _mode(before, "success")}, prefix="eval")
        _save_state(sweep_dir, state)
        model = Transformer(model_cfg, policy)
        init_fn, update_fn = make_vmapped_update(model, rl_cfgs[0], runs[0].sampling)
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        vstate = init_fn(stack([jax.tree.map(jnp.copy, params)] * len(runs)))
        hp = hyperparams(rl_cfgs)
        entropies = [[] for _ in runs]
        for step in range(loop.rl_steps):
            step_metrics, data = [], []
            for p, rl in enumerate(runs):
                rl.state = rl.state._replace(params=_row(vstate.params, p))
                step_metrics.append(rl.step(step))
                data.append(prepare_batch(rl.controller.batch, rl.rl_cfg, model))
            t1 = time.perf_counter()
            vstate, vm = update_fn(vstate, stack(data), hp)
            vm = jax.device_get(vm)
            upd_s = (time.perf_counter() - t1) / len(runs)
            for p, (rl, w) in enumerate(zip(runs, writers)):
                m = step_metrics[p] | {k: float(v[p]) for k, v in vm.items()}
                m["update_s"] = upd_s
                m.pop("update_tokens_per_s", None)
                rl.state = rl.state._replace(step=rl.state.step + 1)
                entropies[p].append(m["entropy"])
                w.write(step + 1, m, prefix="rl")
            log.info("vectorised sweep step %d/%d done", step + 1, loop.rl_steps)
        for p, (e, rl, w) in enumerate(zip(todo, runs, writers)):
            final = _row(vstate.params, p)
            after = _eval(model_cfg, policy, final, cfgs[p].eval)
            w.write(loop.rl_steps, {"heldout_success": _mode(after, "success")}, prefix="eval")
            w.close()
            rl.ckpt.close()
            summary = {
                "heldout_success_before_rl": _mode(before, "success") if before else None,
                "heldout_success_after_rl": _mode(after, "success"),
                "goal_adherence_after_rl": _mode(after, "goal_adherence"),
                "entropy_start": entropies[p][0] if entropies[p] else None,
                "entropy_end": entropies[p][-1] if entropies[p] else None,
                "nonfinite_steps": int(vstate.nonfinite[p]),
                "rl_steps": loop.rl_steps,
                "wall_s": round(time.perf_counter() - t0, 1),
                "run_dir": e["run_dir"],
                "vectorized": True,
            }
            with open(os.path.join(e["run_dir"], "summary.json"), "w") as f:
                json.dump(summary, f, default=float)
            e.update(status="done", error=None, summary=_plain_summary(summary))
    except Exception as exc:  # noqa: BLE001 - report the group's failure, keep the sweep file
        log.error("vectorised sweep group failed: %s", exc)
        for e in todo:
            if e["status"] != "done":
                e.update(status="failed", error=f"{type(exc).__name__}: {exc}")
                if e.get("run_dir") and os.path.isdir(e["run_dir"]):
                    with open(os.path.join(e["run_dir"], "error.txt"), "w") as f:
                        f.write(traceback.format_exc())
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
