"""Pinned rollouts: fixed small multi-turn runs must keep their exact tokens, logprobs and logs.

Each scenario combines the agent loop's mechanisms (continuous batching, a shared page pool
that forces preemption, KV eviction, int8 KV, prefill/decode disaggregation, lockstep waves,
greedy members, twin-slot copies, the fast decode kernel) and is reduced to three SHA-256s: one
over the trajectory arrays of ``PINNED_FIELDS`` (tokens, masks, routes, rewards, KV marks), one
over the per-turn logs and the rollout counters (scheduling and the KV memory measured on the
live pools), one over the logprobs. The digests were recorded on CPU with jax 0.10; other
backends and XLA versions may round differently, so there the test is skipped.
"""

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import pytest
from agentrl_jax.kernels import skinny_matmul_cpu
from rollout_setup import CFG
from test_agent_loop import N_PAGES, play

from agentrl_jax import kernels
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.trajectory import ARRAY_FIELDS, log_lines

# every trajectory array but the logprobs and the (here unused) sparse block records
PINNED_FIELDS = tuple(f for f in ARRAY_FIELDS if f not in ("rollout_logprobs", "sparse_blocks"))

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

EXPECTED_ARRAYS = {
    "disaggregated_pool": "5bcba0cc424b9c4556975aa480458d5312f52ed4cb7e95e2280565a37b17a4a8",
    "fast_kernel_twins_pool": "eed8409dbbd1ccd09473c3dec7a3b27eaf67c0dd993ebb17a8f590a61485dc02",
    "int8_pool": "1fc5fa186c7990ead1bd5b818887492a3500c10f3aadce516f66b209993f9ce8",
    "lockstep_greedy_twins": "cee7191b5e36863c1dcfbab512647d695103d3b643ddbd2e6117ccc37be33ebf",
    # an episode resumed alone prefills its pending observation before it ends truncated, so
    # those tokens carry their routes (tokens never run through the model have routes -1)
    "pool_evict_goal": "1bae56d4d14fb79b7eb6c6dc31af2f2881c806981d07939c47ce8ca6b9bb36eb",
}
EXPECTED_LOGS = {
    "disaggregated_pool": "7c69ddad712d8b25840b43932214e01b8706d1bf6a9463ecb661b4440e753820",
    "fast_kernel_twins_pool": "32db44f99a39a090c55fcab031bb78cf0694dd0cf2bceb07b728649cb2767fe4",
    "int8_pool": "27e8d50ca968b2ab88958c1887e6f8fa4319ac06072fadd7ec299103be612c5d",
    "lockstep_greedy_twins": "788f21741f8e922bef052acfc40aad12de4ab2e09d8bbfdac2d55776c1f4a463",
    "pool_evict_goal": "23593158cd4bdf9097aff21982c1cdd7e5a55156775ac7a725449527e1a7edd9",
}
# rollout_logprobs round differently with the CPU backend's LLVM optimisation level
# (``make test`` runs level 0); keyed by (scenario, level 0).
EXPECTED_LOGPROBS = {
    (
        "disaggregated_pool",
        False,
    ): "cef4b26200a6355c3871e140d02d62d4e71d1929ee7d0e993d3af30befdd25ae",
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
    ("int8_pool", False): "49742e775e3386ad68f050b32c5daa4a631100371f5a1148d0d6b5a67feb0162",
    ("int8_pool", True): "f2a4b58253ee14c9744d7658c30c992ffb114d177726c7ce10393a2275552a85",
    (
        "lockstep_greedy_twins",
        False,
    ): "428a71e4c32244cab8ae422c7e3637dc4f5fc8a04faf93b14b97b59cfd90b1ac",
    (
        "lockstep_greedy_twins",
        True,
    ): "41b4e62a497d7774c726d2381809fc5733269888a0deb3135c55560187c22ca9",
    ("pool_evict_goal", False): "4a366ac5216efeb8734b1c4e8c4225023f322ebe481d155896e515c50eb9d6d9",
    ("pool_evict_goal", True): "7705f90dfe4f10e67daea470b4638b01833967f09dce14ffb904cf606f80b1f3",
}
# The fast scenario decodes through the C++ kernels where they build (the paged decode of
# ``kernels.paged_decode_cpu`` and the weight matmuls of ``kernels.skinny_matmul_cpu``; above:
# XLA's). Same tokens and logs; its logprobs round differently.
NATIVE_LOGPROBS = {
    (
        "fast_kernel_twins_pool",
        False,
    ): "5c57898f656121fed6f08081ae91eba341afaef44ff8691f1ccda4aa60b021f4",
    (
        "fast_kernel_twins_pool",
        True,
    ): "82b338d6bf2519069b89776fc19962ab1ee0534ea234a4f90cc3bac669479c1a",
}


def _update(h, name: str, x) -> None:
    if x is None:
        h.update(f"{name}:None;".encode())
        return
    x = np.ascontiguousarray(x)
    h.update(f"{name}:{x.dtype}:{x.shape};".encode())
    h.update(x.tobytes())


def digest(traj, stats) -> dict[str, str]:
    """SHA-256s of ``traj``: ``arrays`` over ``PINNED_FIELDS`` (dtype, shape, bytes), ``logs``
    over the per-turn logs and ``stats``, ``logprobs`` over ``rollout_logprobs``."""
    assert traj.sparse_blocks is None
    h = hashlib.sha256()
    for name in PINNED_FIELDS:
        _update(h, name, getattr(traj, name))
    logs = hashlib.sha256()
    for line in log_lines(traj):
        logs.update(line.encode())
    counters = {
        k: sorted(v) if isinstance(v, set) else v for k, v in dataclasses.asdict(stats).items()
    }
    logs.update(json.dumps(counters, sort_keys=True).encode())
    lp = hashlib.sha256()
    _update(lp, "rollout_logprobs", traj.rollout_logprobs)
    return {"arrays": h.hexdigest(), "logs": logs.hexdigest(), "logprobs": lp.hexdigest()}


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
    assert got["arrays"] == EXPECTED_ARRAYS[name]
    assert got["logs"] == EXPECTED_LOGS[name]
    opt0 = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    native = kernels.select_impl("paged_decode") == "cpu" and skinny_matmul_cpu.available()
    want = NATIVE_LOGPROBS.get((name, opt0)) if native else None
    assert got["logprobs"] == (want or EXPECTED_LOGPROBS[name, opt0])
