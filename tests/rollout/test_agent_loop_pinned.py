"""Pinned rollouts: fixed small multi-turn runs must keep their exact tokens, logprobs and logs.

Each scenario combines the agent loop's mechanisms (continuous batching, a shared page pool
that forces preemption, KV eviction, int8 KV, prefill/decode disaggregation, lockstep waves,
greedy members, twin-slot copies, the fast decode kernel) and is reduced to two SHA-256s: one
over every trajectory array but the logprobs, the per-turn logs and the rollout counters, one
over the logprobs. The digests were recorded on CPU with jax 0.10; other backends and XLA
versions may round differently, so there the test is skipped.
"""

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import pytest
from conftest import CFG
from test_agent_loop import N_PAGES, play

from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.trajectory import ARRAY_FIELDS, log_lines

SCENARIOS = {
    "pool_evict_goal": dict(
        n_pages=N_PAGES,
        page_budget=7,
        eviction=EvictionConfig(threshold=0.9, min_block=2),
        goal_every=2,
        group_ids=[0, 0, 1, 1, 2],
        process_weights={"x": 2.0},
        max_turns=3,
    ),
    "int8_pool": dict(
        n_pages=N_PAGES,
        page_budget=7,
        eviction=EvictionConfig(threshold=0.9, min_block=2, int8=True),
    ),
    "disaggregated_pool": dict(
        n_pages=N_PAGES,
        page_budget=7,
        disaggregate=Disaggregation(prefill_devices=(0, 1, 2, 3), decode_devices=(4, 5, 6, 7)),
    ),
    "lockstep_greedy_twins": dict(
        tasks=[4, 4, 4, 9, 9],
        continuous=False,
        greedy=[False, True, False, False, True],
        max_tokens=40,
    ),
    "fast_kernel_twins_pool": dict(tasks=[4, 4, 4, 9, 9, 2], n_pages=N_PAGES, fast=True),
}

EXPECTED_STREAM = {
    "disaggregated_pool": "e0ca7148b817c0b757485c8abffdfe0bd19958e4ff60061a30a0428b891db47b",
    "fast_kernel_twins_pool": "0db40a6df8a853535fcb22f0cd787100a4d05ce4bc506fe100da0a6aee0cdf09",
    "int8_pool": "6ab48e90173c2c143bb9ae91c98676fcd1686b8da2cd87f70e3d116e0f3018b0",
    "lockstep_greedy_twins": "7120a979e421a9ae91b4143cbab03ba76966fecd75068c0465fe6b93f54f0a99",
    "pool_evict_goal": "6f8d2ceb01a0d8332e23eb27daa907f5f94caf1bdc29c08e0ce8d330a739935c",
}
# rollout_logprobs round differently with the CPU backend's LLVM optimisation level
# (``make test`` runs level 0); keyed by (scenario, level 0).
EXPECTED_LOGPROBS = {
    (
        "disaggregated_pool",
        False,
    ): "b2833ba50bd2a1c521c71a8649fdb272f00c9462f80eeaeba799fc1a9e04c3f5",
    (
        "disaggregated_pool",
        True,
    ): "3dad836823982172824b4a52a5f8eb3e330180bae8731828d00e5478ef236060",
    (
        "fast_kernel_twins_pool",
        False,
    ): "a06026ff15e7ad292a7132bd4da80fe6b4e33a756985075aa6661d65eb588f7c",
    (
        "fast_kernel_twins_pool",
        True,
    ): "9956a6c4ec60568d0b488cf71363665117634ea323de7005f81846afcbfc24c6",
    ("int8_pool", False): "5a0acc324f4d07b4bbe70f94de6c8a7bd97df50f0af25a0bc32a6bc4d0b52e3b",
    ("int8_pool", True): "f2a4b58253ee14c9744d7658c30c992ffb114d177726c7ce10393a2275552a85",
    (
        "lockstep_greedy_twins",
        False,
    ): "1b42f0360b3b96c6b10e8844d7ae5bde5150013072c7d2b177b7dea27539293b",
    (
        "lockstep_greedy_twins",
        True,
    ): "41b4e62a497d7774c726d2381809fc5733269888a0deb3135c55560187c22ca9",
    ("pool_evict_goal", False): "ba3aa544e32384f5e222987d5e27f24b2979e37b26b42a0199e6eaa32f3ea411",
    ("pool_evict_goal", True): "7705f90dfe4f10e67daea470b4638b01833967f09dce14ffb904cf606f80b1f3",
}


def _update(h, name: str, x) -> None:
    if x is None:
        h.update(f"{name}:None;".encode())
        return
    x = np.ascontiguousarray(x)
    h.update(f"{name}:{x.dtype}:{x.shape};".encode())
    h.update(x.tobytes())


def digest(traj, stats) -> dict[str, str]:
    """SHA-256s of ``traj``: ``stream`` over every array but the logprobs (dtype, shape,
    bytes), the logs and ``stats``; ``logprobs`` over ``rollout_logprobs``."""
    h = hashlib.sha256()
    for name in ARRAY_FIELDS:
        if name != "rollout_logprobs":
            _update(h, name, getattr(traj, name))
    for line in log_lines(traj):
        h.update(line.encode())
    counters = {
        k: sorted(v) if isinstance(v, set) else v for k, v in dataclasses.asdict(stats).items()
    }
    h.update(json.dumps(counters, sort_keys=True).encode())
    lp = hashlib.sha256()
    _update(lp, "rollout_logprobs", traj.rollout_logprobs)
    return {"stream": h.hexdigest(), "logprobs": lp.hexdigest()}


def run_scenario(name, fp32_model, tokenizer):
    """Plays scenario ``name``; returns (trajectory, stats)."""
    kw = dict(SCENARIOS[name])
    model, params = fp32_model
    if kw.pop("fast", False):
        model = Transformer(CFG, get_policy("fp32"))
    traj, _, stats = play(model, params, tokenizer, **kw)
    return traj, stats


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_pinned_rollout(name, fp32_model, tokenizer):
    if jax.default_backend() != "cpu" or not jax.__version__.startswith("0.10."):
        pytest.skip("digests recorded on CPU with jax 0.10")
    traj, stats = run_scenario(name, fp32_model, tokenizer)
    got = digest(traj, stats)
    assert got["stream"] == EXPECTED_STREAM[name]
    opt0 = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    assert got["logprobs"] == EXPECTED_LOGPROBS[name, opt0]
