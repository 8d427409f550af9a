"""int8 KV of low-attention tool outputs: recorded masks, KV bytes, bitwise replay in training."""

import jax
import numpy as np
import pytest
from rollout_setup import CFG, N_SLOTS, SAMPLING
from test_agent_loop import N_PAGES, play

from agentrl_jax.model.chunked import ChunkSpec, sequence_logprobs
from agentrl_jax.rl.state import RLConfig
from agentrl_jax.rl.update import prepare_batch
from agentrl_jax.rollout.kv_cache import EvictionConfig, kv_bytes_per_seq
from agentrl_jax.rollout.parity import trainer_logprobs

NEVER = np.iinfo(np.int32).max
INT8 = EvictionConfig(threshold=0.9, min_block=2, int8=True)


@pytest.fixture(scope="module", params=["fp32_model", "bf16_model"])
def int8_run(request, tokenizer):
    model, params = request.getfixturevalue(request.param)
    traj, _, stats = play(model, params, tokenizer, eviction=INT8)
    return model, params, traj, stats


def test_int8_kv_records_masks_saves_bytes_and_replays_exactly(int8_run):
    model, params, traj, stats = int8_run
    q8 = np.asarray(traj.kv_int8_mask) & np.asarray(traj.valid)
    assert stats.int8_tokens > 0 and q8.sum() > 0
    assert stats.evicted_tokens == 0 and np.asarray(traj.kv_keep_mask).all()  # nothing dropped
    at = np.asarray(traj.kv_int8_at)
    np.testing.assert_array_equal(traj.kv_int8_mask, at != NEVER)
    assert np.all(at[q8] % SAMPLING.chunk == 0)  # takes effect at chunk-aligned positions
    pos = np.nonzero(q8)[1]
    assert np.all(at[q8] > pos) and not np.asarray(traj.action_mask)[q8].any()  # tool outputs
    # without a shared pool every slot holds max_len worth of float pages, int8 or not: the
    # logged bytes are those live buffers (the int8 pool's savings: test_kv_memory.py)
    static = [r["kv_bytes"] for r in traj.logs]
    assert [r for r in traj.logs if r["int8_tokens"] > 0] and len(set(static)) == 1
    per_slot = kv_bytes_per_seq(CFG, model.policy, SAMPLING.max_len, SAMPLING.page_size)
    assert static[0] == per_slot and all(r["int8_pages_in_use"] == 0 for r in traj.logs)
    act = np.asarray(traj.action_mask)
    replay, _ = trainer_logprobs(
        model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS, replay_kv=True
    )
    np.testing.assert_array_equal(replay[act], traj.rollout_logprobs[act])
    full, _ = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    assert np.abs(full[act] - traj.rollout_logprobs[act]).max() > 0


def test_int8_kv_survives_preemption(int8_run, tokenizer):
    """A page budget that preempts: resumed episodes re-apply the same int8 decisions."""
    model, params, ref, _ = int8_run
    if model.policy.name != "fp32-parity":
        pytest.skip("one policy is enough")
    tight, _, stats = play(model, params, tokenizer, eviction=INT8, n_pages=N_PAGES, page_budget=7)
    assert stats.preemptions > 0 or stats.admission_waits > 0
    np.testing.assert_array_equal(tight.tokens, ref.tokens)
    np.testing.assert_array_equal(tight.kv_int8_at, ref.kv_int8_at)
    np.testing.assert_array_equal(tight.rollout_logprobs, ref.rollout_logprobs)


def test_update_path_replays_int8(int8_run):
    """The RL update's batch carries ``kv_int8_at`` and its logprob pass reproduces the engine."""
    model, params, traj, _ = int8_run
    if model.policy.name != "fp32-parity":
        pytest.skip("one policy is enough")
    rows = slice(0, N_SLOTS)  # one sampler-sized micro-batch: bitwise
    batch = {k: np.asarray(getattr(traj, k))[rows] for k in ("tokens", "valid", "action_mask")}
    batch.update(
        advantages=np.zeros(batch["tokens"].shape, np.float32),
        kv_evict_at=np.asarray(traj.kv_evict_at)[rows],
        kv_int8_at=np.asarray(traj.kv_int8_at)[rows],
    )
    data = prepare_batch(batch, RLConfig(use_kv_mask_replay=True), model)
    spec = ChunkSpec(SAMPLING.chunk, SAMPLING.page_size, SAMPLING.max_len)
    fn = jax.jit(
        lambda p, t, e, q: sequence_logprobs(model, p, t, evict_at=e, int8_at=q, chunk_spec=spec)[0]
    )
    lp = np.asarray(fn(params, data["tokens"], data["evict_at"], data["int8_at"]))
    m = np.asarray(data["mask"])
    np.testing.assert_array_equal(lp[m], np.asarray(traj.rollout_logprobs)[rows, 1:][m])


def test_kv_bytes_int8_accounting():
    from agentrl_jax.precision import get_policy

    pol = get_policy("fp32")
    k, h, page = CFG.n_kv_heads, CFG.head_dim, 8
    per_tok = 2 * k * h
    base = kv_bytes_per_seq(CFG, pol, 20, page)
    # 6 int8 tokens on 2 pages: 4-byte floats become 1 byte, plus 2 pages x (K and V) x K scales
    got = kv_bytes_per_seq(CFG, pol, 20, page, int8_tokens=6, int8_pages=2)
    assert got == base - 6 * per_tok * 3 + 2 * 2 * k * 4
    # an int8 policy: the 2 complete pages are int8, the tail page and the S ring stay bf16
    q = get_policy("bf16-int8kv")
    ring = CFG.window * per_tok * 2
    assert (
        kv_bytes_per_seq(CFG, q, 20, page) == ring + 16 * per_tok + 2 * 2 * k * 4 + 8 * per_tok * 2
    )


def test_rollout_config_eviction_fields_are_the_default_eviction(fp32_model, tokenizer):
    """``rollout.eviction_threshold`` / ``eviction_int8`` (config keys) act as ``eviction=``."""
    model, params = fp32_model
    cfg = SAMPLING.replace(eviction_threshold=0.9, eviction_int8=True)
    via_cfg, _, stats = play(model, params, tokenizer, sampling_cfg=cfg)
    explicit, _, _ = play(
        model, params, tokenizer, eviction=EvictionConfig(threshold=0.9, int8=True)
    )
    assert stats.int8_tokens > 0
    for name in ("tokens", "kv_int8_at", "kv_evict_at", "rollout_logprobs"):
        np.testing.assert_array_equal(getattr(via_cfg, name), getattr(explicit, name))
    with pytest.raises(ValueError, match="eviction_threshold"):
        SAMPLING.replace(eviction_threshold=1.5)
