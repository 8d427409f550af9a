"""Pinned rollouts: fixed small multi-turn runs must keep their exact tokens, logs and
logprobs.

Each scenario combines the agent loop's mechanisms (continuous batching, a shared page pool
that forces preemption, KV eviction, int8 KV, prefill/decode disaggregation, lockstep waves,
greedy members, twin-slot copies, the fast decode kernel) and is reduced to SHA-256s: one over
the trajectory arrays of ``PINNED_FIELDS`` (tokens, masks, routes, rewards, KV marks), one over
the per-turn logs and the rollout counters (scheduling and the KV memory measured on the live
pools). Tokens, masks and logs are the same on every x86-64 CPU; they are pinned everywhere.

The last bits of a logprob are the machine's (XLA's CPU code and the C++ kernels follow the
CPU's vector extensions), so the logprobs are checked against a reference path on every
machine: the trainer's teacher-forced recompute of the same tokens (``trainer_logprobs``, the
recorded KV decisions replayed), within ``LOGPROB_TOL``. Their exact digest is an extra check
only on the machine that recorded it (``machine()`` equal to ``RECORDED_MACHINE``).
``make test-any-cpu`` runs the suite as a machine without AVX-512 would, so a check that holds
on this CPU alone cannot land unseen. The digests were recorded on CPU with jax 0.10; other
backends and XLA versions may round differently, so there the test is skipped.
"""

import dataclasses
import hashlib
import json
import os
import platform

import jax
import jaxlib
import numpy as np
import pytest
from agentrl_jax.kernels import native, skinny_matmul_cpu
from rollout_setup import CFG, N_SLOTS, SAMPLING
from test_agent_loop import N_PAGES, play

from agentrl_jax import kernels
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.disaggregation import Disaggregation
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.parity import trainer_logprobs
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
EXPECTED_LOGS = {  # the per-turn logs carry each step's hack_suspect flags
    "disaggregated_pool": "39dd9c5a6057903f30ec1855e70484505325fadc36ad7dcd296b155c35ca1376",
    "fast_kernel_twins_pool": "eaf57ac4f4f17d9d26492860da5f43fe068ab85c12bad45f8edbc00362876f5f",
    "int8_pool": "14cb59bea4fb573d4f1fc6d8f7a1d7d3b0827a278e1be4d1b54e51f80ce9edaf",
    "lockstep_greedy_twins": "62dbf29feefaffab9cf665afead8dde1291e003c4f5304391927e84c2dacf227",
    "pool_evict_goal": "c95506e3f0854e1638c4452c4e60e54d5519b56c3f60f6c69e7dc6bc4e57e696",
}
# rollout_logprobs round differently with the CPU backend's LLVM optimisation level
# (``make test`` runs level 0); keyed by (scenario, level 0).
EXPECTED_LOGPROBS = {
    (
        "disaggregated_pool",
        False,
    ): "f798fdaa5d72186cb9c8aa25169f7984163cebf54c9464c6c756dcba8151f483",
    (
        "disaggregated_pool",
        True,
    ): "05652ce8f76a9ee18c079dfc01b0f92ae42b4d05aa6fc678d606776376ad79bc",
    (
        "fast_kernel_twins_pool",
        False,
    ): "2878a82cd35646ccb43a9e186309a6b38dc0f7496e6a644dd066d2dddf738e4c",
    (
        "fast_kernel_twins_pool",
        True,
    ): "01a41f0c62d0968750aa1c42ec3083e7d8511e6ad9d895c434d3a4666eca1870",
    ("int8_pool", False): "18a8352072816db43697d6695d1e257796eee875d1be67ac963eb8d208273a76",
    ("int8_pool", True): "63d7fc3c7b3968e70153169166bd73652cc2e6b99d175477e2792f62d3691ac3",
    (
        "lockstep_greedy_twins",
        False,
    ): "98e66c73d49fa73339213b084738c39f87149e9cec949481f031f2a6472ea561",
    (
        "lockstep_greedy_twins",
        True,
    ): "4838724d699c057c1eb29c868e1f1dcbb65ba220e68497637d385c622ed06c12",
    ("pool_evict_goal", False): "b0ea25ce44fc1e6fd894c096806a1a9138fa2e41725c57884c338a3443212f5c",
    ("pool_evict_goal", True): "c23ddfc5e21324646533ebfe32aa6db3801c590372ec5bec0c6d36b4f6304ad5",
}
# The fast scenario decodes through the C++ kernels where they build (the paged decode of
# ``kernels.paged_decode_cpu`` and the weight matmuls of ``kernels.skinny_matmul_cpu``; above:
# XLA's). Same tokens and logs; its logprobs round differently.
NATIVE_LOGPROBS = {
    (
        "fast_kernel_twins_pool",
        False,
    ): "0d7041eb4ad51523cdbfc98e1da92e7942a74580636755334bc4aca823cb0dec",
    (
        "fast_kernel_twins_pool",
        True,
    ): "95a546ec135e41a395a1e3baa98692cbcd58c2c29d95a228b4659393962aefaf",
}


# Tolerance of the logprob check, keyed by ``policy.parity``: under a parity policy the recompute
# is the sampler's own chunked pass on the same machine, so equal bitwise on any CPU; the fast
# policy's teacher pass sums in another order than its decode kernels (float32: up to 1e-6
# seen, a few ulps of the logits over a 1k vocabulary).
LOGPROB_TOL = {True: 0.0, False: 1e-5}
# ``machine()`` of the machine the logprob digests were recorded on.
RECORDED_MACHINE = "8ed98ba38437226e"


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
    """Plays scenario ``name``; returns (trajectory, stats, the model that played it)."""
    kw = dict(SCENARIOS[name])
    model, params = fp32_model
    if kw.pop("fast", False):
        model = Transformer(CFG, get_policy("fp32"))
    traj, _, stats = play(model, params, tokenizer, **kw)
    return traj, stats, model


def machine() -> str:
    """What decides a logprob's last bits here: the CPU (model and feature flags), jaxlib, the
    ISA XLA may use and the ``-march`` of the C++ kernels; a short hash."""
    cpu = platform.processor()
    try:
        info = open("/proc/cpuinfo").read().splitlines()
        cpu = [x for x in info if x.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        pass
    isa = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
    key = json.dumps([cpu, jaxlib.__version__, isa, native.march()])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def max_logprob_error(traj, model, params) -> float:
    """Largest |rollout logprob - trainer's recompute| over the action tokens (the recorded KV
    eviction and int8 decisions replayed where the policy can)."""
    replay = model.policy.parity and traj.kv_evict_at is not None
    ref, _ = trainer_logprobs(
        model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS, replay_kv=replay
    )
    act = np.asarray(traj.action_mask, bool)
    assert act.sum() > 20
    return float(np.abs(ref[act] - np.asarray(traj.rollout_logprobs)[act]).max())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_pinned_rollout(name, fp32_model, tokenizer):
    if jax.default_backend() != "cpu" or not jax.__version__.startswith("0.10."):
        pytest.skip("digests recorded on CPU with jax 0.10")
    traj, stats, model = run_scenario(name, fp32_model, tokenizer)
    got = digest(traj, stats)
    assert got["arrays"] == EXPECTED_ARRAYS[name]
    assert got["logs"] == EXPECTED_LOGS[name]
    err = max_logprob_error(traj, model, fp32_model[1])
    assert err <= LOGPROB_TOL[model.policy.parity], (name, err)
    if machine() != RECORDED_MACHINE:
        return
    opt0 = "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
    native_kernels = kernels.select_impl("paged_decode") == "cpu" and skinny_matmul_cpu.available()
    want = NATIVE_LOGPROBS.get((name, opt0)) if native_kernels else None
    assert got["logprobs"] == (want or EXPECTED_LOGPROBS[name, opt0])
