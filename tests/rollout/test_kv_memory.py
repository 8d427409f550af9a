"""KV memory for real: int8 pages in their own pool, eviction and int8 freeing float pages that
later turns and new episodes take, and KV bytes measured on the live pools."""

import random

import jax
import numpy as np
import pytest
from rollout_setup import CFG

from agentrl_jax.envs.base import StepResult
from agentrl_jax.rollout.agent_loop import AgentLoop, run_episodes
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.loop_state import LoopOptions, RolloutStats
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import RolloutConfig

SAMPLING = RolloutConfig(max_new_tokens=6, max_len=384, page_size=8, chunk=4)
PAGES_PER_SEQ = SAMPLING.max_len // SAMPLING.page_size
# half of the finished tool outputs are evicted, the other half go to int8 (random model)
POLICY = EvictionConfig(threshold=1.0, int8=True, drop_threshold=0.5, min_block=4)
# bytes of one page of the F layer (K and V), fp32: float, and int8 codes + f32 scales
FLOAT_PAGE = 2 * SAMPLING.page_size * CFG.n_kv_heads * CFG.head_dim * 4
INT8_PAGE = 2 * (SAMPLING.page_size * CFG.n_kv_heads * CFG.head_dim + CFG.n_kv_heads * 4)
RING = 2 * CFG.window * CFG.n_kv_heads * CFG.head_dim * 4  # the S layer's ring per slot


class LongEnv:
    """A short prompt, then ``turns`` observations of ``obs`` tokens each (done after the last)."""

    def __init__(self, tokenizer, turns: int = 10, obs: int = 24):
        self.tok, self.turns, self.obs = tokenizer, turns, obs

    def reset(self, seed):
        self.rng, self.turn = random.Random(seed), 0
        words = [self.rng.randrange(20, 400) for _ in range(5)]
        return [self.tok.bos_id, self.tok.obs_start_id, *words, self.tok.obs_end_id]

    def step(self, action):
        self.turn += 1
        words = [self.rng.randrange(20, 400) for _ in range(self.obs)]
        obs = [self.tok.obs_start_id, *words, self.tok.obs_end_id]
        done = self.turn >= self.turns
        log = {"tool": "read", "args": (), "output": "x", "error": False, "success": done}
        return obs + [self.tok.eos_id] * done, StepResult(
            done=done, outcome_reward=float(done), process={}, log=log
        )


def run(model, params, tokenizer, tasks=(0,), n_slots=1, **options):
    stats = RolloutStats()
    traj = run_episodes(
        model, params, list(tasks), lambda: LongEnv(tokenizer), tokenizer, SAMPLING,
        jax.random.key(3), n_slots=n_slots, max_turns=12, stats=stats, **options,
    )  # fmt: skip
    return traj, stats


@pytest.fixture(scope="module")
def unconstrained(fp32_model, tokenizer):
    """Every slot owns max_len worth of pages; same eviction policy (decisions recorded)."""
    model, params = fp32_model
    return run(model, params, tokenizer, eviction=POLICY)


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_episode_larger_than_its_pool_completes_with_eviction_and_int8(
    fp32_model, tokenizer, unconstrained
):
    """The episode needs 42 float pages (43 KB); a pool of 20 float + 8 int8 pages (22.6 KB)
    truncates it without compression and completes it with eviction and int8, with the
    unconstrained run's tokens, masks and logprobs (fp32-parity: bitwise), which are the
    trainer's under the recorded masks."""
    model, params = fp32_model
    ref, _ = unconstrained
    n = int(ref.valid.sum())
    assert -(-n // SAMPLING.page_size) * FLOAT_PAGE > 20 * FLOAT_PAGE + 8 * INT8_PAGE
    full, _ = run(model, params, tokenizer, n_pages=20)
    assert full.truncated[0] and int(full.valid.sum()) < n
    tight, stats = run(model, params, tokenizer, eviction=POLICY, n_pages=20, int8_pages=8)
    assert not tight.truncated[0] and tight.success[0]
    for name in ("tokens", "kv_evict_at", "kv_int8_at", "rollout_logprobs", "action_mask"):
        np.testing.assert_array_equal(getattr(tight, name), getattr(ref, name), err_msg=name)
    assert stats.evicted_tokens > 0 and stats.int8_tokens > 0
    assert stats.max_pages_in_use <= 20 and stats.max_int8_pages_in_use > 0
    replay, _ = trainer_logprobs(model, params, tight, sampling_cfg=SAMPLING, replay_kv=True)
    act = tight.action_mask
    np.testing.assert_array_equal(replay[act], tight.rollout_logprobs[act])
    full_ctx, _ = trainer_logprobs(model, params, tight, sampling_cfg=SAMPLING)
    assert np.abs(full_ctx[act] - tight.rollout_logprobs[act]).max() > 0  # masks matter


def test_kv_bytes_are_pages_in_use_times_page_bytes(fp32_model, tokenizer):
    """Logged KV bytes are the slot's pages in each pool x their bytes (+ its ring); int8 pages
    replace float pages as decisions take effect; the int8 pool's reads equal the float round
    trip (same tokens and logprobs as without an int8 pool)."""
    model, params = fp32_model
    traj, stats = run(model, params, tokenizer, eviction=POLICY, n_pages=48, int8_pages=24)
    no8, _ = run(model, params, tokenizer, eviction=POLICY, n_pages=48, int8_pages=0)
    for name in ("tokens", "kv_int8_at", "rollout_logprobs"):
        np.testing.assert_array_equal(getattr(traj, name), getattr(no8, name), err_msg=name)
    for r in traj.logs:
        want_float = r["pages_in_use"] * FLOAT_PAGE
        assert r["kv_bytes_float"] == want_float
        assert r["kv_bytes_int8"] == r["int8_pages_in_use"] * INT8_PAGE
        assert r["kv_bytes"] == RING + want_float + r["kv_bytes_int8"]
    later = traj.logs[-1]
    assert later["int8_pages_in_use"] > 0
    held = -(-later["tokens_so_far"] // SAMPLING.page_size)
    assert later["pages_in_use"] < held  # float pages given back
    no8_last = no8.logs[-1]
    assert no8_last["int8_pages_in_use"] == 0 and later["kv_bytes"] < no8_last["kv_bytes"]
    assert stats.max_kv_bytes >= later["kv_bytes"]


class MixedEnv(LongEnv):
    """Episodes of 10, 10, 4 and 3 turns (tasks 0..3)."""

    def reset(self, seed):
        self.turns = (10, 10, 4, 3)[seed]
        return super().reset(seed)


def test_freed_pages_admit_waiting_episodes(fp32_model, tokenizer):
    """Three slots, four episodes, a pool of 26 pages: episodes wait for pages, and are
    admitted next to a running one on pages its eviction freed; every episode completes."""
    model, params = fp32_model
    opts = LoopOptions(n_slots=3, max_turns=12, n_pages=26,
                       eviction=EvictionConfig(threshold=1.0, min_block=4))  # fmt: skip
    loop = AgentLoop(model, params, [0, 1, 2, 3], lambda: MixedEnv(tokenizer), tokenizer,
                     SAMPLING, jax.random.key(3), opts)  # fmt: skip
    pool, freed, reused = loop.state.pool, set(), []
    while not loop.done():
        before = [None if sl is None else sl.rec.uid for sl in loop.state.slots]
        holes, tables, free = [set(h) for h in pool.holes], pool.tables.copy(), set(pool.free)
        loop.step()
        after = [None if sl is None else sl.rec.uid for sl in loop.state.slots]
        for s in range(3):
            if after[s] is not None and after[s] != before[s]:  # admitted this round
                running = [
                    u for t, u in enumerate(after) if t != s and u is not None and u == before[t]
                ]
                got = set(pool.tables[s][pool.tables[s] >= 0].tolist()) & free & freed
                if running and got:
                    reused.append((after[s], running, sorted(got)))
            # block-table entries that became holes: their pages were freed by eviction
            freed |= {int(tables[s, j]) for j in set(pool.holes[s]) - holes[s] if tables[s, j] >= 0}
    assert loop.state.stats.admission_waits > 0 and loop.state.stats.evicted_tokens > 0
    assert reused, "no episode was admitted on pages that eviction freed"
    traj = loop.trajectory()
    assert traj.success.all() and not traj.truncated.any()
