"""Prefill on devices 0-3, decode on 4-7 (8 fake CPU devices): same tokens, KV moved and logged."""

import numpy as np
import pytest
from test_agent_loop import N_PAGES, play

from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig

SPLIT = Disaggregation(prefill_devices=(0, 1, 2, 3), decode_devices=(4, 5, 6, 7))


@pytest.fixture(scope="module")
def played(fp32_model, tokenizer):
    """The colocated fp32-parity run."""
    return play(*fp32_model, tokenizer)


def test_disaggregated_rollout_is_bitwise_the_colocated_one(played, fp32_model, tokenizer):
    model, params = fp32_model  # fp32-parity
    ref, _, _ = played
    for kw in ({}, dict(n_pages=N_PAGES, page_budget=7)):  # own pages; shared pool + preemption
        traj, _, stats = play(model, params, tokenizer, disaggregate=SPLIT, **kw)
        np.testing.assert_array_equal(traj.tokens, ref.tokens)
        np.testing.assert_array_equal(traj.rollout_logprobs, ref.rollout_logprobs)
        np.testing.assert_array_equal(traj.routes, ref.routes)
        assert stats.prefill_devices == {0, 1, 2, 3} and stats.decode_devices == {4, 5, 6, 7}
        moved = [r["kv_moved_bytes"] for r in traj.logs]
        assert all(m > 0 for m in moved)  # every turn was preceded by a prefill -> decode move
        assert sum(moved) <= stats.kv_moved_bytes  # the rest: prefills after the last turn
    assert stats.preemptions > 0 or stats.admission_waits > 0


def test_colocated_logs_no_moves_and_bad_configs(played, fp32_model, tokenizer):
    traj, _, stats = played
    assert all(r["kv_moved_bytes"] == 0 for r in traj.logs) and stats.kv_moved_bytes == 0
    with pytest.raises(ValueError, match="overlap"):
        Disaggregation((0, 1), (1, 2))
    with pytest.raises(ValueError, match="non-empty"):
        Disaggregation((), (1,))
    with pytest.raises(ValueError, match="devices"):
        Disaggregation((0,), (99,)).meshes()
    model, params = fp32_model
    with pytest.raises(ValueError, match="eviction"):
        play(model, params, tokenizer, disaggregate=SPLIT, eviction=EvictionConfig(threshold=0.5))
