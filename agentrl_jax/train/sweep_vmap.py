"""The vectorised learner of ``agentrl sweep`` (``cfg.sweep_vectorized = True``).

One jitted ``jax.vmap`` of a single RL update over P sweep points: every leaf of the learner
state is stacked over points ([P, ...]) and the swept scalars (lr, weight decay, PPO clip bounds)
are traced f32 [P] inputs, so the whole sweep compiles once. The value of each point equals
``rl.update.make_update_fn`` with that point's config (``tests/test_sweep.py``); the driver that
plays the rollouts and writes the run directories is ``agentrl_jax.train.sweep``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# swept key -> name of the traced hyperparameter of the vectorised learner ("" = host side only)
VMAP_KEYS = {
    "rl.lr": "lr",
    "rl.weight_decay": "weight_decay",
    "rl.loss.clip_low": "clip_low",
    "rl.loss.clip_high": "clip_high",
    "seed": "",
}


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


def _traced_rl_config(rl_cfg, hp: dict):
    """A copy of ``rl_cfg`` whose lr and loss clip bounds are the traced values of ``hp`` (no
    validation: the per-point configs were validated on the host; the loss and the schedule
    use them arithmetically)."""
    from agentrl_jax.rl.losses import LossConfig
    from agentrl_jax.rl.state import RLConfig

    loss = object.__new__(LossConfig)
    for f in dataclasses.fields(LossConfig):
        object.__setattr__(loss, f.name, getattr(rl_cfg.loss, f.name))
    object.__setattr__(loss, "clip_low", hp["clip_low"])
    object.__setattr__(loss, "clip_high", hp["clip_high"])
    out = object.__new__(RLConfig)
    for f in dataclasses.fields(RLConfig):
        object.__setattr__(out, f.name, getattr(rl_cfg, f.name))
    object.__setattr__(out, "loss", loss)
    object.__setattr__(out, "lr", hp["lr"])
    return out


def _step_size(rl_cfg, traced_cfg, count: jax.Array) -> jax.Array:
    """``-schedule(count)``, the factor optax.adamw's ``scale_by_learning_rate`` applies.

    Constant and warmup schedules are built from the traced lr exactly as ``make_optimizer``
    builds them (same float operations: bitwise-equal updates); optax's cosine schedule
    branches on the peak value in Python, so with decay the traced lr scales a unit-peak
    schedule (equal up to float rounding).
    """
    from agentrl_jax.rl.state import learning_rate_schedule

    if rl_cfg.decay_steps > 0:
        return -(traced_cfg.lr * learning_rate_schedule(rl_cfg.replace(lr=1.0))(count))
    return -1 * learning_rate_schedule(traced_cfg)(count)


def make_vmapped_update(model, rl_cfg, sampling_meta=None):
    """``(init_fn, update_fn)`` of a learner vectorised over P sweep points.

    ``init_fn(params_stacked) -> VecState``; ``update_fn(state, data, hp) -> (state, metrics)``
    is one jitted ``jax.vmap`` of a single RL update (fused logprob recompute, one optimiser
    update, non-finite skip), equal in value to ``rl.update.make_update_fn`` with the
    point's config: clip_by_global_norm -> Adam -> ``-schedule(count) * (u + wd * p)`` (decay on
    ndim >= 2 parameters), i.e. optax.adamw's operations with the swept values as traced inputs.

    Args:
      model: the Transformer (shared architecture and dtype policy).
      rl_cfg: the base RLConfig (non-swept knobs, static).
      sampling_meta: chunk geometry for parity policies.

    ``data`` is ``rl.update.prepare_batch`` output stacked over points ([P, B, ...]); ``hp`` maps
    ``lr``, ``weight_decay``, ``clip_low``, ``clip_high`` to f32 [P]. Metrics are f32 [P]
    (``mismatch/*`` only when ``rl_cfg.log_mismatch`` and the batch has rollout logprobs).

    Raises:
      ValueError: ppo_epochs or n_minibatches != 1, or old_logprobs != 'recompute'.
    """
    from agentrl_jax.model.chunked import as_chunk_spec
    from agentrl_jax.rl.mismatch import mismatch_metrics
    from agentrl_jax.rl.update import make_grad_fn

    for field, want in (("ppo_epochs", 1), ("n_minibatches", 1), ("old_logprobs", "recompute")):
        if getattr(rl_cfg, field) != want:
            raise ValueError(
                f"vectorised sweeps need RLConfig.{field}={want!r}, got {getattr(rl_cfg, field)!r}"
            )
    spec = as_chunk_spec(sampling_meta)
    core = _core_tx(rl_cfg)

    def init_fn(params_stacked) -> VecState:
        p = jax.tree.leaves(params_stacked)[0].shape[0]
        zero = jnp.zeros((p,), jnp.int32)
        return VecState(params_stacked, jax.vmap(core.init)(params_stacked), zero, zero + 0)

    def one(state: VecState, data: dict, hp: dict):
        traced_cfg = _traced_rl_config(rl_cfg, hp)
        grad_fn = make_grad_fn(model, traced_cfg, None, spec)
        rows = {k: v for k, v in data.items() if k != "rollout_routes"}
        grads, metrics, aux = grad_fn(state.params, rows)
        gnorm = optax.global_norm(grads)
        u, new_opt = core.update(grads, state.opt_state, state.params)
        step = _step_size(rl_cfg, traced_cfg, state.count)
        u = jax.tree.map(
            lambda g, p: step * (g + hp["weight_decay"] * p) if jnp.ndim(p) >= 2 else step * g,
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
        if rl_cfg.log_mismatch and "logp_rollout" in data:
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
    if len({strip(c) for c in rl_cfgs}) > 1:
        raise ValueError("vectorised points differ in RL settings that are not traced")


def take_points(tree, index: Sequence[int]):
    """The rows ``index`` of every leaf of a point-stacked pytree (``[P, ...] -> [len, ...]``)."""
    idx = jnp.asarray(list(index), jnp.int32)
    return jax.tree.map(lambda a: a[idx], tree)


def sequential_opt_state(rl_cfg, params, vstate: VecState, p: int):
    """Point ``p``'s optimiser state in the layout of ``rl.state.make_optimizer(rl_cfg)``.

    The vectorised learner keeps clip + Adam moments and an update count; optax.adamw keeps the
    same Adam moments and count plus a schedule count (also the applied updates). Checkpoints
    written with this state resume or warm-start exactly like a sequential run's.
    """
    from agentrl_jax.rl.state import make_optimizer

    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    adam = next(s for s in jax.tree.leaves(vstate.opt_state, is_leaf=is_adam) if is_adam(s))
    row = lambda t: jax.tree.map(lambda a: a[p], t)
    template = make_optimizer(rl_cfg).init(params)
    return optax.tree_utils.tree_set(
        template, mu=row(adam.mu), nu=row(adam.nu), count=vstate.count[p].astype(jnp.int32)
    )


__all__ = [
    "VMAP_KEYS",
    "VecState",
    "check_vectorizable",
    "hyperparams",
    "make_vmapped_update",
    "sequential_opt_state",
    "take_points",
]
