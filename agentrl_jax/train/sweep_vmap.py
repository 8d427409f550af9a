"""The vectorised sweep (``cfg.sweep_vectorized = True``): ``jax.vmap`` of the one RL update.

A group of P sweep points shares one learner program: every point's ``TrainState`` is stacked
over points ([P, ...]) and ``jax.jit(jax.vmap(rl.update.make_update(...)))`` updates them all at
once. What differs between points lives in the state: the learning rate and weight decay in the
optimiser state (``optax.inject_hyperparams``), the hyperparameters the registered loss declares
``traced`` (``rl.losses.register_loss``; ``ppo``: the clip bounds) in ``state.hparams``, the seed
in the initial parameters and the rollouts. The whole group compiles one update.

The driver (``run_group``) runs SFT once (shared: it depends on ``sft.*`` only, which points
cannot change), then every RL step plays each point's rollouts with that point's own parameters
and seed (``RLRun.collect`` + ``RLRun.score``, sequential: environments are Python) and applies
the one vmapped update. Each point then gets the run directory a sequential run writes (metrics,
summary, final RL checkpoint in the sequential layout). A point whose config is invalid or whose
rollouts raise is recorded as failed and dropped from the group. Not vectorised: rollouts,
advantages, evaluation, intermediate checkpoints (an interrupted group re-runs its unfinished
points), the precision fallback, and multi-update steps (``ppo_epochs = n_minibatches = 1`` and
``old_logprobs = 'recompute'``, the default experiment's). Entropy / KL coefficients and the
other shared loss terms are not vectorisable: ``policy_loss`` branches on them in Python.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from agentrl_jax.config import ConfigDict
from agentrl_jax.experiment import Sections, build
from agentrl_jax.metrics import MetricsWriter, save_config
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rl.losses import get_loss, loss_names
from agentrl_jax.rl.state import RLConfig, TrainState
from agentrl_jax.rl.update import make_update
from agentrl_jax.train import stages
from agentrl_jax.train.rl_loop import RLRun, update_batch

log = logging.getLogger(__name__)

# swept keys every vectorised group may vary, besides its loss's traced hyperparameters
BASE_VMAP_KEYS = ("rl.lr", "rl.weight_decay", "seed")


def vmap_keys(loss_name: str | None = None) -> tuple[str, ...]:
    """Swept keys a vectorised group may vary (the rest of the config is shared):
    ``BASE_VMAP_KEYS`` and ``rl.loss.<field>`` for the fields the registered loss ``loss_name``
    declares ``traced``; with None, those of every registered loss.

    Raises:
      ValueError: ``loss_name`` is not registered.
    """
    names = loss_names() if loss_name is None else (loss_name,)
    traced = sorted({f for n in names for f in get_loss(n).traced})
    return BASE_VMAP_KEYS + tuple(f"rl.loss.{f}" for f in traced)


def with_hparams(state: TrainState, rl_cfg: RLConfig) -> TrainState:
    """A point's learner state for the vmapped update: its loss's traced hyperparameters as
    ``hparams`` (its lr and weight decay are already in its optimiser state)."""
    loss = rl_cfg.loss
    traced = get_loss(loss.name).traced
    return state._replace(hparams={f: jnp.asarray(getattr(loss, f), jnp.float32) for f in traced})


def stack(trees: Sequence[Any]):
    """Stacks pytrees of equal structure along a new leading point axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def take(tree, index: Sequence[int] | int):
    """Rows ``index`` of every leaf of a point-stacked pytree (an int drops the point axis)."""
    idx = index if isinstance(index, int) else jnp.asarray(list(index), jnp.int32)
    return jax.tree.map(lambda a: a[idx], tree)


def make_vmapped_update(model: Transformer, rl_cfg: RLConfig, sampling_meta=None) -> Callable:
    """``jax.jit(jax.vmap(make_update(model, rl_cfg, None, sampling_meta)))``: updates a stacked
    ``TrainState`` with a stacked batch (rng from each point's state).

    Raises:
      ValueError: ``ppo_epochs`` or ``n_minibatches`` != 1, or ``old_logprobs`` != 'recompute'
        (each point's updates would permute its batch from its own key: not vectorised).
    """
    for field, want in (("ppo_epochs", 1), ("n_minibatches", 1), ("old_logprobs", "recompute")):
        if getattr(rl_cfg, field) != want:
            raise ValueError(
                f"vectorised sweeps need RLConfig.{field}={want!r}, got {getattr(rl_cfg, field)!r}"
            )
    return jax.jit(jax.vmap(make_update(model, rl_cfg, None, sampling_meta)), donate_argnums=0)


def check_vectorizable(rl_cfgs: Sequence[RLConfig], keys: set[str]) -> None:
    """Raises ``ValueError`` if a swept key is not in ``vmap_keys`` (of the points' loss; of
    any registered loss when ``rl_cfgs`` is empty) or the points' RL configs differ in a field
    that is not traced."""
    allowed = set(vmap_keys())
    for c in rl_cfgs:
        allowed &= set(vmap_keys(c.loss.name))
    bad = sorted(k for k in keys if k not in allowed)
    if bad:
        raise ValueError(
            f"sweep_vectorized=True cannot vectorise {bad}; allowed keys: {sorted(allowed)} "
            "(set sweep_vectorized=False to run the points sequentially)"
        )

    def strip(c: RLConfig) -> RLConfig:  # the point's config without what is traced
        traced = get_loss(c.loss.name).traced
        loss = c.loss.with_traced(**dict.fromkeys(traced))
        return c.replace(loss=loss, lr=1.0, weight_decay=0.0)

    if len({strip(c) for c in rl_cfgs}) > 1:
        raise ValueError("vectorised points differ in RL settings that are not traced")


@dataclasses.dataclass
class Point:
    """One live point of a vectorised group (host side)."""

    entry: dict
    cfg: ConfigDict
    sections: Sections
    rl: RLRun | None = None
    writer: MetricsWriter | None = None
    entropies: list = dataclasses.field(default_factory=list)

    @property
    def init_key(self) -> int | None:
        """Which initial parameters the point starts from (None: the shared SFT/init_from)."""
        loop = self.sections.train
        return None if loop.sft or loop.init_from else int(self.cfg.seed)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.rl is not None and self.rl.ckpt is not None:
            self.rl.ckpt.close()
            self.rl.ckpt = None


class GroupDone(Exception):
    """No live point left in a vectorised group."""


def start_group(points: list[Point], base: ConfigDict, sweep_dir: str, progress) -> dict:
    """The initial parameters of the group (``stages.start_params``: SFT once in
    ``<sweep_dir>/shared``, else ``init_from``, else each point's own seed), by ``init_key``."""
    shared = os.path.join(sweep_dir, "shared")
    os.makedirs(shared, exist_ok=True)
    initial: dict[Any, Any] = {}
    for p in points:
        if p.init_key not in initial:
            seed = base.seed if p.init_key is None else p.init_key
            initial[p.init_key] = stages.start_params(
                p.sections, seed, shared, resume=True, progress=progress
            )
    return initial


def open_point(p: Point, params) -> None:
    """The point's RL state and metrics writer in its run directory (``entry["run_dir"]``)."""
    save_config(p.entry["run_dir"], p.cfg)
    p.rl = RLRun(p.sections, p.entry["run_dir"], params, seed=p.cfg.seed, resume=False)
    p.writer = MetricsWriter(p.entry["run_dir"])


def group_step(points: list[Point], step: int, vstate, update_fn, on_failure) -> Any:
    """One RL step of a vectorised group: per-point rollouts and scoring, then one vmapped
    update. Points whose rollouts raise are reported (``on_failure(point, exc)``), closed and
    dropped (``points`` is updated in place). Returns the new stacked state."""
    metrics, data, alive = [], [], []
    for i, p in enumerate(points):
        try:
            p.rl.state = take(vstate, i)
            collected = p.rl.collect(step)
            batch = p.rl.score(collected.batch)
            metrics.append((collected, batch))
            data.append(update_batch(batch))
            alive.append(i)
        except Exception as exc:  # noqa: BLE001 - one point's crash must not stop the others
            on_failure(p, exc)
            p.close()
    if len(alive) < len(points):
        vstate = take(vstate, alive)
        points[:] = [points[i] for i in alive]
        if not points:
            return vstate
    t1 = time.perf_counter()
    vstate, vm = update_fn(vstate, stack(data))
    vm = jax.device_get(vm)
    upd_s = (time.perf_counter() - t1) / len(points)
    for i, (p, (collected, batch)) in enumerate(zip(points, metrics, strict=True)):
        p.rl.state = take(vstate, i)
        m = p.rl.metrics({k: float(v[i]) for k, v in vm.items()}, collected, batch, upd_s)
        m.pop("update_tokens_per_s", None)  # one update for all points
        p.entropies.append(m["entropy"])
        p.writer.write(step + 1, m, prefix="rl")
    return vstate


def finish_point(p: Point, before: dict | None, t0: float) -> dict:
    """Evaluation after RL, the final checkpoint and the summary of a live point."""
    loop = p.sections.train
    after = stages.evaluate_run(p.sections, p.rl.state.params)
    p.writer.write(loop.rl_steps, stages.eval_metrics(after), prefix="eval")
    p.rl.save(loop.rl_steps)
    prior = {}
    if before is not None:
        prior = {
            "heldout_success_before_rl": stages.mode_value(before, "success"),
            "goal_adherence_before_rl": stages.mode_value(before, "goal_adherence"),
            "eval_before": before,
        }
    summary = stages.summary(
        prior,
        after,
        model=stages.model_name(p.cfg, p.rl.state.params),
        eval_split=p.sections.eval.split,
        entropies=p.entropies,
        nonfinite_steps=int(p.rl.state.nonfinite_count),
        rl_steps=loop.rl_steps,
        wall_s=time.perf_counter() - t0,
        run_dir=p.entry["run_dir"],
    )
    summary["vectorized"] = True
    stages.dump_json(os.path.join(p.entry["run_dir"], "summary.json"), {**prior, **summary})
    return summary


def run_group(
    points: list[Point], base: ConfigDict, sweep_dir: str, on_failure, progress
) -> dict[int, dict]:
    """Runs a vectorised group of live points (run directories made) to the end (module
    docstring); returns the finished points' summaries by ``entry["index"]``; the others were
    reported through ``on_failure(point, exception)``.

    Raises:
      GroupDone: no point left.
      ValueError: the points are not vectorisable (``check_vectorizable``).
    """
    t0 = time.perf_counter()
    sections = build(base)
    loop = sections.train
    check_vectorizable(
        [p.sections.rl for p in points], {k for p in points for k in p.entry["overrides"]}
    )
    initial = start_group(points, base, sweep_dir, progress)
    before = {}
    if loop.eval_before:
        before = {k: stages.evaluate_run(sections, v) for k, v in initial.items()}
    for p in list(points):
        try:
            open_point(p, initial[p.init_key])
            if p.init_key in before:
                ev = {"heldout_success": stages.mode_value(before[p.init_key], "success")}
                p.writer.write(0, ev, prefix="eval")
        except Exception as exc:  # noqa: BLE001
            on_failure(p, exc)
            p.close()
            points.remove(p)
    if not points:
        raise GroupDone
    model = Transformer(sections.model, sections.policy)
    update_fn = make_vmapped_update(model, sections.rl, sections.rollout)
    vstate = stack([with_hparams(p.rl.state, p.sections.rl) for p in points])
    for step in range(loop.rl_steps):
        vstate = group_step(points, step, vstate, update_fn, on_failure)
        if not points:
            raise GroupDone
        log.info("vectorised sweep step %d/%d done", step + 1, loop.rl_steps)
    done = {}
    for p in points:
        try:
            done[p.entry["index"]] = finish_point(p, before.get(p.init_key), t0)
        except Exception as exc:  # noqa: BLE001
            on_failure(p, exc)
        p.close()
    return done
