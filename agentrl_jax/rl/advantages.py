"""Credit assignment: a registry of pure, jittable advantage estimators over [B, T] arrays.

Each estimator is ``fn(inputs: CreditInputs, **hparams) -> advantages`` (f32 [B, T], zero outside
``inputs.action_mask``). Hyper-parameters are Python scalars/strings, static under ``jax.jit``
(``jax.jit(functools.partial(get_advantage("grpo"), eps=1e-6))``). A new variant is one decorator:

    @register_advantage("my_variant")
    def my_variant(inputs, *, scale=1.0):
        return scale * get_advantage("grpo")(inputs)

Inputs, their conventions and the group baselines are ``rl.credit``'s (equal rewards in a group
give exactly zero advantage under every baseline).

Shape legend: B episodes, T tokens, K turn slots (= T).

Defined and registered here: orm, prm_orm, discounted_token, discounted_turn, gae, grpo,
dr_grpo, rloo; registered from ``advantages_turn``: gigpo, attn_credit, episode_process.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from agentrl_jax.rl import advantages_turn, segments
from agentrl_jax.rl.credit import (
    CreditInputs,
    broadcast_episode,
    check_range,
    episode_advantage,
    token_rewards,
    turn_returns,
    validate_inputs,
)

AdvantageFn = Callable[..., Array]
_REGISTRY: dict[str, AdvantageFn] = {}


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


@register_advantage("orm")
def orm(inputs: CreditInputs) -> Array:
    """Outcome reward broadcast: A[b, t] = R_b on every action token of episode b."""
    validate_inputs(inputs)
    return broadcast_episode(inputs.outcome_reward, inputs.action_mask)


@register_advantage("prm_orm")
def prm_orm(inputs: CreditInputs, *, prm_weight: float = 1.0, orm_weight: float = 1.0) -> Array:
    """Process + outcome reward: A[b,t] = w_o R_b + w_p sum_{t' >= t, action} p[b, t'].

    The process part is the undiscounted reward-to-go of milestone rewards, so every token of a
    turn is credited with the milestones of its own and all later turns.

    Raises:
      ValueError: if a weight is negative.
    """
    check_range("prm_weight", prm_weight, 0.0, float("inf"))
    check_range("orm_weight", orm_weight, 0.0, float("inf"))
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
    check_range("gamma", gamma, 0.0, 1.0)
    validate_inputs(inputs)
    r = token_rewards(inputs, prm_weight, orm_weight)
    return segments.reverse_discounted_sum(r, inputs.action_mask, gamma)


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
    check_range("gamma", gamma, 0.0, 1.0)
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
    normalisation; a critic's targets are the unwhitened A_t + V_t); 0 if every A_t is equal.

    Raises:
      ValueError: if gamma or lam is outside [0, 1].
    """
    check_range("gamma", gamma, 0.0, 1.0)
    check_range("lam", lam, 0.0, 1.0)
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
        equal = jnp.max(jnp.where(mask, adv, -jnp.inf)) == jnp.min(jnp.where(mask, adv, jnp.inf))
        adv = jnp.where(mask & ~equal, (adv - mean) / (std + 1e-6), 0.0)
    return adv


@register_advantage("grpo")
def grpo(inputs: CreditInputs, *, eps: float = 1e-6) -> Array:
    """GRPO: A_b = (R_b - mean_g R) / (std_g R + eps), broadcast to action tokens.

    mean_g, std_g: mean and population std of R over the valid episodes of b's group.

    Raises:
      ValueError: if eps <= 0.
    """
    check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    validate_inputs(inputs)
    return broadcast_episode(episode_advantage(inputs, "grpo", eps), inputs.action_mask)


@register_advantage("dr_grpo")
def dr_grpo(inputs: CreditInputs) -> Array:
    """Dr.GRPO: A_b = R_b - mean_g R (no std normalisation), broadcast to action tokens."""
    validate_inputs(inputs)
    return broadcast_episode(episode_advantage(inputs, "dr_grpo"), inputs.action_mask)


@register_advantage("rloo")
def rloo(inputs: CreditInputs) -> Array:
    """RLOO: A_b = R_b - (sum_{j in g, j != b} R_j) / (n_g - 1); 0 for a one-episode group."""
    validate_inputs(inputs)
    return broadcast_episode(episode_advantage(inputs, "rloo"), inputs.action_mask)


for _name, _fn in (
    ("gigpo", advantages_turn.gigpo),
    ("attn_credit", advantages_turn.attn_credit),
    ("episode_process", advantages_turn.episode_process),
):
    register_advantage(_name)(_fn)
