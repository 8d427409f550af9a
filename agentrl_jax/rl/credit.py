"""What every advantage estimator shares: its inputs, their validation, rewards, group baselines.

The estimators themselves live in ``rl.advantages`` (the registry and the token / episode
estimators) and ``rl.advantages_turn`` (turn-level refinements of an episode advantage); both
build on this module, which imports neither.

Conventions (all estimators):
  * Rewards live on action tokens: ``process_rewards[b, t]`` on the last action token of the turn
    that earned it, ``outcome_reward[b]`` on the last action token of episode b. Rewards placed on
    non-action tokens are ignored.
  * Only action (model) tokens are decision steps: discounting skips environment tokens.
  * A turn is the set of action tokens sharing a ``turn_ids`` value; turns without action tokens
    (pure observation turns) are not steps. Turn-level quantities use K = T turn slots.
  * Episodes with no action token are excluded from group statistics and get zero advantage.
  * A group whose values are all equal gets exactly zero advantage from every baseline (mean,
    leave-one-out, std normalisation), whatever the values: a float32 group mean of equal
    values that do not sum exactly is not the value itself, and dividing that rounding by a
    near-zero std would make it large.

Shape legend: B episodes, T tokens, K turn slots (= T).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from agentrl_jax.rl import segments

EPISODE_ESTIMATORS = ("orm", "grpo", "dr_grpo", "rloo")


class CreditInputs(NamedTuple):
    """Everything an estimator may read (a pytree; optional fields are None).

    Attributes:
      action_mask: bool [B, T], True on model-generated (action) tokens.
      turn_ids: int32 [B, T], turn index of each token, -1 on padding.
      outcome_reward: f32 [B], episode outcome (e.g. success) reward.
      process_rewards: f32 [B, T], milestone rewards on the last action token of their turn.
      group_ids: int32 [B], episodes with equal ids are rollouts of the same task.
      state_ids: optional int32 [B, T], hash of the environment state an action turn was taken
        from (constant over the turn's action tokens), for step-level groups.
      values: optional f32 [B, T], value-head estimate V(s_t) at each token.
      attn_credit: optional f32 [B, T], attention mass the final turns' tokens put on each token
        (teacher-forced pass).
    """

    action_mask: Array
    turn_ids: Array
    outcome_reward: Array
    process_rewards: Array
    group_ids: Array
    state_ids: Array | None = None
    values: Array | None = None
    attn_credit: Array | None = None


def validate_inputs(inputs: CreditInputs, required: tuple[str, ...] = ()) -> None:
    """Checks shapes (static) of ``inputs`` and presence of the ``required`` optional fields.

    Raises:
      ValueError: naming the field whose shape or presence is wrong.
    """
    if inputs.action_mask.ndim != 2:
        raise ValueError(f"action_mask must be [B, T], got shape {inputs.action_mask.shape}")
    if inputs.action_mask.dtype != jnp.bool_:
        raise ValueError(f"action_mask must be bool, got {inputs.action_mask.dtype}")
    b, t = inputs.action_mask.shape
    expected = {
        "turn_ids": (b, t),
        "outcome_reward": (b,),
        "process_rewards": (b, t),
        "group_ids": (b,),
        "state_ids": (b, t),
        "values": (b, t),
        "attn_credit": (b, t),
    }
    for field, shape in expected.items():
        value = getattr(inputs, field)
        if value is None:
            if field in required:
                raise ValueError(f"{field} is required by this estimator but is None")
            continue
        if tuple(value.shape) != shape:
            raise ValueError(f"{field} must have shape {shape}, got {tuple(value.shape)}")


def check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """Raises ValueError naming ``name`` unless ``value`` lies in [lo, hi] ((lo, hi] if open)."""
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name}={value} must be in {bracket}{lo}, {hi}]")


def token_rewards(inputs: CreditInputs, prm_weight: float = 1.0, orm_weight: float = 1.0) -> Array:
    """r[b,t] = prm_weight * process_rewards[b,t] + orm_weight * outcome[b] * [t = last action].

    Zero outside the action mask. f32 [B, T].
    """
    mask = inputs.action_mask
    last = segments.last_true(mask)
    r = prm_weight * inputs.process_rewards.astype(jnp.float32)
    r = r + orm_weight * inputs.outcome_reward.astype(jnp.float32)[:, None] * last
    return jnp.where(mask, r, 0.0)


def broadcast_episode(per_episode: Array, mask: Array) -> Array:
    """A per-episode value f32 [B] on every masked token of its row: [B, T], 0 elsewhere."""
    return jnp.where(mask, per_episode.astype(jnp.float32)[:, None], 0.0)


def turn_returns(
    inputs: CreditInputs, gamma: float, prm_weight: float = 1.0, orm_weight: float = 1.0
) -> tuple[Array, Array]:
    """Per-turn discounted returns G[b,k] = r_k + gamma G[b, next action turn] and turn validity.

    r_k sums ``token_rewards`` over the action tokens of turn k. Returns (f32 [B, K],
    bool [B, K]).
    """
    mask = inputs.action_mask
    r = token_rewards(inputs, prm_weight, orm_weight)
    r_turn = segments.per_turn_sum(r, inputs.turn_ids, mask)
    has_action = segments.per_turn_sum(jnp.ones_like(r), inputs.turn_ids, mask) > 0
    return segments.reverse_discounted_sum(r_turn, has_action, gamma), has_action


def episode_advantage(inputs: CreditInputs, estimator: str = "grpo", eps: float = 1e-6) -> Array:
    """Per-episode advantage f32 [B] of an outcome estimator in ``EPISODE_ESTIMATORS``.

    Groups are ``group_ids`` over the episodes with an action token; ``grpo`` is
    (R - mean) / (std + eps), ``dr_grpo`` R - mean, ``rloo`` R minus the mean of the others
    (0 in a one-episode group), ``orm`` R. A group of equal rewards gets exactly 0 from every
    baseline (module docstring).

    Raises:
      ValueError: if ``estimator`` is not in ``EPISODE_ESTIMATORS``.
    """
    if estimator not in EPISODE_ESTIMATORS:
        raise ValueError(f"episode_estimator={estimator!r} must be one of {EPISODE_ESTIMATORS}")
    valid = inputs.action_mask.any(axis=1)
    seg = segments.dense_segment_ids([inputs.group_ids], valid)
    r = inputs.outcome_reward.astype(jnp.float32)
    total, count, std = segments.segment_stats(r, seg, valid)
    mean = total / jnp.maximum(count, 1.0)
    if estimator == "orm":
        return jnp.where(valid, r, 0.0)
    if estimator == "grpo":
        out = (r - mean) / (std + eps)
    elif estimator == "dr_grpo":
        out = r - mean
    else:  # rloo
        out = jnp.where(count > 1, r - (total - r) / jnp.maximum(count - 1.0, 1.0), 0.0)
    equal = segments.segment_all_equal(r, seg, valid)
    return jnp.where(valid & ~equal, out, 0.0)
