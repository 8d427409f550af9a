"""Tests for agentrl_jax.model.moe: dense MLP, routing, dispatch, replay, expert parallelism.

Compiles are the cost on CPU, so every test goes through one jitted ``_apply`` / ``_grad`` (static
config, policy and mesh) and a jitted reference, with one input shape throughout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from agentrl_jax import sharding
from agentrl_jax.model import expert_matmul
from agentrl_jax.model import moe as moe_module
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.moe import (
    MLP,
    MoE,
    dispatch_combine,
    load_balance_loss,
    mlp_reference,
    moe_reference,
    route,
    small_capacity,
)
from agentrl_jax.precision import get_policy

FP32 = get_policy("fp32")
# init_std large enough that experts' outputs and router choices are far from degenerate.
CFG = ModelConfig(
    d_model=16, n_experts=8, experts_per_token=2, d_expert=24, n_shared_experts=1, init_std=0.3
)
B, T, K = 2, 8, 2
TOL = dict(rtol=1e-5, atol=1e-5)
VALID = np.arange(B * T).reshape(B, T) % 7 != 6  # a few padding rows
ALL = np.ones((B, T, K), bool)


def _x(shape=(B, T, 16), seed=0):
    # numpy RNG: a jax.random draw would cost one compile per shape
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _params(cfg, seed=1):
    """Random params with the shapes ``MoE.init`` declares (eval_shape: no compile)."""
    shapes = jax.eval_shape(MoE(cfg, FP32).init, jax.random.key(0), _x())["params"]
    shapes = nn.unbox(shapes)
    rng = np.random.default_rng(seed)
    return {
        name: jnp.asarray(cfg.init_std * rng.normal(size=s.shape), s.dtype)
        for name, s in sorted(shapes.items())
    }


PARAMS = _params(CFG)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "mesh"))
def _apply(params, x, valid, replay=None, *, cfg=CFG, policy=FP32, mesh=None):
    mod = MoE(cfg, policy, mesh=mesh)
    return mod.apply({"params": params}, x, valid=valid, replay_routes=replay)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "mesh", "with_aux"))
def _grad(params, x, valid, replay=None, *, cfg=CFG, policy=FP32, mesh=None, with_aux=True):
    """Gradient of sum(y^2) (+ aux_loss) w.r.t. params; also returns y and routes."""

    def loss(p):
        y, routes, aux = MoE(cfg, policy, mesh=mesh).apply(
            {"params": p}, x, valid=valid, replay_routes=replay
        )
        out = jnp.sum(y.astype(jnp.float32) ** 2)
        return (out + aux["aux_loss"] if with_aux else out), (y, routes)

    grads, (y, routes) = jax.grad(loss, has_aux=True)(params)
    return grads, y, routes


_ref = jax.jit(moe_reference, static_argnames="cfg")


def _expected_keep(routes, valid, n_experts, cap):
    """Which (token, slot) pairs fit: slot-major, then token order, first come first served."""
    n, k = routes.shape
    keep = np.zeros((n, k), bool)
    used = np.zeros(n_experts, int)
    for s in range(k):
        for i in range(n):
            if valid[i] and used[routes[i, s]] < cap:
                used[routes[i, s]] += 1
                keep[i, s] = True
    return keep


def test_mlp_matches_reference():
    cfg = CFG.replace(d_ff=20)
    mod = MLP(cfg, FP32)
    x = _x()
    variables = jax.eval_shape(mod.init, jax.random.key(0), x)
    assert nn.get_partition_spec(variables)["params"]["w_down"] == jax.P("mlp", "embed")
    rng = np.random.default_rng(5)
    params = {
        k: jnp.asarray(0.3 * rng.normal(size=v.shape), jnp.float32)
        for k, v in nn.unbox(variables)["params"].items()
    }
    y, y_ref = jax.jit(lambda p: (mod.apply({"params": p}, x), mlp_reference(p, x)))(params)
    np.testing.assert_allclose(y, y_ref, **TOL)


def test_param_shapes_and_logical_axes():
    variables = jax.eval_shape(MoE(CFG, FP32).init, jax.random.key(0), _x())
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["w_gate"] == jax.P("expert", "embed", "expert_mlp")
    assert specs["w_down"] == jax.P("expert", "expert_mlp", "embed")
    assert specs["router"] == jax.P("embed", None)
    assert specs["shared_down"] == jax.P("mlp", "embed")
    shapes = nn.unbox(variables)["params"]
    assert shapes["w_up"].shape == (8, 16, 24) and shapes["shared_up"].shape == (16, 24)


def test_route_ties_clamp_and_renormalise():
    logits = jnp.array([[0.5, 2.0, 0.1, 2.0], [3.0, 3.0, 3.0, -50.0]], jnp.float32)
    probs, routes, gates = jax.jit(route, static_argnums=1)(logits, 2)
    np.testing.assert_array_equal(routes, [[1, 3], [0, 1]])  # ties: lower index first
    assert float(probs.min()) == pytest.approx(1e-6)  # exp(-53)/3 clamped up
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(gates[0], [0.5, 0.5], rtol=1e-6)
    # replaying the clamped expert gives it the clamped probability, not zero
    _, _, g = jax.jit(route, static_argnums=1)(logits, 2, jnp.array([[1, 2], [0, 3]]))
    np.testing.assert_allclose(g[1, 1], 1e-6 / (1 / 3 + 1e-6), rtol=1e-4)


def test_replay_minus_one_takes_the_routers_experts():
    """Replayed routes of -1 (a token the rollout never ran) are the router's own top-k."""
    logits = jax.random.normal(jax.random.key(1), (5, 6), jnp.float32)
    probs, own, gates = route(logits, 2)
    replay = jnp.array([[-1, -1], [4, 5], [-1, -1], [2, 0], [-1, -1]], jnp.int32)
    p2, routes, g2 = route(logits, 2, replay)
    expect = np.where(np.asarray(replay) < 0, np.asarray(own), np.asarray(replay))
    np.testing.assert_array_equal(routes, expect)
    free = np.array([0, 2, 4])
    np.testing.assert_array_equal(np.asarray(g2)[free], np.asarray(gates)[free])
    top = np.take_along_axis(np.asarray(probs), expect, axis=-1)
    np.testing.assert_allclose(g2, top / top.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(p2, probs)


def test_load_balance_loss_hand_checked():
    lb_fn = jax.jit(load_balance_loss, static_argnums=3)
    probs = jnp.array([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]])
    routes = jnp.array([[0], [1], [0]])
    # f = [2/3, 1/3], P = [2/3, 1/3] -> 2 * (4/9 + 1/9) = 10/9
    lb = lb_fn(probs, routes, jnp.array([True, True, True]), 2)
    assert float(lb) == pytest.approx(10 / 9, rel=1e-6)
    # third token is padding: f = [1/2, 1/2], P = [0.55, 0.45] -> 2 * 0.5 = 1
    lb = lb_fn(probs, routes, jnp.array([True, True, False]), 2)
    assert float(lb) == pytest.approx(1.0, rel=1e-6)


def test_moe_matches_dense_reference_and_padding():
    x, valid = _x(), jnp.asarray(VALID)
    y, routes, aux = _apply(PARAMS, x, valid)
    y_ref, routes_ref = _ref(PARAMS, x, CFG, valid=valid)
    np.testing.assert_array_equal(routes, routes_ref)
    assert routes.dtype == jnp.int32 and routes.shape == (B, T, K)
    assert len(np.unique(np.asarray(routes))) > 4  # the test exercises many experts
    np.testing.assert_allclose(y, y_ref, **TOL)
    assert float(aux["dropped_fraction"]) == 0.0
    # aux losses against their definitions, over valid rows only
    logits = jnp.einsum("BTD,DE->BTE", x, PARAMS["router"], precision="highest")
    z = jnp.mean(jax.nn.logsumexp(logits, -1)[VALID] ** 2)
    np.testing.assert_allclose(aux["z_loss"], z, rtol=1e-5)
    want = CFG.router_aux_weight * aux["load_balance_loss"] + CFG.router_z_weight * z
    np.testing.assert_allclose(aux["aux_loss"], want, rtol=1e-5)
    # padding rows never change valid rows' outputs or the losses, whatever they contain
    x2 = jnp.where(valid[..., None], x, 100.0 * _x(seed=7))
    y2, _, aux2 = _apply(PARAMS, x2, valid)
    np.testing.assert_array_equal(np.asarray(y2)[VALID], np.asarray(y)[VALID])
    for key in aux:
        np.testing.assert_array_equal(aux2[key], aux[key])


def test_tie_breaking_in_module():
    w = np.array(PARAMS["router"])
    w[:, 3] = w[:, 1]  # experts 1 and 3 always tie exactly...
    w[:, [1, 3]] *= 4.0  # ...and often win
    params = dict(PARAMS, router=jnp.asarray(w))
    _, routes, _ = _apply(params, _x(), jnp.asarray(VALID))
    r = np.asarray(routes).reshape(-1, K)
    has3 = (r == 3).any(-1)
    assert has3.sum() > 3
    assert (r[has3] == [1, 3]).all()  # 3 only ever second, right behind 1


def test_replay_reproduces_outputs_and_reaches_router():
    x, valid = _x(), jnp.asarray(VALID)
    y, routes, _ = _apply(PARAMS, x, valid)
    y2, routes2, _ = _apply(PARAMS, x, valid, routes)
    np.testing.assert_array_equal(routes2, routes)
    np.testing.assert_array_equal(y2, y)
    # replaying other experts follows the reference with those experts
    other = (routes + 3) % CFG.n_experts
    y3, routes3, _ = _apply(PARAMS, x, valid, other)
    np.testing.assert_array_equal(routes3, other)
    y3_ref, _ = _ref(PARAMS, x, CFG, valid=valid, replay_routes=other, keep=ALL)
    np.testing.assert_allclose(y3, y3_ref, **TOL)
    # padding rows' replay entries are ignored, even invalid ones
    bad = jnp.where(valid[..., None], other, -1)
    y4, _, _ = _apply(PARAMS, x, valid, bad)
    assert np.isfinite(np.asarray(y4)).all()
    np.testing.assert_array_equal(np.asarray(y4)[VALID], np.asarray(y3)[VALID])
    # the router gets gradient through the replayed gates alone (no aux loss in this loss)
    grads, _, _ = _grad(PARAMS, x, valid, other, with_aux=False)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads.values())
    assert float(jnp.abs(grads["router"]).max()) > 1e-4

    # ...and it is the right gradient: central differences along random directions (routes are
    # replayed, so the loss is smooth); fp32 forward passes: observed errors ~1e-4, tolerance 2e-3.
    def f(p):
        return float(np.sum(np.asarray(_apply(p, x, valid, other)[0], np.float64) ** 2))

    def shifted(v, step):
        return {k: PARAMS[k] + jnp.asarray(step * v[k], jnp.float32) for k in PARAMS}

    rng = np.random.default_rng(11)
    eps = 1e-3
    for names in (["router"], sorted(PARAMS)):
        v = {k: rng.normal(size=p.shape) * (k in names) for k, p in PARAMS.items()}
        fd = (f(shifted(v, eps)) - f(shifted(v, -eps))) / (2 * eps)
        an = sum(float(np.sum(np.asarray(grads[k], np.float64) * v[k])) for k in PARAMS)
        assert an == pytest.approx(fd, rel=2e-3), names


def test_capacity_drops():
    cfg = CFG.replace(capacity_factor=1.0)  # C = ceil(16*2/8) = 4
    x, valid = _x(), jnp.asarray(VALID)
    y, routes, aux = _apply(PARAMS, x, valid, cfg=cfg)
    keep = _expected_keep(np.asarray(routes).reshape(-1, K), VALID.reshape(-1), 8, 4)
    n_valid_pairs = VALID.sum() * K
    assert 0 < n_valid_pairs - keep.sum() < n_valid_pairs // 2  # imbalance drops a few
    # the reference ignores capacity_factor: the same compiled reference as the replay test
    y_ref, _ = _ref(PARAMS, x, CFG, valid=valid, replay_routes=routes, keep=keep.reshape(B, T, K))
    np.testing.assert_allclose(y, y_ref, **TOL)
    want = (n_valid_pairs - keep.sum()) / n_valid_pairs
    assert float(aux["dropped_fraction"]) == pytest.approx(want, rel=1e-6)


def test_small_capacity_first_keeps_every_pair():
    """Dropless 16 tokens x 2 over 8 experts: capacity 16, tried first at 8 rows per expert."""
    assert small_capacity(B * T, K, 8, B * T) == 8
    assert small_capacity(B * T, K, 4, B * T) is None  # 2x the mean is every token
    x, valid = _x(), jnp.asarray(VALID)
    rng = np.random.default_rng(3)
    balanced = np.stack([rng.permutation(8)[:K] for _ in range(B * T)]).reshape(B, T, K)
    skewed = np.broadcast_to(np.arange(K), (B, T, K))  # 14 valid rows on experts 0 and 1
    for replay, fits in ((balanced, True), (skewed, False)):
        counts = np.bincount(replay[VALID].reshape(-1), minlength=8)
        assert (counts.max() <= 8) == fits  # which branch runs
        replay = jnp.asarray(replay, jnp.int32)
        y, _, aux = _apply(PARAMS, x, valid, replay)
        y_ref, _ = _ref(PARAMS, x, CFG, valid=valid, replay_routes=replay)
        np.testing.assert_allclose(y, y_ref, **TOL)
        assert float(aux["dropped_fraction"]) == 0.0

    # parity policies always run the full capacity (one kernel shape for rollout and trainer)
    def jaxpr(name, small_first=True):
        mod = MoE(CFG, get_policy(name), small_first=small_first)
        return str(jax.make_jaxpr(lambda p, x: mod.apply({"params": p}, x))(PARAMS, x))

    assert "cond[" in jaxpr("fp32") and "cond[" not in jaxpr("fp32-parity")
    assert "cond[" not in jaxpr("fp32", small_first=False)  # the training default


def test_bf16_policy_runs_on_cpu():
    pol = get_policy("bf16")
    x, valid = _x().astype(jnp.bfloat16), jnp.asarray(VALID)
    grads, y, routes = _grad(PARAMS, x, valid, policy=pol)
    assert y.dtype == jnp.bfloat16
    y_ref, _ = _ref(PARAMS, x.astype(jnp.float32), CFG, valid=valid, replay_routes=routes, keep=ALL)
    err = np.abs(np.asarray(y, np.float32) - np.asarray(y_ref))
    assert err.max() < 0.05 * np.abs(np.asarray(y_ref)).max()  # bf16 inputs: ~3 digits
    assert all(g.dtype == jnp.float32 and np.isfinite(np.asarray(g)).all() for g in grads.values())


def test_bf16_expert_matmuls_per_expert_native_and_rounded_agree(monkeypatch):
    """bf16 expert matmuls on CPU are one 2-D bf16 x bf16 -> f32 dot per expert, forward and
    backward (``PER_EXPERT_MAX`` experts or fewer); above it one batched dot, bf16 x bf16 -> f32
    where the CPU build compiles it (``mixed_batched_dot_compiles``), else f32 of the inputs
    rounded to bf16. All three give the same outputs up to the order of the f32 sums, and
    gradients within bf16 rounding (the cotangents are bf16) of fp32 gradients at the
    bf16-rounded parameters and inputs."""
    pol = get_policy("bf16")
    x, valid = _x().astype(jnp.bfloat16), jnp.asarray(VALID)
    rounded_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), PARAMS)
    g_ref, _, _ = _grad(rounded_params, x.astype(jnp.float32), valid)
    n_exp = CFG.n_experts
    ys = []
    for per_expert_max, compiles in ((n_exp, True), (n_exp - 1, True), (n_exp - 1, False)):
        monkeypatch.setattr(expert_matmul, "PER_EXPERT_MAX", per_expert_max)
        monkeypatch.setattr(expert_matmul, "mixed_batched_dot_compiles", lambda *a, c=compiles: c)
        jax.clear_caches()
        lowered = jax.jit(lambda p: _grad(p, x, valid, policy=pol)).lower(PARAMS).as_text()
        dots = [ln for ln in lowered.splitlines() if "dot_general" in ln]
        batched = [ln for ln in dots if "batching" in ln]
        operands = [ln.split(": (")[1].split(") ->")[0] for ln in batched]
        if per_expert_max >= n_exp:  # per expert: 3 forward, 3 weight-gradient, 1 input-gradient
            expert_dots = [ln for ln in dots if "bf16" in ln.split(": (")[1].split(") ->")[0]]
            assert not batched and len(expert_dots) >= 7 * n_exp
        else:
            assert len(operands) >= 3 and all(("bf16" in o) == compiles for o in operands[:3])
        grads, y, _ = _grad(PARAMS, x, valid, policy=pol)
        ys.append(np.asarray(y, np.float32))
        for name, want in g_ref.items():
            err = np.abs(np.asarray(grads[name]) - np.asarray(want)).max()
            assert err <= 2e-2 * np.abs(np.asarray(want)).max(), (per_expert_max, compiles, name)
    np.testing.assert_allclose(ys[0], ys[1], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(ys[0], ys[2], rtol=1e-2, atol=1e-2)


def test_per_expert_matmul_refuses_other_subscripts():
    x = jnp.ones((2, 3, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match="is not EC<k>,E<k><n>->EC<n>"):
        expert_matmul.expert_einsum(get_policy("bf16"), "ECD,EFD->ECF", x, x)


@pytest.mark.parametrize(
    "mesh_cfg", [dict(data=2, expert=4), dict(data=1, expert=4, tensor=2)], ids=["d2e4", "e4t2"]
)
def test_expert_parallel_equals_one_device(mesh_cfg):
    x, valid = _x(seed=3), jnp.asarray(VALID)
    y1, r1, a1 = _apply(PARAMS, x, valid)
    mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
    hlo = _apply.lower(PARAMS, x, valid, mesh=mesh).as_text()
    assert "all_to_all" in hlo or "all-to-all" in hlo
    y8, r8, a8 = _apply(PARAMS, x, valid, mesh=mesh)
    np.testing.assert_array_equal(r8, r1)
    # Same math per token; only the matmul shapes (hence blocking) and, with tensor=2, the psum
    # of two partial down projections reorder fp32 sums: a few ulps of outputs of size ~1.
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    for key in a1:
        np.testing.assert_allclose(a8[key], a1[key], rtol=1e-6)


@pytest.mark.parametrize(
    "mesh_cfg",
    [pytest.param(dict(data=8), marks=pytest.mark.slow), dict(data=2, fsdp=2, tensor=2)],
    ids=str,
)  # data 8 in the slow tier (CI time): the other mesh splits tokens over data and fsdp too
def test_data_parallel_mesh_dispatches_per_token_shard(mesh_cfg, monkeypatch):
    """Without expert parallelism the dispatch still runs per token shard (``shard_map``): a
    dispatch over the global tokens would sort and gather every token on every device."""
    x, valid = _x(seed=5), jnp.asarray(VALID)
    y1, r1, a1 = _apply(PARAMS, x, valid)
    seen = []

    def spy(x, *args, **kwargs):
        seen.append((x.shape[0], kwargs["expert_axis"], kwargs["capacity"]))
        return dispatch_combine(x, *args, **kwargs)

    monkeypatch.setattr(moe_module, "dispatch_combine", spy)
    mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
    y8, r8, a8 = _apply(PARAMS, x, valid, mesh=mesh)
    shards = mesh_cfg.get("data", 1) * mesh_cfg.get("fsdp", 1)
    assert seen == [(B * T // shards, None, CFG.capacity(B * T // shards))]
    np.testing.assert_array_equal(r8, r1)
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)  # as in the expert-parallel test
    for key in a1:
        np.testing.assert_allclose(a8[key], a1[key], rtol=1e-6)


def test_expert_parallel_ambient_mesh_grads():
    # replay + no aux: the same compiled 1-device gradient as the replay test
    x, valid = _x(seed=4), jnp.asarray(VALID)
    replay = jnp.asarray(np.random.default_rng(4).integers(0, 8, (B, T, 1)) + [0, 1]) % 8
    g1, _, _ = _grad(PARAMS, x, valid, replay, with_aux=False)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, expert=8))
    with sharding.activate(mesh):  # no mesh attribute: the module picks up the ambient mesh
        hlo = _grad.lower(PARAMS, x, valid, replay, with_aux=False).as_text()
        assert "all-to-all" in hlo.replace("_", "-")
        g8, _, _ = _grad(PARAMS, x, valid, replay, with_aux=False)
    for name in g1:
        assert np.isfinite(np.asarray(g1[name])).all(), name
        np.testing.assert_allclose(g8[name], g1[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_bad_inputs_raise():
    mod = MoE(CFG, FP32)
    with pytest.raises(ValueError, match="d_model"):
        mod.apply({"params": PARAMS}, _x((2, 8, 12)))
    with pytest.raises(ValueError, match="replay_routes"):
        mod.apply({"params": PARAMS}, _x(), replay_routes=jnp.zeros((2, 8, 3), jnp.int32))
    with pytest.raises(ValueError, match="valid"):
        mod.apply({"params": PARAMS}, _x(), valid=jnp.ones((2, 9), bool))
    with pytest.raises(ValueError, match="n_experts"):
        MoE(CFG.replace(n_experts=0), FP32).init(jax.random.key(0), _x())
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, expert=8))
    with pytest.raises(ValueError, match="multiple of 8"):
        MoE(CFG, FP32, mesh=mesh).apply({"params": PARAMS}, _x((1, 4, 16)))
