"""The mesh section on 8 fake CPU devices: one SFT step and one RL update of the tiny MoE give
the single-device result, each device holds its share of every sharded leaf, and the sampler
draws the same tokens under a mesh.

Why not bitwise: a sharded step adds the same per-token terms in another order (partial sums
per batch shard, then an all-reduce or reduce-scatter across devices; matmuls blocked over the
sharded dimensions), so gradients differ by fp32 rounding (|dg| ~ 1e-10 here; the losses and
gradient norms agree to 1e-5 relative). Tolerance on parameters after one AdamW step:
|delta| <= 1e-2 * lr. The step moves a parameter by lr * g / (|g| + eps), which turns an
absolute gradient error dg into at most lr * dg / (4 eps) (at |g| = eps = 1e-8): 2.5e-3 * lr
at dg = 1e-10, the largest effect seen (3.8e-3 * lr, on entries whose gradient is about eps).
A sharding bug (a missing all-reduce, a shard applied to the wrong rows) moves parameters by
O(lr).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from agentrl_jax.envs.base import StepResult
from agentrl_jax.envs.coderepair import CodeTokenizer
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import RLConfig, rl_optimizer
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler
from agentrl_jax.sharding import MeshConfig, activate, fit_spec
from agentrl_jax.train.placement import Placement
from agentrl_jax.train.sft import SFTConfig, make_train_step, sft_optimizer

B, T = 8, 16
LR = 1e-3
TOL = 1e-2 * LR
CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    layer_pattern="D",
    window=4,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    n_experts=4,
    experts_per_token=2,
    d_expert=16,
    init_std=0.2,
)
POLICY = get_policy("fp32")
RL = RLConfig(lr=LR)
SFT = SFTConfig(steps=10, batch_size=B, lr=LR, warmup_steps=0)
MESHES = {
    "data8": MeshConfig(data=8),
    "fsdp8": MeshConfig(fsdp=-1),
    "fsdp4_tensor2": MeshConfig(fsdp=4, tensor=2),
    "data2_fsdp2_expert2": MeshConfig(data=2, fsdp=2, expert=2),
}


def test_mesh_shape_rules():
    assert MeshConfig().shape(8) == dict(data=8, fsdp=1, expert=1, tensor=1)
    assert MeshConfig(fsdp=-1).shape(8) == dict(data=1, fsdp=8, expert=1, tensor=1)
    assert MeshConfig(data=2, fsdp=-1).shape(8) == dict(data=2, fsdp=4, expert=1, tensor=1)
    with pytest.raises(ValueError, match="at most one axis"):
        MeshConfig(fsdp=-1, tensor=-1).shape(8)
    with pytest.raises(ValueError, match="MeshConfig.tensor=0"):
        MeshConfig(tensor=0).shape(8)
    with pytest.raises(ValueError, match="exactly"):
        MeshConfig(data=2, fsdp=2).shape(8)


def test_mesh_devices_picks_the_first_n():
    devices = jax.devices()
    assert MeshConfig().pick(devices) == devices
    assert MeshConfig(devices=2).pick(devices) == devices[:2]
    for bad in (0, -2, len(devices) + 1):
        with pytest.raises(ValueError, match=f"MeshConfig.devices={bad}"):
            MeshConfig(devices=bad).pick(devices)
    one = Placement(MeshConfig(devices=1), CFG, POLICY)
    assert not one.sharded and one.mesh is None
    four = Placement(MeshConfig(fsdp=-1, devices=4), CFG, POLICY)
    assert four.mesh.shape == dict(data=1, fsdp=4, expert=1, tensor=1)


def test_fit_spec_keeps_axes_that_divide():
    sizes = dict(data=2, fsdp=4, expert=1, tensor=2)
    assert fit_spec(P(("data", "fsdp")), (8,), sizes) == P(("data", "fsdp"))
    assert fit_spec(P(("data", "fsdp")), (4,), sizes) == P("data")  # 2 * 4 does not divide 4
    assert fit_spec(P(None, "tensor"), (3, 3), sizes) == P()  # 2 does not divide 3
    assert fit_spec(P("fsdp", "fsdp"), (8, 8), sizes) == P("fsdp")  # an axis is used once


def _sft_batch(rng):
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[1, 11:] = False
    action = (rng.random((B, T)) < 0.5) & valid
    return {
        "tokens": tokens,
        "valid": valid,
        "action_mask": action,
        "fix_mask": action & (rng.random((B, T)) < 0.5),
        "detour_mask": np.zeros((B, T), bool),
        "turn_ids": np.cumsum(rng.random((B, T)) < 0.2, axis=1).astype(np.int32),
    }


def _rl_batch(rng):
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[3, 9:] = False
    action = (rng.random((B, T)) < 0.6) & valid
    action[:, :3] = False
    adv = np.where(action, rng.normal(size=(B, T)), 0.0).astype(np.float32)
    rollout = np.where(action, -rng.random((B, T)) * 3, 0.0).astype(np.float32)
    return {
        "tokens": tokens,
        "valid": valid,
        "action_mask": action,
        "advantages": adv,
        "rollout_logprobs": rollout,
    }


def _steps(placement: Placement, params, sft_batch, rl_batch):
    """One SFT step and one RL update from ``params``; returns both new states and metrics."""
    model = Transformer(CFG, POLICY)
    copy = lambda: jax.tree.map(jnp.copy, params)  # noqa: E731  (steps donate their state)
    tx = sft_optimizer(SFT)
    step = make_train_step(model, tx, SFT.lm_weight, placement.step_shardings(tx, B))
    sft = step(
        placement.init_state(copy(), None, jax.random.key(1), tx), placement.place_batch(sft_batch)
    )
    tx = rl_optimizer(RL)
    update = make_update_fn(model, RL, shardings=placement.step_shardings(tx, B))
    rl = update(
        placement.init_state(copy(), RL, jax.random.key(2), tx), placement.place_batch(rl_batch)
    )
    return sft, rl


@pytest.fixture(scope="module")
def single():
    params = init_params(Transformer(CFG, POLICY), jax.random.key(0))
    rng = np.random.default_rng(0)
    batches = _sft_batch(rng), _rl_batch(rng)
    one = Placement.default_device(CFG, POLICY)
    assert not one.sharded
    out = jax.device_get(_steps(one, params, *batches))
    (sft, _), (rl, _) = out
    assert _max_diff(sft.params, params) > 0.5 * LR and _max_diff(rl.params, params) > 0.5 * LR
    return params, batches, out


def _max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _check_shards(tree, shardings, mesh, model_axes: int) -> tuple[int, int]:
    """Each device holds exactly its 1/n of a leaf sharded n ways (n = product of the mesh
    axes of its spec). Returns (bytes per device, single-device bytes) of the leaves sharded
    over every model axis (n == model_axes)."""
    sizes = dict(mesh.shape)
    per_device = total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        assert x.sharding == s
        axes = [a for e in s.spec if e for a in ((e,) if isinstance(e, str) else e)]
        n = int(np.prod([sizes[a] for a in axes]))
        shards = x.addressable_shards
        assert len(shards) == 8
        assert all(sh.data.size * n == x.size for sh in shards), (x.shape, s.spec)
        if n == model_axes:
            per_device += shards[0].data.nbytes
            total += x.nbytes
    return per_device, total


# fsdp8 and data8 in the slow tier (CI time): fsdp sharding, 1/N bytes and equality are checked
# in make test by fsdp4_tensor2 and data2_fsdp2_expert2, batch rows split over data by the
# latter, and the MoE's per-token-shard dispatch without an expert axis by
# tests/model/test_moe.py's data 2 x fsdp 2 x tensor 2 case
SLOW_MESHES = ("fsdp8", "data8")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MESHES else n for n in MESHES]
)
def test_sharded_steps_equal_single_device(single, name):
    params, batches, ((sft1, sft_m1), (rl1, rl_m1)) = single
    placement = Placement(MESHES[name], CFG, POLICY)
    assert placement.sharded and placement.mesh.size == 8
    (sft, sft_m), (rl, rl_m) = _steps(placement, params, *batches)
    assert _max_diff(sft.params, sft1.params) <= TOL
    assert _max_diff(rl.params, rl1.params) <= TOL
    assert _max_diff(rl.opt_state, rl1.opt_state) <= TOL  # Adam moments ~ g, g^2: tiny
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(sft_m[key]), float(sft_m1[key]), rtol=1e-5)
        np.testing.assert_allclose(float(rl_m[key]), float(rl_m1[key]), rtol=1e-5, atol=1e-8)
    # every leaf where its sharding says, 1/n of it per device; the leaves sharded over every
    # model axis (fsdp x expert x tensor) hold 1/N of their bytes per device
    model_axes = int(np.prod([placement.mesh.shape[a] for a in ("fsdp", "expert", "tensor")]))
    shard = placement.state_shardings(rl_optimizer(RL))
    for tree, sh in ((rl.params, shard.params), (rl.opt_state, shard.opt_state)):
        per_device, total = _check_shards(tree, sh, placement.mesh, model_axes)
        assert total > 0 and per_device * model_axes <= 1.1 * total
    w = rl.params["params"]["groups"]["layer_0"]["moe"]["w_gate"]
    assert w.addressable_shards[0].data.size * model_axes == w.size
    # batch rows over data x fsdp x expert (tensor shards hold the same rows)
    rows = B // int(np.prod([placement.mesh.shape[a] for a in ("data", "fsdp", "expert")]))
    tokens = placement.place_batch(batches[1])["tokens"]
    assert {sh.data.shape for sh in tokens.addressable_shards} == {(rows, T)}


class _EchoEnv:
    """Two turns per episode; observations depend only on the task seed and the turn."""

    def __init__(self):
        self.tokenizer = CodeTokenizer()

    def reset(self, seed):
        tok, self.seed, self.turn = self.tokenizer, seed, 0
        return [tok.bos_id, tok.obs_start_id, *range(20, 26 + 3 * seed), tok.obs_end_id]

    def step(self, action):
        tok = self.tokenizer
        self.turn += 1
        done = self.turn >= 2
        obs = [tok.obs_start_id, 40 + self.seed + self.turn, tok.obs_end_id]
        log = {"tool": "echo", "args": (), "output": "", "error": False}
        if done:
            obs.append(tok.eos_id)
            log.update(success=True, goal_adhered=True)
        return obs, StepResult(done=done, outcome_reward=float(done), process={}, log=log)


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_rollout_under_mesh_samples_the_same_tokens():
    policy = get_policy("fp32-parity")
    cfg = CFG.replace(vocab_size=512, layer_pattern="SF", window=8)
    model = Transformer(cfg, policy)
    params = init_params(model, jax.random.key(3))
    sampling = RolloutConfig(max_new_tokens=6, max_len=64, page_size=8, chunk=4)
    tokenizer = CodeTokenizer()

    def play(p):
        return run_episodes(
            model, p, [0, 1, 2, 3], _EchoEnv, tokenizer, sampling, jax.random.key(4),
            n_slots=4, max_turns=2,
        )  # fmt: skip

    one = play(params)
    placement = Placement(MeshConfig(data=2, fsdp=2, expert=2), cfg, policy)
    with activate(placement.mesh, placement.cfg):
        sharded = play(placement.place_params(params))
        state = get_sampler(model, sampling).init_state(4)  # as the agent loop makes it
    ring, pool = state.cache["layers"]["layer_0"]["k"], state.cache["layers"]["layer_1"]["k"]
    assert ring.sharding.spec == P(None, "data") and pool.sharding.spec == P(None, "data")
    assert state.cache["lengths"].sharding.spec == P("data")
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    np.testing.assert_array_equal(sharded.action_mask, one.action_mask)
    np.testing.assert_allclose(sharded.rollout_logprobs, one.rollout_logprobs, atol=1e-5)
