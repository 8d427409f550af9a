"""The learned critic of PPO with GAE (``model.value_head`` with ``rl.advantage="gae"``).

The RL loop scores each batch with the current parameters' value head (``values``: V of the
prefix before each token), computes GAE advantages from them, and trains the head on
``targets`` (unwhitened GAE returns A_t + V_t) through ``rl.losses.value_loss``;
``explained_variance`` says how much of the returns' variance the critic explains.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.rl.advantages import get_advantage
from agentrl_jax.rl.credit import CreditInputs
from agentrl_jax.train.reference import teacher_forced


def _values(model_cfg: ModelConfig, sampling, policy, params, tokens, valid) -> jax.Array:
    _, extras = teacher_forced(model_cfg, sampling, policy, params, tokens, valid)
    return jnp.pad(extras["values"][:, :-1], ((0, 0), (1, 0)))


def make_values_fn(model_cfg: ModelConfig, sampling):
    """Jitted ``values(policy, params, tokens, valid) -> f32 [B, T]`` aligned with the
    trajectory: entry t is V of the prefix before token t (the head's output at t - 1; column 0
    is 0). ``policy`` is static."""
    return jax.jit(functools.partial(_values, model_cfg, sampling), static_argnums=0)


def make_targets_fn(advantage_kwargs: dict):
    """Jitted ``targets(inputs: CreditInputs) -> f32 [B, T]``: GAE returns A_t + V_t on action
    tokens (0 elsewhere), with the advantage's gamma / lam and no whitening."""
    kw = {k: v for k, v in advantage_kwargs.items() if k != "whiten"}
    gae = get_advantage("gae")

    def targets(inputs: CreditInputs) -> jax.Array:
        return jnp.where(inputs.action_mask, gae(inputs, **kw) + inputs.values, 0.0)

    return jax.jit(targets)


def explained_variance(targets, values, mask) -> dict[str, float]:
    """``value_explained_var`` = 1 - Var(R - V) / Var(R) over action tokens (1 = a perfect
    critic, 0 = no better than the mean, < 0 worse), and the targets' mean ({} without action
    tokens)."""
    r, v = targets[mask.astype(bool)], values[mask.astype(bool)]
    if r.size == 0:
        return {}
    var = float(np.var(r))
    ev = 1.0 - float(np.var(r - v)) / var if var > 0 else float("nan")
    return {"value_explained_var": ev, "value_target_mean": float(np.mean(r))}
