"""Sparse blocks recorded per layer and token in the rollout and replayed in training: parity 0
under a parity policy with replay, together with KV eviction and int8 pages."""

import jax
import numpy as np
import pytest
from rollout_setup import CFG, N_SLOTS, SAMPLING
from test_agent_loop import play

from agentrl_jax.model.chunked import ChunkSpec, sequence_logprobs
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import RLConfig
from agentrl_jax.rl.update import prepare_batch
from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.parity import trainer_logprobs

GATHER = CFG.replace(sparse_gather=True)
RECORD = SAMPLING.replace(record_blocks=True)
POLICY = EvictionConfig(threshold=1.0, min_block=2, int8=True, drop_threshold=0.75)


@pytest.fixture(scope="module")
def recorded(fp32_model, tokenizer):
    """A sparse_gather rollout with eviction + int8 in a shared pool, blocks recorded."""
    model = Transformer(GATHER, get_policy("fp32-parity"))
    params = fp32_model[1]
    traj, _, stats = play(
        model, params, tokenizer, sampling_cfg=RECORD, eviction=POLICY, n_pages=48, page_budget=9
    )
    return model, params, traj, stats


def test_blocks_are_recorded_per_layer_and_token(recorded):
    _, _, traj, stats = recorded
    blocks = np.asarray(traj.sparse_blocks)
    n_sel = min(GATHER.sparse_topk_blocks, RECORD.max_len // GATHER.sparse_block_size)
    assert blocks.shape == (*traj.tokens.shape, 1, GATHER.n_kv_heads, n_sel)
    pos = np.arange(traj.tokens.shape[1])[None, :, None, None]
    own = pos // GATHER.sparse_block_size
    np.testing.assert_array_equal(blocks[..., 0], np.broadcast_to(own, blocks.shape[:-1]))
    later = blocks[..., 1:]
    assert ((later == -1) | (later < own[..., None])).all()  # causal, -1 unused
    assert (later >= 0).any() and stats.evicted_tokens > 0 and stats.int8_tokens > 0


def test_replay_gives_parity_zero_with_eviction_and_int8(recorded):
    model, params, traj, _ = recorded
    act = np.asarray(traj.action_mask)
    lp, _ = trainer_logprobs(
        model, params, traj, sampling_cfg=RECORD, n_slots=N_SLOTS, replay_kv=True,
        replay_blocks=True,
    )  # fmt: skip
    np.testing.assert_array_equal(lp[act], traj.rollout_logprobs[act])
    # other blocks give other numbers: the replayed selection is the one attended to
    shifted = traj.replace(sparse_blocks=np.where(traj.sparse_blocks > 0, 0, traj.sparse_blocks))
    other, _ = trainer_logprobs(
        model, params, shifted, sampling_cfg=RECORD, n_slots=N_SLOTS, replay_kv=True,
        replay_blocks=True,
    )  # fmt: skip
    assert np.abs(other[act] - traj.rollout_logprobs[act]).max() > 0


def test_update_path_replays_blocks_and_routes(recorded):
    """The update's batch carries ``sparse_blocks`` and ``routes``; its logprob pass replaying
    both reproduces the rollout bitwise (one sampler-sized micro-batch of episodes of different
    lengths). Tokens the rollout never ran (the last sampled token, the final observation,
    padding) have routes -1, which the replay leaves to the router: forced experts there would
    move the other rows' tokens in the expert buffers and change their numbers."""
    model, params, traj, _ = recorded
    rows = slice(0, N_SLOTS)
    keys = ("tokens", "valid", "action_mask", "kv_evict_at", "kv_int8_at", "sparse_blocks")
    batch = {k: np.asarray(getattr(traj, k))[rows] for k in (*keys, "routes")}
    batch["advantages"] = np.zeros(batch["tokens"].shape, np.float32)
    routes, valid = batch["routes"], batch["valid"]
    unrun = (routes < 0).all(axis=(2, 3))
    assert ((routes >= 0).all(axis=(2, 3)) | unrun).all()  # a token is recorded or not
    assert unrun[~valid].all() and (unrun & valid).any() and not unrun[batch["action_mask"]].any()
    assert len(set(valid.sum(1).tolist())) > 1  # padded rows share the chunks
    cfg = RLConfig(use_kv_mask_replay=True, use_block_replay=True, use_routing_replay=True)
    data = prepare_batch(batch, cfg, model)
    spec = ChunkSpec(RECORD.chunk, RECORD.page_size, RECORD.max_len)
    fn = jax.jit(
        lambda p, d: sequence_logprobs(
            model, p, d["tokens"], evict_at=d["evict_at"], int8_at=d["int8_at"],
            replay_blocks=d["blocks"], replay_routes=d.get("routes"), chunk_spec=spec,
        )[0]
    )  # fmt: skip
    m = np.asarray(data["mask"])
    want = np.asarray(traj.rollout_logprobs)[rows, 1:][m]
    np.testing.assert_array_equal(np.asarray(fn(params, data))[m], want)
    # the same batch without routing replay: the router's own experts give the same numbers
    no_routes = prepare_batch(batch, cfg.replace(use_routing_replay=False), model)
    np.testing.assert_array_equal(np.asarray(fn(params, no_routes))[m], want)
    with pytest.raises(ValueError, match="sparse_blocks"):
        prepare_batch({k: v for k, v in batch.items() if k != "sparse_blocks"}, cfg, model)


def test_disaggregation_refuses_block_records(fp32_model, tokenizer):
    model, params = fp32_model
    split = Disaggregation(prefill_devices=(0, 1), decode_devices=(2, 3))
    with pytest.raises(ValueError, match="record_blocks"):
        play(model, params, tokenizer, sampling_cfg=RECORD, disaggregate=split)
