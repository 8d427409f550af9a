"""Advantage estimators: hand-computed cases, loop references on random inputs, registry."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rl import advantages as adv
from agentrl_jax.rl import segments
from agentrl_jax.rl.credit import CreditInputs

EPS = 1e-6

# Six episodes, T = 6. Groups 7 (rows 0, 1, 4) and 42 (rows 2, 3, 5); row 5 has no action token
# (padding episode) and must not enter group statistics. Row 3 has an observation-only turn 1.
MASK = np.array(
    [
        [0, 1, 1, 0, 1, 0],
        [0, 1, 0, 1, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 1, 0, 0, 1, 1],
        [0, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ],
    bool,
)
TURNS = np.array(
    [
        [0, 0, 0, 1, 1, -1],
        [0, 0, 1, 1, -1, -1],
        [0, 0, 0, 0, -1, -1],
        [0, 0, 1, 1, 2, 2],
        [0, 0, -1, -1, -1, -1],
        [0, -1, -1, -1, -1, -1],
    ],
    np.int32,
)
OUTCOME = np.array([1.0, 0.0, 2.0, 0.0, 0.5, 5.0], np.float32)
PROCESS = np.zeros((6, 6), np.float32)
PROCESS[0, 2] = 0.5
PROCESS[3, 1] = 0.25
GROUPS = np.array([7, 7, 42, 42, 7, 42], np.int32)
STATES = np.array(
    [
        [0, 11, 11, 0, 12, 0],
        [0, 11, 0, 13, 0, 0],
        [0, 11, 11, 11, 0, 0],
        [0, 21, 0, 0, 21, 21],
        [0, 11, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ],
    np.int32,
)
VALUES = np.zeros((6, 6), np.float32)
VALUES[0] = [9.0, 0.5, 1.0, 9.0, 0.5, 9.0]  # 9s sit on env tokens and must be ignored
ATTN = np.full((6, 6), 100.0, np.float32)  # 100s on env tokens must be ignored
ATTN[MASK] = 0.0
ATTN[0, [1, 2, 4]] = [1.0, 1.0, 6.0]
ATTN[3, [1, 4, 5]] = [3.0, 1.0, -2.0]

INPUTS = CreditInputs(
    jnp.asarray(MASK),
    jnp.asarray(TURNS),
    jnp.asarray(OUTCOME),
    jnp.asarray(PROCESS),
    jnp.asarray(GROUPS),
    state_ids=jnp.asarray(STATES),
    values=jnp.asarray(VALUES),
    attn_credit=jnp.asarray(ATTN),
)


def _rows(*rows):
    return np.array(rows, np.float32)


Z = [0, 0, 0, 0, 0, 0]
SD7 = np.sqrt(1 / 6)  # population std of group 7's outcomes (1, 0, 0.5)
SD21 = 0.125  # std of step returns (0.25, 0) at state 21

HAND_CASES = [
    ("orm", {}, _rows([0, 1, 1, 0, 1, 0], Z, [0, 2, 2, 2, 0, 0], Z, [0, 0.5, 0, 0, 0, 0], Z)),
    (
        "prm_orm",
        {"prm_weight": 0.5, "orm_weight": 1.0},
        _rows(
            [0, 1.25, 1.25, 0, 1, 0],
            Z,
            [0, 2, 2, 2, 0, 0],
            [0, 0.125, 0, 0, 0, 0],
            [0, 0.5, 0, 0, 0, 0],
            Z,
        ),
    ),
    (
        "discounted_token",
        {"gamma": 0.8},
        _rows(
            [0, 1.04, 1.3, 0, 1, 0],
            Z,
            [0, 1.28, 1.6, 2, 0, 0],
            [0, 0.25, 0, 0, 0, 0],
            [0, 0.5, 0, 0, 0, 0],
            Z,
        ),
    ),
    (
        "discounted_turn",
        {"gamma": 0.8},
        _rows(
            [0, 1.3, 1.3, 0, 1, 0],
            Z,
            [0, 2, 2, 2, 0, 0],
            [0, 0.25, 0, 0, 0, 0],
            [0, 0.5, 0, 0, 0, 0],
            Z,
        ),
    ),
    (
        "gae",
        {"gamma": 1.0, "lam": 0.5},
        _rows(
            [0, 0.625, 0.25, 0, 0.5, 0],
            Z,
            [0, 0.5, 1, 2, 0, 0],
            [0, 0.25, 0, 0, 0, 0],
            [0, 0.5, 0, 0, 0, 0],
            Z,
        ),
    ),
    (
        "grpo",
        {"eps": EPS},
        _rows(
            [0] + [0.5 / (SD7 + EPS)] * 2 + [0, 0.5 / (SD7 + EPS), 0],
            [0, -0.5 / (SD7 + EPS), 0, -0.5 / (SD7 + EPS), 0, 0],
            [0] + [1 / (1 + EPS)] * 3 + [0, 0],
            [0, -1 / (1 + EPS), 0, 0, -1 / (1 + EPS), -1 / (1 + EPS)],
            Z,
            Z,
        ),
    ),
    (
        "dr_grpo",
        {},
        _rows(
            [0, 0.5, 0.5, 0, 0.5, 0],
            [0, -0.5, 0, -0.5, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, -1, 0, 0, -1, -1],
            Z,
            Z,
        ),
    ),
    (
        "rloo",
        {},
        _rows(
            [0, 0.75, 0.75, 0, 0.75, 0],
            [0, -0.75, 0, -0.75, 0, 0],
            [0, 2, 2, 2, 0, 0],
            [0, -2, 0, 0, -2, -2],
            Z,
            Z,
        ),
    ),
    (
        "gigpo",
        {"step_weight": 2.0, "gamma": 0.5, "step_std": False, "episode_estimator": "dr_grpo"},
        _rows(
            [0, 1.5, 1.5, 0, 0.5, 0],
            [0, -1.5, 0, -0.5, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, -0.75, 0, 0, -1.25, -1.25],
            Z,
            Z,
        ),
    ),
    (
        "gigpo",
        {"step_weight": 1.0, "gamma": 0.5, "step_std": True, "episode_estimator": "orm"},
        _rows(
            [0] + [1 + 0.5 / (SD7 + EPS)] * 2 + [0, 1, 0],
            [0, -0.5 / (SD7 + EPS), 0, 0, 0, 0],
            [0, 2, 2, 2, 0, 0],
            [0, 0.125 / (SD21 + EPS), 0, 0, -0.125 / (SD21 + EPS), -0.125 / (SD21 + EPS)],
            [0, 0.5, 0, 0, 0, 0],
            Z,
        ),
    ),
    (
        # Dr.GRPO (group 7: 0.5, -0.5, 0; group 42: 1, -1) plus 2x each turn's own process
        # reward: row 0's first turn holds 0.5, row 3's first turn 0.25; later turns keep A_ep.
        "episode_process",
        {"process_weight": 2.0, "episode_estimator": "dr_grpo"},
        _rows(
            [0, 1.5, 1.5, 0, 0.5, 0],
            [0, -0.5, 0, -0.5, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, -0.5, 0, 0, -1, -1],
            Z,
            Z,
        ),
    ),
    (
        "attn_credit",
        {"uniform_mix": 0.5, "episode_estimator": "dr_grpo"},
        _rows(
            [0, 0.375, 0.375, 0, 0.625, 0],
            [0, -0.5, 0, -0.5, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, -1.25, 0, 0, -0.75, -0.75],
            Z,
            Z,
        ),
    ),
]


@pytest.mark.parametrize(
    "name,hparams,expected", HAND_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HAND_CASES)]
)
def test_hand_computed(name, hparams, expected):
    fn = jax.jit(functools.partial(adv.get_advantage(name), **hparams))
    out = np.asarray(fn(INPUTS))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert np.all(out[~MASK] == 0.0)


# ---------------------------------------------------------------------------------------------
# Groups of equal rewards get exactly zero, whatever the value and the group size.

# Every estimator (and its options) that subtracts a group baseline or divides by a group std.
GROUP_BASELINED = [
    ("grpo", {}),
    ("dr_grpo", {}),
    ("rloo", {}),
    ("gigpo", {}),
    ("gigpo", {"step_std": False, "episode_estimator": "dr_grpo"}),
    ("gigpo", {"episode_estimator": "rloo", "gamma": 0.9}),
    ("attn_credit", {}),
    ("attn_credit", {"episode_estimator": "rloo"}),
    ("episode_process", {}),
    ("gae", {"whiten": True, "gamma": 1.0, "lam": 1.0}),  # every A_t is the outcome
]


def _equal_groups(n, values):
    """Groups of ``n`` episodes with the same turns, states and tool outputs; group g's
    outcome rewards all equal ``values[g]`` (no process rewards, so returns are equal too)."""
    b, t = n * len(values), 10
    mask = np.zeros((b, t), bool)
    mask[:, [1, 2, 5, 8, 9]] = True
    turns = np.broadcast_to(np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 2], np.int32), (b, t))
    outcome = np.repeat(np.asarray(values, np.float32), n)
    return CreditInputs(
        jnp.asarray(mask),
        jnp.asarray(turns),
        jnp.asarray(outcome),
        jnp.zeros((b, t), jnp.float32),
        jnp.asarray(np.repeat(np.arange(len(values), dtype=np.int32) * 7, n)),
        state_ids=jnp.asarray(turns + 3),
        values=jnp.zeros((b, t), jnp.float32),
        attn_credit=jnp.asarray(np.where(mask, 1.0, 0.0).astype(np.float32)),
    )


@pytest.mark.parametrize("n", [3, 5, 16])
@pytest.mark.parametrize("name,hparams", GROUP_BASELINED, ids=lambda x: str(x))
def test_equal_rewards_give_exactly_zero(n, name, hparams):
    values = [0.9, 0.1, 0.7, 1 / 3, 0.3, 2.2, 0.03, 0.47, 0.83]
    # the case exists: the float32 group mean of equal values is not the value for some of them
    r = jnp.repeat(jnp.asarray(values, jnp.float32), n)
    seg = jnp.repeat(jnp.arange(len(values)), n)
    total, count, _ = segments.segment_stats(r, seg, jnp.ones_like(r, bool))
    assert np.any(np.asarray(total / count) != np.asarray(r))
    fn = jax.jit(functools.partial(adv.get_advantage(name), **hparams))
    # whitening normalises over the whole batch: one group of equal rewards per batch
    batches = [[v] for v in values] if name == "gae" else [values]
    for vals in batches:
        out = np.asarray(fn(_equal_groups(n, vals)))
        np.testing.assert_array_equal(out, np.zeros_like(out))


def test_equal_group_beside_a_varied_one():
    """An equal group is zero; a varied group keeps its GRPO advantages."""
    inputs = _equal_groups(3, [0.9, 0.9])._replace(
        outcome_reward=jnp.asarray([0.9, 0.9, 0.9, 0.2, 0.9, 0.5], jnp.float32)
    )
    out = np.asarray(adv.get_advantage("grpo")(inputs))
    np.testing.assert_array_equal(out[:3], 0.0)
    r = np.float64([0.2, 0.9, 0.5])
    want = (r - r.mean()) / (r.std() + EPS)
    np.testing.assert_allclose(out[3:, 1], want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Loop references on random inputs.


def _random_inputs(seed, b=8, t=12):
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, t), bool)
    turns = np.full((b, t), -1, np.int32)
    process = np.zeros((b, t), np.float32)
    for i in range(b):
        length = rng.integers(t // 2, t + 1)
        pos, k = 0, 0
        while pos < length:
            n_obs, n_act = rng.integers(0, 3), rng.integers(1, 4)
            for _ in range(n_obs):
                if pos < length:
                    turns[i, pos], pos = k, pos + 1
            last = None
            for _ in range(n_act):
                if pos < length:
                    turns[i, pos], mask[i, pos], last, pos = k, True, pos, pos + 1
            if last is not None and rng.random() < 0.5:
                process[i, last] = rng.normal()
            k += 1
    return CreditInputs(
        jnp.asarray(mask),
        jnp.asarray(turns),
        jnp.asarray(rng.normal(size=b).astype(np.float32)),
        jnp.asarray(process),
        jnp.asarray(rng.choice([3, 1000, -5], size=b).astype(np.int32)),
        # one state per turn (constant over the turn's tokens), few distinct values
        state_ids=jnp.asarray(
            np.take_along_axis(
                rng.integers(0, 3, size=(b, t)), np.maximum(turns, 0), axis=1
            ).astype(np.int32)
        ),
        values=jnp.asarray(rng.normal(size=(b, t)).astype(np.float32)),
        attn_credit=jnp.asarray(rng.random((b, t)).astype(np.float32)),
    )


def _np(inputs):
    return [None if x is None else np.asarray(x) for x in inputs]


def _ref_steps(mask, turns, outcome, process, wp=1.0, wo=1.0):
    """Per episode: list of action token positions and token rewards (loop reference)."""
    rewards = np.zeros(mask.shape, np.float64)
    for i in range(mask.shape[0]):
        pos = np.flatnonzero(mask[i])
        for p in pos:
            rewards[i, p] = wp * process[i, p]
        if len(pos):
            rewards[i, pos[-1]] += wo * outcome[i]
    return rewards


def _ref_turn_table(mask, turns, rewards, i):
    """Ordered action turns of episode i: list of (turn id, token positions, reward)."""
    table = []
    for k in sorted(set(turns[i][mask[i]].tolist())):
        pos = [p for p in range(mask.shape[1]) if mask[i, p] and turns[i, p] == k]
        table.append((k, pos, sum(rewards[i, p] for p in pos)))
    return table


def _ref_gae(inputs, gamma, lam):
    mask, turns, outcome, process, _, _, values, _ = _np(inputs)
    r = _ref_steps(mask, turns, outcome, process)
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        next_v = next_a = 0.0
        for p in reversed(np.flatnonzero(mask[i])):
            a = r[i, p] + gamma * next_v - values[i, p] + gamma * lam * next_a
            out[i, p], next_v, next_a = a, values[i, p], a
    return out


def _ref_gae_whitened(inputs, gamma, lam):
    mask = np.asarray(inputs[0])
    a = _ref_gae(inputs, gamma, lam)
    return np.where(mask, (a - a[mask].mean()) / (a[mask].std() + 1e-6), 0.0)


def _ref_turn_returns(inputs, gamma):
    mask, turns, outcome, process = _np(inputs)[:4]
    r = _ref_steps(mask, turns, outcome, process)
    returns = {}
    for i in range(mask.shape[0]):
        g = 0.0
        for k, pos, rk in reversed(_ref_turn_table(mask, turns, r, i)):
            g = rk + gamma * g
            returns[(i, k)] = (g, pos)
    return returns


def _ref_episode(inputs, kind):
    mask, _, outcome, _, groups = _np(inputs)[:5]
    out = np.zeros(mask.shape[0])
    for i in range(mask.shape[0]):
        if not mask[i].any():
            continue
        peers = [j for j in range(mask.shape[0]) if groups[j] == groups[i] and mask[j].any()]
        rs = outcome[peers].astype(np.float64)
        if kind == "grpo":
            out[i] = (outcome[i] - rs.mean()) / (rs.std() + EPS)
        elif kind == "rloo":
            out[i] = 0.0 if len(rs) == 1 else outcome[i] - (rs.sum() - outcome[i]) / (len(rs) - 1)
    return out


def _ref_gigpo(inputs, gamma, weight):
    mask, turns, _, _, groups, states = _np(inputs)[:6]
    returns = _ref_turn_returns(inputs, gamma)
    key = {ik: (groups[ik[0]], states[ik[0], pos[0]]) for ik, (_, pos) in returns.items()}
    a_ep = _ref_episode(inputs, "grpo")
    out = np.zeros(mask.shape)
    for ik, (g, pos) in returns.items():
        peers = np.array([returns[o][0] for o in returns if key[o] == key[ik]])
        out[ik[0], pos] = a_ep[ik[0]] + weight * (g - peers.mean()) / (peers.std() + EPS)
    return out


def _ref_episode_process(inputs, weight):
    mask, turns, _, process = _np(inputs)[:4]
    a_ep = _ref_episode(inputs, "grpo")
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for _, pos, p in _ref_turn_table(mask, turns, np.where(mask, process, 0.0), i):
            out[i, pos] = a_ep[i] + weight * p
    return out


def _ref_attn(inputs, alpha):
    mask, turns, outcome, process, _, _, _, attn = _np(inputs)
    a_ep = _ref_episode(inputs, "grpo")
    out = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        table = _ref_turn_table(mask, turns, np.maximum(attn, 0.0), i)
        n, total = len(table), sum(m for _, _, m in table)
        for _, pos, m in table:
            share = m / total if total > 0 else 1.0 / n
            out[i, pos] = a_ep[i] * n * ((1 - alpha) * share + alpha / n)
    return out


REFERENCE_CASES = [
    ("gae", {"gamma": 0.9, "lam": 0.7}, lambda x: _ref_gae(x, 0.9, 0.7)),
    (
        "gae",
        {"gamma": 0.9, "lam": 0.7, "whiten": True},
        lambda x: _ref_gae_whitened(x, 0.9, 0.7),
    ),
    (
        "discounted_turn",
        {"gamma": 0.7},
        lambda x: _turn_to_tokens(x, _ref_turn_returns(x, 0.7)),
    ),
    ("grpo", {}, lambda x: np.where(np.asarray(x[0]), _ref_episode(x, "grpo")[:, None], 0.0)),
    ("rloo", {}, lambda x: np.where(np.asarray(x[0]), _ref_episode(x, "rloo")[:, None], 0.0)),
    ("gigpo", {"gamma": 0.8, "step_weight": 0.5}, lambda x: _ref_gigpo(x, 0.8, 0.5)),
    ("attn_credit", {"uniform_mix": 0.3}, lambda x: _ref_attn(x, 0.3)),
    ("episode_process", {"process_weight": 0.7}, lambda x: _ref_episode_process(x, 0.7)),
]


def _turn_to_tokens(inputs, returns):
    out = np.zeros(np.asarray(inputs[0]).shape)
    for (i, _), (g, pos) in returns.items():
        out[i, pos] = g
    return out


@pytest.mark.parametrize(
    "name,hparams,reference",
    REFERENCE_CASES,
    ids=[c[0] + ("_whiten" if c[1].get("whiten") else "") for c in REFERENCE_CASES],
)
def test_against_loop_reference(name, hparams, reference):
    inputs = _random_inputs(seed=len(name))
    out = jax.jit(functools.partial(adv.get_advantage(name), **hparams))(inputs)
    np.testing.assert_allclose(np.asarray(out), reference(inputs), rtol=2e-5, atol=2e-5)


def test_dense_segment_ids_matches_numpy_unique():
    rng = np.random.default_rng(0)
    k1, k2 = rng.integers(-3, 3, size=40), rng.integers(0, 2**30, size=40) % 4
    valid = rng.random(40) < 0.8
    fn = jax.jit(lambda a, b, v: segments.dense_segment_ids([a, b], v))
    ids = np.asarray(fn(jnp.asarray(k1), jnp.asarray(k2), jnp.asarray(valid)))
    pairs = sorted({(a, b) for a, b, v in zip(k1, k2, valid) if v})
    expected = [pairs.index((a, b)) if v else 40 for a, b, v in zip(k1, k2, valid)]
    np.testing.assert_array_equal(ids, expected)


# ---------------------------------------------------------------------------------------------
# Registry and validation.


def test_register_custom_variant_with_one_decorator():
    @adv.register_advantage("test_scaled_rloo")
    def scaled(inputs, *, scale=2.0):
        return scale * adv.get_advantage("rloo")(inputs)

    try:
        assert "test_scaled_rloo" in adv.advantage_names()
        out = jax.jit(adv.get_advantage("test_scaled_rloo"))(INPUTS)
        np.testing.assert_allclose(out, 2.0 * np.asarray(jax.jit(adv.rloo)(INPUTS)))
        with pytest.raises(ValueError, match="already registered"):
            adv.register_advantage("test_scaled_rloo")(scaled)
        adv.register_advantage("test_scaled_rloo", overwrite=True)(adv.orm)
        assert adv.get_advantage("test_scaled_rloo") is adv.orm
    finally:
        adv._REGISTRY.pop("test_scaled_rloo", None)


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="grpo"):
        adv.get_advantage("nope")


@pytest.mark.parametrize(
    "name,hparams,inputs,match",
    [
        ("gae", {"gamma": 1.5}, INPUTS, "gamma"),
        ("gae", {"lam": -0.1}, INPUTS, "lam"),
        ("grpo", {"eps": 0.0}, INPUTS, "eps"),
        ("gigpo", {}, INPUTS._replace(state_ids=None), "state_ids"),
        ("gigpo", {"episode_estimator": "ppo"}, INPUTS, "episode_estimator"),
        ("attn_credit", {}, INPUTS._replace(attn_credit=None), "attn_credit"),
        ("episode_process", {"process_weight": -1.0}, INPUTS, "process_weight"),
        ("episode_process", {"episode_estimator": "ppo"}, INPUTS, "episode_estimator"),
        ("attn_credit", {"uniform_mix": 0.0}, INPUTS, "uniform_mix"),
        ("orm", {}, INPUTS._replace(outcome_reward=jnp.zeros((5,))), "outcome_reward"),
        ("orm", {}, INPUTS._replace(action_mask=jnp.asarray(MASK, jnp.int32)), "action_mask"),
        ("orm", {}, INPUTS._replace(turn_ids=jnp.zeros((6, 5), jnp.int32)), "turn_ids"),
    ],
)
def test_bad_input_raises_naming_field(name, hparams, inputs, match):
    with pytest.raises(ValueError, match=match):
        adv.get_advantage(name)(inputs, **hparams)
