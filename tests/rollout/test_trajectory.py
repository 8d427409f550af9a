"""``history_state_ids``: step-level state ids from token histories (hand-built batches)."""

import numpy as np
import pytest

from agentrl_jax.rollout.trajectory import NEVER, concat_rows, history_state_ids


def _row(segments, length):
    """Builds (tokens, action_mask, turn_ids) of one row from (tokens, is_action, turn) parts."""
    tokens, mask, turns = [], [], []
    for toks, is_action, turn in segments:
        tokens += toks
        mask += [is_action] * len(toks)
        turns += [turn] * len(toks)
    pad = length - len(tokens)
    return tokens + [0] * pad, mask + [False] * pad, turns + [-1] * pad


def test_history_state_ids_hand_built():
    prompt = ([7, 8, 9], False, 0)
    rows = [
        # a: run, obs X, sub A
        _row([prompt, ([1, 2], True, 1), ([30, 31], False, 1), ([4, 5], True, 2)], 12),
        # b: run, obs X, sub B -> its turn 2 shares a's state (same history), turn 3 is new
        _row(
            [prompt, ([1, 2], True, 1), ([30, 31], False, 1), ([4, 6], True, 2)]
            + [([40], False, 2), ([1, 2], True, 3)],
            12,
        ),
        # c: run, obs Y (a different observation) -> turn 2 differs from a's and b's
        _row([prompt, ([1, 2], True, 1), ([30, 32], False, 1), ([4, 5], True, 2)], 12),
        # d: a different prompt -> a different first state
        _row([([7, 8, 8], False, 0), ([1, 2], True, 1)], 12),
    ]
    tokens, mask, turns = (np.array([r[i] for r in rows]) for i in range(3))
    ids = history_state_ids(tokens, mask, turns)
    assert ids.dtype == np.int32
    assert (ids[~mask] == 0).all()
    first = {b: ids[b, mask[b] & (turns[b] == 1)] for b in range(4)}
    second = {b: ids[b, mask[b] & (turns[b] == 2)] for b in range(3)}
    for b in range(4):  # constant over each turn's action tokens
        assert len(set(first[b])) == 1
    assert first[0][0] == first[1][0] == first[2][0] == 1  # same prompt: shared first state
    assert first[3][0] not in (1, second[0][0], second[2][0])
    assert second[0][0] == second[1][0] == 2  # run + the same observation
    assert second[2][0] == 4  # ids in order of first appearance, row-major
    third = ids[1, mask[1] & (turns[1] == 3)]
    assert third[0] == 3
    assert first[3][0] == 5


def test_history_state_ids_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must be equal"):
        history_state_ids(np.zeros((2, 4)), np.zeros((2, 3), bool), np.zeros((2, 4)))


def test_episode_record_of_a_played_episode():
    """An expert's played episode becomes a trajectory row like a sampled one: same token
    stream and masks, process signals weighted on each turn's last action token."""
    from agentrl_jax.envs.coderepair import CodeRepairEnv, CodeTokenizer, ExpertPolicy, make_task
    from agentrl_jax.envs.episode import play_episode
    from agentrl_jax.rollout.trajectory import episode_record, stack_episodes

    tok = CodeTokenizer()
    task = make_task(3, 1)
    ep = play_episode(CodeRepairEnv(tok), task, ExpertPolicy(task, tok, detour_prob=1.0, seed=2))
    weights = {"tests": 2.0, "rejected": 0.5}
    rec = episode_record(ep, uid=7, group_id=3, process_weights=weights)
    traj = stack_episodes([rec], pad_to=ep.n_tokens + 5)
    n = ep.n_tokens
    np.testing.assert_array_equal(traj.tokens[0, :n], ep.tokens)
    np.testing.assert_array_equal(traj.action_mask[0, :n], ep.action_mask)
    np.testing.assert_array_equal(traj.turn_ids[0, :n], ep.turn_ids)
    assert traj.valid[0].sum() == n and (traj.turn_ids[0, n:] == -1).all()
    want = np.zeros(n + 5, np.float32)
    for end, sig in zip(ep.turn_ends, ep.process):
        want[end] = sum(weights.get(k, 1.0) * v for k, v in sig.items())
    assert np.abs(want).sum() > 0  # the fix moved the tests signal
    np.testing.assert_allclose(traj.process_rewards[0], want, rtol=1e-6)
    assert traj.success[0] and traj.outcome_reward[0] == 1.0 and not traj.truncated[0]
    assert traj.group_ids[0] == 3 and (traj.rollout_logprobs[0] == 0).all()


def test_concat_rows_pads_routes_for_the_router():
    """Padded time steps get route -1 (the router's own top-k under replay), never expert 0
    twice; turn ids -1, KV marks NEVER, tokens 0."""
    rng = np.random.default_rng(0)
    part = {
        "tokens": rng.integers(1, 50, (2, 3)).astype(np.int32),
        "turn_ids": np.zeros((2, 3), np.int32),
        "routes": rng.integers(0, 4, (2, 3, 2, 2)).astype(np.int32),
        "kv_evict_at": np.full((2, 3), 7, np.int32),
    }
    out = concat_rows([part, part], 5)
    assert out["routes"].shape == (4, 5, 2, 2)
    np.testing.assert_array_equal(out["routes"][:2, :3], part["routes"])
    assert (out["routes"][:, 3:] == -1).all()
    assert (out["turn_ids"][:, 3:] == -1).all() and (out["kv_evict_at"][:, 3:] == NEVER).all()
    assert (out["tokens"][:, 3:] == 0).all()
