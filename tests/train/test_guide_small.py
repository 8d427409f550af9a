"""experiments/guide_small.py (the practice guide's architecture) runs SFT -> RL in smoke mode:
sparse gathered full attention with recorded blocks, MoE with routing replay, int8 + eviction of
tool outputs in a shared page pool, under a parity policy whose replays make the trainer's
logprobs the sampler's."""

import json
import os

import pytest

from agentrl_jax.config import load_config
from agentrl_jax.train.main import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GUIDE = os.path.join(ROOT, "experiments", "guide_small.py") + ":smoke=True"


@pytest.mark.slow  # ~70 CPU-s: SFT, two evaluations and an RL step of a 4-layer MoE compile
def test_guide_small_smoke_sft_then_rl_with_parity_zero(tmp_path):
    cfg = load_config(GUIDE, [f"workdir={tmp_path}", "train.rl_steps=1", "mesh.devices=1"])
    assert cfg.model.sparse_gather and cfg.rollout.record_blocks and cfg.rollout.eviction_int8
    summary = run(cfg, progress=False)
    assert summary["nonfinite_steps"] == 0 and summary["rl_steps"] == 1
    assert "heldout_success_before_rl" in summary and "heldout_success_after_rl" in summary
    lines = [json.loads(x) for x in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    keys = set().union(*lines)
    assert any(k.startswith("sft/") for k in keys)
    rl = [x for x in lines if "rl/reward" in x]
    assert len(rl) == 1
    # KV bytes measured on the live pools, and parity with the replays: exactly 0
    assert rl[0]["rl/kv_bytes_per_seq_peak"] > 0
    assert rl[0]["rl/mismatch/max_abs_dlogp"] == 0.0
    assert rl[0]["rl/mismatch/routing_exact_agreement"] == 1.0
