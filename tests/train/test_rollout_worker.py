"""The rollout side of asynchronous RL: the version schedule, the weight store, and an agent
loop that defers environment steps by one round and switches weights mid-rollout."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.envs.base import StepResult
from agentrl_jax.envs.coderepair import CodeTokenizer
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.agent_loop import AgentLoop, run_episodes
from agentrl_jax.rollout.loop_state import LoopOptions
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import RolloutConfig
from agentrl_jax.train.rollout_worker import (
    BatchClock,
    StoreClosed,
    VersionedLoop,
    VersionSchedule,
    WeightStore,
)

CFG = ModelConfig(
    vocab_size=512,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    layer_pattern="DD",
    d_ff=48,
    init_std=0.2,
)
SAMPLING = RolloutConfig(max_new_tokens=6, max_len=128, page_size=8, chunk=4)
N_SLOTS = 3
TASKS = [0, 1, 2, 3, 4]
POLICY = get_policy("fp32-parity")


class EchoEnv:
    """Deterministic environment: a seed-dependent prompt, 2 + seed % 2 turns, observations of
    seed- and turn-dependent length; the last one ends with ``<eos>``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def reset(self, seed):
        tok = self.tokenizer
        self.seed, self.turn, self.rng = seed, 0, random.Random(seed)
        words = [self.rng.randrange(20, 400) for _ in range(5 + 7 * seed % 13)]
        return [tok.bos_id, tok.obs_start_id, *words, tok.obs_end_id]

    def step(self, action):
        tok = self.tokenizer
        self.turn += 1
        words = [self.rng.randrange(20, 400) for _ in range(1 + (self.seed + 3 * self.turn) % 9)]
        obs = [tok.obs_start_id, *words, tok.obs_end_id]
        done = self.turn >= 2 + self.seed % 2
        if done:
            obs.append(tok.eos_id)
        log = {"tool": "echo", "args": (str(len(action)),), "output": "x", "error": False}
        if done:
            log.update(success=True, goal_adhered=True)
        return obs, StepResult(done=done, outcome_reward=float(done), process={}, log=log)


@pytest.fixture(scope="module")
def setup():
    tok = CodeTokenizer()
    model = Transformer(CFG, POLICY)
    p0 = init_params(model, jax.random.key(0))
    p1 = jax.tree.map(lambda x: x * 1.25, p0)  # another "version" of the policy
    return tok, model, p0, p1


def _loop(setup, params, tasks=TASKS):
    tok, model, _, _ = setup
    return AgentLoop(
        model,
        params,
        tasks,
        lambda: EchoEnv(tok),
        tok,
        SAMPLING,
        jax.random.key(7),
        LoopOptions(n_slots=N_SLOTS),
    )


def _store(setup):
    _, _, p0, p1 = setup
    store = WeightStore()
    store.publish(0, p0, POLICY)
    store.publish(1, p1, POLICY)
    return store


def _play(setup, mode, every, executor=None):
    """Batch 1 with k=1: starts under version 0, switches to 1 after ``every`` rounds."""
    clock = BatchClock(_store(setup), VersionSchedule(1, every), batch=1)
    traj = VersionedLoop(_loop(setup, clock.params), clock, mode, executor).run()
    return traj, clock


@pytest.mark.parametrize(
    "k, every, batch, rounds, start, target",
    [
        (0, 0, 5, 100, 5, 5),
        (1, 0, 5, 100, 4, 4),
        (1, 0, 0, 0, 0, 0),
        (2, 3, 5, 2, 3, 3),
        (2, 3, 5, 3, 3, 4),
        (2, 3, 5, 7, 3, 5),
        (2, 3, 5, 70, 3, 5),  # never past the batch's own version
        (2, 3, 1, 0, 0, 0),
        (2, 3, 1, 9, 0, 1),
    ],
)
def test_version_schedule(k, every, batch, rounds, start, target):
    sched = VersionSchedule(k, every)
    assert sched.start(batch) == start
    assert sched.target(batch, rounds) == target


def test_version_schedule_validation():
    with pytest.raises(ValueError, match="max_staleness=-1 must be >= 0"):
        VersionSchedule(-1)
    with pytest.raises(ValueError, match="sync_every_rounds=-2 must be >= 0"):
        VersionSchedule(1, -2)


def test_weight_store_copies_waits_and_survives_donation():
    store = WeightStore()
    params = {"w": jnp.arange(4.0)}
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.get(3)))
    waiter.start()
    store.publish(3, params, POLICY)
    waiter.join(timeout=30)
    copy, policy, waited = got[0]
    assert policy is POLICY and waited >= 0.0
    assert copy["w"].unsafe_buffer_pointer() != params["w"].unsafe_buffer_pointer()
    # the learner's update donates its state: the published copy is untouched
    donate = jax.jit(lambda p: {"w": p["w"] * 2.0}, donate_argnums=0)
    donate(params)
    np.testing.assert_array_equal(copy["w"], np.arange(4.0))
    store.publish(4, copy, POLICY)
    store.drop_below(4)
    assert store.versions() == [4]
    with pytest.raises(KeyError, match="version 3 was dropped"):
        store.get(3)
    store.close()
    with pytest.raises(StoreClosed):
        store.get(9)


def test_deferred_environment_steps_change_no_token(setup):
    """Observations recorded later (two calls at a time, run on threads while the other slots
    decode) leave every token and logprob of a parity policy as the synchronous loop samples
    them."""
    tok, model, p0, _ = setup
    plain = run_episodes(
        model, p0, TASKS, lambda: EchoEnv(tok), tok, SAMPLING, jax.random.key(7), n_slots=N_SLOTS
    )
    clock = BatchClock(_store(setup), VersionSchedule(1, 0), batch=1)
    with ThreadPoolExecutor(4) as pool:
        traj = VersionedLoop(_loop(setup, p0), clock, "continue", pool, resolve_at=2).run()
    assert clock.switches == 0 and clock.rounds > 0
    np.testing.assert_array_equal(traj.tokens, plain.tokens)
    np.testing.assert_array_equal(traj.rollout_logprobs, plain.rollout_logprobs)
    act = plain.action_mask
    assert (traj.policy_versions[act] == 0).all() and (traj.policy_versions[~act] == -1).all()
    assert len(traj.logs) == len(plain.logs)


def _sampled_prefix(traj, b, n):
    """The first ``n`` sampled tokens of row ``b``."""
    return traj.tokens[b][traj.action_mask[b]][:n]


@pytest.mark.parametrize("mode", ["continue", "reprefill"])
def test_partial_rollouts_keep_what_was_decoded(setup, mode):
    """At the switch nothing decoded is lost: every episode's tokens sampled before it equal
    those of a rollout that never switched; later tokens carry the new version. Re-prefilled
    episodes sample from exactly the new version (their logprobs are its teacher-forced ones
    under the parity policy); continued ones decode over the old version's KV."""
    _, model, p0, p1 = setup
    base, _ = _play(setup, mode, every=0)
    traj, clock = _play(setup, mode, every=3)
    assert clock.switches == 1 and clock.version == 1
    versions, act = traj.policy_versions, traj.action_mask
    assert set(np.unique(versions[act])) == {0, 1}
    mixed = 0
    for b in range(len(TASKS)):
        v = versions[b][act[b]]
        assert (np.diff(v) >= 0).all()  # one switch: old version first
        n_old = int((v == 0).sum())
        prefix = _sampled_prefix(traj, b, n_old)
        np.testing.assert_array_equal(prefix, _sampled_prefix(base, b, n_old))
        mixed += 0 < n_old < len(v)
    assert mixed >= 1
    lp0, _ = trainer_logprobs(model, p0, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    lp1, _ = trainer_logprobs(model, p1, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    old, new = act & (versions == 0), act & (versions == 1)
    np.testing.assert_array_equal(traj.rollout_logprobs[old], lp0[old])
    if mode == "reprefill":
        assert clock.reprefilled >= 1
        np.testing.assert_array_equal(traj.rollout_logprobs[new], lp1[new])
    else:  # tokens after the switch in a mixed episode attend to KV of the old weights
        assert not np.array_equal(traj.rollout_logprobs[new], lp1[new])


def test_abort_restarts_episodes_in_flight(setup):
    _, model, _, p1 = setup
    traj, clock = _play(setup, "abort", every=3)
    act, versions = traj.action_mask, traj.policy_versions
    assert clock.aborted >= 1 and clock.discarded_tokens >= 1
    for b in range(len(TASKS)):  # an episode is of one version: aborted ones restarted
        assert len(np.unique(versions[b][act[b]])) == 1
    assert (versions[act] == 1).any() and (versions[act] == 0).any()
    restarted = {r["episode"] for r in traj.logs if r.get("aborted")}
    assert restarted and all(set(np.unique(versions[b][act[b]])) == {1} for b in restarted)
    lp1, _ = trainer_logprobs(model, p1, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    new = act & (versions == 1)
    np.testing.assert_array_equal(traj.rollout_logprobs[new], lp1[new])
    assert traj.success.all()


def test_rollout_waits_for_a_version_not_published_yet(setup):
    """A switch point blocks until the learner publishes the version it needs."""
    _, _, p0, p1 = setup
    store = WeightStore()
    store.publish(0, p0, POLICY)
    clock = BatchClock(store, VersionSchedule(1, 2), batch=1)
    publisher = threading.Timer(0.5, lambda: store.publish(1, p1, POLICY))
    publisher.start()
    traj = VersionedLoop(_loop(setup, p0), clock, "continue").run()
    assert clock.version == 1 and clock.wait_s >= 0.3
    assert (traj.policy_versions[traj.action_mask] == 1).any()
