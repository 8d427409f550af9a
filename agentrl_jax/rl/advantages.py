"""Credit assignment: a registry of pure, jittable advantage estimators over [B, T] arrays.

Each estimator is ``fn(inputs: CreditInputs, **hparams) -> advantages`` (f32 [B, T], zero outside
``inputs.action_mask``). Hyper-parameters are Python scalars/strings, static under ``jax.jit``
(``jax.jit(functools.partial(get_advantage("grpo"), eps=1e-6))``). A new variant is one decorator:

    @register_advantage("my_variant")
    def my_variant(inputs, *, scale=1.0):
        return scale * get_advantage("grpo")(inputs)

Conventions (all estimators):
  * Rewards live on action tokens: ``process_rewards[b, t]`` on the last action token of the turn
    that earned it, ``outcome_reward[b]`` on the last action token of episode b. Rewards placed on
    non-action tokens are ignored.
  * Only action (model) tokens are decision steps: discounting skips environment tokens.
  * A turn is the set of action tokens sharing a ``turn_ids`` value; turns without action tokens
    (pure observation turns) are not steps. Turn-level quantities use K = T turn slots.
  * Episodes with no action token are excluded from group statistics and get zero advantage.

Shape legend: B episodes, T tokens, K turn slots (= T).

Registered here: orm, prm_orm, discounted_token, discounted_turn, gae, grpo, dr_grpo, rloo;
``advantages_turn`` adds gigpo and attn_credit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from agentrl_jax.rl import segments

AdvantageFn = Callable[..., Array]
_REGISTRY: dict[str, AdvantageFn] = {}
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


def register_advantage(
    name: str, *, overwrite: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering ``fn(inputs, **hparams) -> [B, T] advantages`` under ``name``.

    Raises:
      ValueError: if ``name`` is empty or already registered and ``overwrite`` is False.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"advantage name must be a non-empty string, got {name!r}")

    def wrap(fn: AdvantageFn) -> AdvantageFn:
        if name in _REGISTRY and not overwrite:
            raise ValueError(
                f"advantage {name!r} is already registered; pass overwrite=True to replace it"
            )
        _REGISTRY[name] = fn
        return fn

    return wrap


def get_advantage(name: str) -> AdvantageFn:
    """Returns the estimator registered as ``name``.

    Raises:
      ValueError: if ``name`` is not registered (the message lists the registered names).
    """
    if name not in _REGISTRY:
        raise ValueError(f"advantage {name!r} is not registered; known: {advantage_names()}")
    return _REGISTRY[name]


def advantage_names() -> tuple[str, ...]:
    """Sorted names of all registered estimators."""
    return tuple(sorted(_REGISTRY))


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


def _check_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name}={value} must be in {bracket}{lo}, {hi}]")


def token_rewards(inputs: CreditInputs, prm_weight: float = 1.0, orm_weight: float = 1.0) -> Array:
    """r[b,t] = prm_weight * process_rewards[b,t] + orm_weight * outcome[b] * [t = last action].

    Zero outside the action mask.
    """
    mask = inputs.action_mask
    last = segments.last_true(mask)
    r = prm_weight * inputs.process_rewards.astype(jnp.float32)
    r = r + orm_weight * inputs.outcome_reward.astype(jnp.float32)[:, None] * last
    return jnp.where(mask, r, 0.0)


def _broadcast(per_episode: Array, mask: Array) -> Array:
    return jnp.where(mask, per_episode.astype(jnp.float32)[:, None], 0.0)


@register_advantage("orm")
def orm(inputs: CreditInputs) -> Array:
    """Outcome reward broadcast: A[b, t] = R_b on every action token of episode b."""
    validate_inputs(inputs)
    return _broadcast(inputs.outcome_reward, inputs.action_mask)


@register_advantage("prm_orm")
def prm_orm(inputs: CreditInputs, *, prm_weight: float = 1.0, orm_weight: float = 1.0) -> Array:
    """Process + outcome reward: A[b,t] = w_o R_b + w_p sum_{t' >= t, action} p[b, t'].

    The process part is the undiscounted reward-to-go of milestone rewards, so every token of a
    turn is credited with the milestones of its own and all later turns.

    Raises:
      ValueError: if a weight is negative.
    """
    _check_range("prm_weight", prm_weight, 0.0, float("inf"))
    _check_range("orm_weight", orm_weight, 0.0, float("inf"))
    validate_inputs(inputs)
    mask = inputs.action_mask
    p = jnp.where(mask, inputs.process_rewards.astype(jnp.float32), 0.0)
    to_go = jnp.flip(jnp.cumsum(jnp.flip(p, 1), axis=1), 1)
    return jnp.where(mask, orm_weight * inputs.outcome_reward[:, None] + prm_weight * to_go, 0.0)


@register_advantage("discounted_token")
def discounted_token(
    inputs: CreditInputs, *, gamma: float = 1.0, prm_weight: float = 1.0, orm_weight: float = 1.0
) -> Array:
    """Token-level discounted return: A[b,t] = G_t = sum_{t' >= t} gamma^(n(t,t')) r[b,t'].

    ``r`` is ``token_rewards`` and n(t, t') counts action tokens in (t, t'] (env tokens are not
    steps).

    Raises:
      ValueError: if gamma is outside [0, 1] or a weight is negative.
    """
    _check_range("gamma", gamma, 0.0, 1.0)
    validate_inputs(inputs)
    r = token_rewards(inputs, prm_weight, orm_weight)
    return segments.reverse_discounted_sum(r, inputs.action_mask, gamma)


def turn_returns(
    inputs: CreditInputs, gamma: float, prm_weight: float = 1.0, orm_weight: float = 1.0
) -> tuple[Array, Array]:
    """Per-turn discounted returns G[b,k] = r_k + gamma G[b, next action turn] and turn validity.

    r_k sums ``token_rewards`` over the action tokens of turn k.
    """
    mask = inputs.action_mask
    r = token_rewards(inputs, prm_weight, orm_weight)
    r_turn = segments.per_turn_sum(r, inputs.turn_ids, mask)
    has_action = segments.per_turn_sum(jnp.ones_like(r), inputs.turn_ids, mask) > 0
    return segments.reverse_discounted_sum(r_turn, has_action, gamma), has_action


@register_advantage("discounted_turn")
def discounted_turn(
    inputs: CreditInputs, *, gamma: float = 1.0, prm_weight: float = 1.0, orm_weight: float = 1.0
) -> Array:
    """Turn-level discounted return, broadcast to the turn's action tokens.

    G_k = r_k + gamma * G_{k+1} over action turns (r_k: reward of turn k, outcome in the last
    turn); A[b, t] = G_{turn(t)}.

    Raises:
      ValueError: if gamma is outside [0, 1] or a weight is negative.
    """
    _check_range("gamma", gamma, 0.0, 1.0)
    validate_inputs(inputs)
    g, _ = turn_returns(inputs, gamma, prm_weight, orm_weight)
    return segments.turn_to_tokens(g, inputs.turn_ids, inputs.action_mask)


@register_advantage("gae")
def gae(
    inputs: CreditInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    prm_weight: float = 1.0,
    orm_weight: float = 1.0,
    whiten: bool = False,
) -> Array:
    """Generalised advantage estimation over action tokens (reverse ``lax.scan``).

    delta_t = r_t + gamma V_{t+} - V_t,  A_t = delta_t + gamma lam A_{t+},
    with t+ the next action token (V = A = 0 after the last: episodes end there) and V = 0 if
    ``inputs.values`` is None (then A_t is the (gamma lam)-discounted reward-to-go).
    ``whiten``: A <- (A - mean) / (std + 1e-6) over the batch's action tokens (PPO's advantage
    normalisation; a critic's targets are the unwhitened A_t + V_t).

    Raises:
      ValueError: if gamma or lam is outside [0, 1].
    """
    _check_range("gamma", gamma, 0.0, 1.0)
    _check_range("lam", lam, 0.0, 1.0)
    validate_inputs(inputs)
    mask = inputs.action_mask
    r = token_rewards(inputs, prm_weight, orm_weight)
    v = jnp.zeros_like(r) if inputs.values is None else inputs.values.astype(jnp.float32)

    def step(carry, xs):
        next_v, next_a = carry
        r_t, v_t, m_t = xs
        a_t = r_t + gamma * next_v - v_t + gamma * lam * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros(mask.shape[:1], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
    adv = adv.T
    if whiten:
        m = mask.astype(jnp.float32)
        n = jnp.maximum(jnp.sum(m), 1.0)
        mean = jnp.sum(adv * m) / n
        std = jnp.sqrt(jnp.sum(jnp.square(adv - mean) * m) / n)
        adv = jnp.where(mask, (adv - mean) / (std + 1e-6), 0.0)
    return adv


def _episode_groups(inputs: CreditInputs):
    valid = inputs.action_mask.any(axis=1)
    seg = segments.dense_segment_ids([inputs.group_ids], valid)
    r = inputs.outcome_reward.astype(jnp.float32)
    total, count, std = segments.segment_stats(r, seg, valid)
    return r, total, count, std, valid


def episode_advantage(inputs: CreditInputs, estimator: str = "grpo", eps: float = 1e-6) -> Array:
    """Per-episode advantage [B] of an outcome estimator in ``EPISODE_ESTIMATORS``."""
    if estimator not in EPISODE_ESTIMATORS:
        raise ValueError(f"episode_estimator={estimator!r} must be one of {EPISODE_ESTIMATORS}")
    r, total, count, std, valid = _episode_groups(inputs)
    mean = total / jnp.maximum(count, 1.0)
    if estimator == "orm":
        out = r
    elif estimator == "grpo":
        out = (r - mean) / (std + eps)
    elif estimator == "dr_grpo":
        out = r - mean
    else:  # rloo
        out = jnp.where(count > 1, r - (total - r) / jnp.maximum(count - 1.0, 1.0), 0.0)
    return jnp.where(valid, out, 0.0)


@register_advantage("grpo")
def grpo(inputs: CreditInputs, *, eps: float = 1e-6) -> Array:
    """GRPO: A_b = (R_b - mean_g R) / (std_g R + eps), broadcast to action tokens.

    mean_g, std_g: mean and population std of R over the valid episodes of b's group.

    Raises:
      ValueError: if eps <= 0.
    """
    _check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    validate_inputs(inputs)
    return _broadcast(episode_advantage(inputs, "grpo", eps), inputs.action_mask)


@register_advantage("dr_grpo")
def dr_grpo(inputs: CreditInputs) -> Array:
    """Dr.GRPO: A_b = R_b - mean_g R (no std normalisation), broadcast to action tokens."""
    validate_inputs(inputs)
    return _broadcast(episode_advantage(inputs, "dr_grpo"), inputs.action_mask)


@register_advantage("rloo")
def rloo(inputs: CreditInputs) -> Array:
    """RLOO: A_b = R_b - (sum_{j in g, j != b} R_j) / (n_g - 1); 0 for a one-episode group."""
    validate_inputs(inputs)
    return _broadcast(episode_advantage(inputs, "rloo"), inputs.action_mask)


# Register the turn-level estimators (gigpo, attn_credit) on import of this module.
from agentrl_jax.rl import advantages_turn  # noqa: E402, F401
