"""Turn-level credit estimators: step-level groups (GiGPO-style) and attention-based credit.

Each refines an episode advantage A_b (an estimator from ``credit.EPISODE_ESTIMATORS``) per
action turn and broadcasts the turn value to the turn's action tokens. ``rl.advantages``
registers them (as ``gigpo``, ``attn_credit`` and ``episode_process``).

Shape legend: B episodes, T tokens, K turn slots (= T), N = B*K flattened (episode, turn) pairs.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array

from agentrl_jax.rl import segments
from agentrl_jax.rl.credit import (
    CreditInputs,
    check_range,
    episode_advantage,
    turn_returns,
    validate_inputs,
)


def gigpo(
    inputs: CreditInputs,
    *,
    step_weight: float = 1.0,
    gamma: float = 0.95,
    step_std: bool = True,
    episode_estimator: str = "grpo",
    prm_weight: float = 1.0,
    orm_weight: float = 1.0,
    eps: float = 1e-6,
) -> Array:
    """Episode advantage plus a step-level group baseline (GiGPO-style).

    For every action turn k of episode b: s = state_ids at the turn (constant over its action
    tokens; the max is taken), G_{b,k} = discounted turn return from k on (``turn_returns`` with
    ``gamma``). The step group of (b, k) is every action turn (b', k') with
    group_ids[b'] = group_ids[b] and s_{b',k'} = s_{b,k}; with its mean m and population std sd:

      A_step = (G_{b,k} - m) / (sd + eps)   if step_std else   G_{b,k} - m
      A[b, t] = A_ep(b) + step_weight * A_step(b, turn(t))

    A state visited once in the group, or whose returns in the group are all equal, gives
    A_step = 0 (nothing to compare against).

    Raises:
      ValueError: if ``state_ids`` is None, step_weight < 0, gamma outside [0, 1], eps <= 0,
        or episode_estimator is unknown.
    """
    check_range("step_weight", step_weight, 0.0, float("inf"))
    check_range("gamma", gamma, 0.0, 1.0)
    check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    validate_inputs(inputs, required=("state_ids",))
    mask, turn_ids = inputs.action_mask, inputs.turn_ids
    b, k = mask.shape
    a_ep = episode_advantage(inputs, episode_estimator, eps)
    g, has_action = turn_returns(inputs, gamma, prm_weight, orm_weight)
    state = segments.per_turn_max(inputs.state_ids.astype(jnp.int32), turn_ids, mask)
    group = jnp.broadcast_to(inputs.group_ids.astype(jnp.int32)[:, None], (b, k))
    valid = has_action.reshape(-1)
    seg = segments.dense_segment_ids([group.reshape(-1), state.reshape(-1)], valid)
    total, count, std = segments.segment_stats(g.reshape(-1), seg, valid)
    centred = g.reshape(-1) - total / jnp.maximum(count, 1.0)
    a_step = centred / (std + eps) if step_std else centred
    equal = segments.segment_all_equal(g.reshape(-1), seg, valid)
    a_step = jnp.where(valid & ~equal, a_step, 0.0).reshape(b, k)
    per_turn = a_ep[:, None] + step_weight * a_step
    return segments.turn_to_tokens(per_turn, turn_ids, mask)


def attn_credit(
    inputs: CreditInputs,
    *,
    uniform_mix: float = 0.5,
    episode_estimator: str = "grpo",
    eps: float = 1e-6,
) -> Array:
    """Redistributes the episode advantage over its action turns by attention mass.

    m_k = sum of max(attn_credit, 0) over the action tokens of turn k, M = sum_k m_k, n = number
    of action turns, alpha = ``uniform_mix``:

      w_k = (1 - alpha) m_k / M + alpha / n     (w_k = 1 / n if M = 0; sum_k w_k = 1)
      A[b, t] = A_ep(b) * n * w_{turn(t)}

    so the turn average of the per-turn advantage is A_ep and (alpha > 0) no turn gets zero.
    Every action turn receives credit, the final ones included: to credit only earlier turns,
    zero ``attn_credit`` on the final turns' own tokens (they then keep the uniform share).

    Raises:
      ValueError: if ``attn_credit`` is None, uniform_mix outside (0, 1], eps <= 0, or
        episode_estimator is unknown.
    """
    check_range("uniform_mix", uniform_mix, 0.0, 1.0, lo_open=True)
    check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    validate_inputs(inputs, required=("attn_credit",))
    mask, turn_ids = inputs.action_mask, inputs.turn_ids
    a_ep = episode_advantage(inputs, episode_estimator, eps)
    credit = jnp.maximum(inputs.attn_credit.astype(jnp.float32), 0.0)
    m = segments.per_turn_sum(credit, turn_ids, mask)
    has_action = segments.per_turn_sum(jnp.ones_like(credit), turn_ids, mask) > 0
    n = has_action.sum(axis=1, keepdims=True).astype(jnp.float32)
    total = m.sum(axis=1, keepdims=True)
    share = jnp.where(total > 0, m / jnp.where(total > 0, total, 1.0), 1.0 / jnp.maximum(n, 1.0))
    w = (1.0 - uniform_mix) * share + uniform_mix / jnp.maximum(n, 1.0)
    per_turn = jnp.where(has_action, a_ep[:, None] * n * w, 0.0)
    return segments.turn_to_tokens(per_turn, turn_ids, mask)


def episode_process(
    inputs: CreditInputs,
    *,
    process_weight: float = 0.5,
    episode_estimator: str = "grpo",
    eps: float = 1e-6,
) -> Array:
    """Episode advantage plus each turn's own process reward.

    With p_{b,k} the process reward of action turn k (``process_rewards`` summed over the turn's
    action tokens; the environment puts it on the last one):

      A[b, t] = A_ep(b) + process_weight * p_{b, turn(t)}

    Unlike a reward-to-go, a turn is credited only with what it did itself, so a penalty for a
    rejected call (code repair's ``rejected`` signal) lowers that call and nothing before it.
    Process rewards are not group-baselined: in a group whose episodes all succeed or all fail
    (A_ep = 0) they are the only signal.

    Raises:
      ValueError: if process_weight < 0, eps <= 0 or episode_estimator is unknown.
    """
    check_range("process_weight", process_weight, 0.0, float("inf"))
    check_range("eps", eps, 0.0, float("inf"), lo_open=True)
    validate_inputs(inputs)
    mask, turn_ids = inputs.action_mask, inputs.turn_ids
    a_ep = episode_advantage(inputs, episode_estimator, eps)
    p = jnp.where(mask, inputs.process_rewards.astype(jnp.float32), 0.0)
    p_turn = segments.per_turn_sum(p, turn_ids, mask)
    return segments.turn_to_tokens(a_ep[:, None] + process_weight * p_turn, turn_ids, mask)
