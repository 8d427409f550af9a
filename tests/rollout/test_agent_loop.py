"""Agent loop: token-in/token-out streams, masks, continuous batching, paging, parity."""

import json

import jax
import numpy as np
import pytest
from rollout_setup import N_SLOTS, SAMPLING, ScriptedEnv

from agentrl_jax.envs.coderepair import CodeRepairEnv, make_task
from agentrl_jax.rl.mismatch import mismatch_metrics
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.loop_state import RolloutStats
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.trajectory import write_jsonl

TASKS = [0, 1, 2, 3, 4]
N_PAGES = N_SLOTS * SAMPLING.max_len // SAMPLING.page_size  # same shapes as the default pool


def play(model, params, tokenizer, *, tasks=TASKS, seed=7, sampling_cfg=SAMPLING, **kw):
    envs = {}

    def factory():
        env = ScriptedEnv(tokenizer)
        reset = env.reset

        def tracked_reset(task):
            envs[task] = env
            return reset(task)

        env.reset = tracked_reset
        return env

    stats = RolloutStats()
    traj = run_episodes(
        model, params, tasks, factory, tokenizer, sampling_cfg, jax.random.key(seed),
        n_slots=N_SLOTS, stats=stats, **kw,
    )  # fmt: skip
    return traj, envs, stats


@pytest.fixture(scope="module")
def played(fp32_model, tokenizer):
    model, params = fp32_model
    return play(model, params, tokenizer)


def test_stream_is_what_the_env_saw(played, tokenizer):
    traj, envs, _ = played
    stops = {tokenizer.call_end_id, tokenizer.eot_id, tokenizer.eos_id}
    for b, task in enumerate(TASKS):
        env = envs[task]
        n = int(traj.valid[b].sum())
        np.testing.assert_array_equal(traj.tokens[b, :n], env.stream)
        assert not traj.valid[b, n:].any() and (traj.turn_ids[b, n:] == -1).all()
        assert traj.tokens[b, n - 1] == tokenizer.eos_id and traj.outcome_reward[b] == 1.0
        act = traj.action_mask[b]
        assert not act[: len(ScriptedEnv(tokenizer).reset(task))].any()
        # every model turn is a run of action tokens ending in a stop token or max_new_tokens
        turns = traj.turn_ids[b]
        assert turns.max() == env.turn == 2 + task % 2
        for k in range(1, env.turn + 1):
            idx = np.nonzero(act & (turns == k))[0]
            assert len(idx) and np.all(np.diff(idx) == 1)
            assert traj.tokens[b, idx[-1]] in stops or len(idx) == SAMPLING.max_new_tokens
            assert traj.process_rewards[b, idx[-1]] == 0.5
        assert traj.process_rewards[b].sum() == 0.5 * env.turn
        lp = traj.rollout_logprobs[b]
        assert np.all(lp[act] < 0) and np.all(lp[~act] == 0)
    assert traj.success.all() and not traj.truncated.any()
    assert traj.tokens.shape[1] % SAMPLING.chunk == 0


def test_logs_and_jsonl(played, tmp_path):
    traj, envs, stats = played
    assert len(traj.logs) == sum(e.turn for e in envs.values())
    rec = traj.logs[0]
    for key in ("tool", "args", "output", "pages_in_use", "kv_bytes", "tokens_so_far"):
        assert key in rec
    assert rec["kv_bytes"] > 0 and rec["tool"] == "echo"
    path = tmp_path / "turns.jsonl"
    assert write_jsonl(traj, str(path)) == len(traj.logs)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["episode"] == rec["episode"]
    # token-in/token-out: prefill covered each prompt/observation once, never the history
    env_tok = traj.valid & ~traj.action_mask
    last_turn = traj.turn_ids == traj.turn_ids.max(axis=1, keepdims=True)
    # the final observation (after the last model turn) is never prefilled: nothing follows it
    prefilled = stats.prefill_tokens + stats.shared_prefill_tokens
    assert prefilled == int(env_tok.sum()) - int((env_tok & last_turn).sum())
    assert stats.decode_tokens == int(traj.action_mask.sum())
    # trajectories cross jax transformations without their host-side logs
    leaves = jax.tree.leaves(traj)
    assert all(isinstance(x, np.ndarray) for x in leaves)


def test_parity_fp32_bitwise(played, fp32_model):
    model, params = fp32_model
    traj, _, _ = played
    lp, routes = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    act = traj.action_mask
    assert act.sum() > 20
    np.testing.assert_array_equal(lp[act], traj.rollout_logprobs[act])
    np.testing.assert_array_equal(routes[act], traj.routes[act])
    m = mismatch_metrics(
        lp, traj.rollout_logprobs, act, routes_train=routes, routes_rollout=traj.routes
    )
    assert float(m["max_abs_dlogp"]) == 0.0 and float(m["routing_exact_agreement"]) == 1.0


def test_lockstep_and_paging_reproduce_tokens(played, fp32_model, tokenizer):
    """Same seed, same tokens: lockstep waves, and a page budget that forces preemption."""
    model, params = fp32_model
    ref, _, _ = played
    lock, _, _ = play(model, params, tokenizer, continuous=False)
    np.testing.assert_array_equal(lock.tokens, ref.tokens)
    np.testing.assert_array_equal(lock.rollout_logprobs, ref.rollout_logprobs)
    tight, _, stats = play(model, params, tokenizer, n_pages=N_PAGES, page_budget=7)
    assert stats.preemptions > 0 or stats.admission_waits > 0
    assert stats.max_pages_in_use <= 7
    np.testing.assert_array_equal(tight.tokens, ref.tokens)
    np.testing.assert_array_equal(tight.rollout_logprobs, ref.rollout_logprobs)
    np.testing.assert_array_equal(tight.routes, ref.routes)


def test_twin_slots_are_copied_bitwise(fp32_model, tokenizer):
    """A group's episodes share a prompt: one slot is prefilled, the others copied from it.
    The copies keep fp32 parity with the trainer, in own pages and in a shared pool."""
    model, params = fp32_model
    tasks = [4, 4, 4, 9, 9]
    traj, envs, stats = play(model, params, tokenizer, tasks=tasks)
    assert stats.shared_prefill_tokens >= 2 * len(ScriptedEnv(tokenizer).reset(4))
    lp, routes = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    act = traj.action_mask
    np.testing.assert_array_equal(lp[act], traj.rollout_logprobs[act])
    np.testing.assert_array_equal(routes[act], traj.routes[act])
    assert len({tuple(traj.tokens[b][act[b]]) for b in range(3)}) > 1  # the twins diverged
    pooled, _, pstats = play(model, params, tokenizer, tasks=tasks, n_pages=N_PAGES)
    assert pstats.shared_prefill_tokens > 0
    np.testing.assert_array_equal(pooled.tokens, traj.tokens)
    np.testing.assert_array_equal(pooled.rollout_logprobs, traj.rollout_logprobs)


def test_greedy_episodes(played, fp32_model, tokenizer):
    """Episodes marked greedy decode as a greedy run does; the sampled ones are unchanged."""
    model, params = fp32_model
    ref, _, _ = played
    greedy = [False, True, False, False, True]
    mixed, _, _ = play(model, params, tokenizer, greedy=greedy)
    argmax, _, _ = play(model, params, tokenizer, sampling_cfg=SAMPLING.replace(greedy=True))
    for b, g in enumerate(greedy):
        want = argmax if g else ref
        for name in ("tokens", "rollout_logprobs", "action_mask"):
            got, exp = getattr(mixed, name)[b], getattr(want, name)[b]
            np.testing.assert_array_equal(got[mixed.valid[b]], exp[want.valid[b]])
    assert not np.array_equal(mixed.tokens[1][mixed.valid[1]], ref.tokens[1][ref.valid[1]])
    with pytest.raises(ValueError, match="greedy has 2 entries"):
        play(model, params, tokenizer, greedy=[True, False])


def test_parity_bf16_bitwise(bf16_model, tokenizer):
    model, params = bf16_model
    traj, _, _ = play(model, params, tokenizer, tasks=[0, 1, 2, 3])
    lp, routes = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    act = traj.action_mask
    np.testing.assert_array_equal(lp[act], traj.rollout_logprobs[act])
    np.testing.assert_array_equal(routes[act], traj.routes[act])


def test_coderepair_episode_with_random_model(fp32_model, tokenizer):
    model, params = fp32_model
    tasks = [make_task(s, 0) for s in range(2)]
    traj = run_episodes(
        model, params, tasks, CodeRepairEnv, tokenizer, SAMPLING, jax.random.key(3),
        n_slots=N_SLOTS, max_turns=2,
    )  # fmt: skip
    assert traj.batch == 2 and traj.truncated.all()  # a random model never submits
    assert (traj.turn_ids.max(axis=1) == 2).all()
    assert all(r["error"] for r in traj.logs)  # random ids are no tool call
    for b in range(2):
        n = int(traj.valid[b].sum())
        prompt = CodeRepairEnv(tokenizer).reset(tasks[b])
        np.testing.assert_array_equal(traj.tokens[b, : len(prompt)], prompt)
        assert n <= SAMPLING.max_len
