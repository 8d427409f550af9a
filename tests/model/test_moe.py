"""Tests for agentrl_jax.model.moe: dense MLP, routing, dispatch, replay, expert parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import sharding
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.moe import (
    MLP,
    MoE,
    load_balance_loss,
    mlp_reference,
    moe_reference,
    route,
)
from agentrl_jax.precision import get_policy

FP32 = get_policy("fp32")
# init_std large enough that experts' outputs and router choices are far from degenerate.
CFG = ModelConfig(d_model=16, n_experts=8, experts_per_token=2, d_expert=24, init_std=0.3, d_ff=20)
TOL = dict(rtol=1e-5, atol=1e-5)


def _x(shape=(2, 8, 16), seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _init(cfg, policy=FP32, x=None, **kw):
    mod = MoE(cfg, policy, **kw)
    x = _x() if x is None else x
    params = jax.jit(mod.init)(jax.random.key(1), x)["params"]
    return mod, nn_unbox(params)


def nn_unbox(params):
    from flax import linen as nn

    return nn.unbox(params)


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
    mod = MLP(CFG, FP32)
    x = _x()
    params = nn_unbox(mod.init(jax.random.key(0), x)["params"])
    np.testing.assert_allclose(mod.apply({"params": params}, x), mlp_reference(params, x), **TOL)


def test_route_ties_clamp_and_renormalise():
    logits = jnp.array([[0.5, 2.0, 0.1, 2.0], [3.0, 3.0, 3.0, -50.0]], jnp.float32)
    probs, routes, gates = route(logits, 2)
    np.testing.assert_array_equal(routes, [[1, 3], [0, 1]])  # ties: lower index first
    assert float(probs.min()) == pytest.approx(1e-6)  # exp(-53)/3 clamped up
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(gates[0], [0.5, 0.5], rtol=1e-6)
    # replaying the clamped expert gives it the clamped probability, not zero
    _, _, g = route(logits, 2, jnp.array([[1, 2], [0, 3]]))
    np.testing.assert_allclose(g[1, 1], 1e-6 / (1 / 3 + 1e-6), rtol=1e-4)


def test_load_balance_loss_hand_checked():
    probs = jnp.array([[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]])
    routes = jnp.array([[0], [1], [0]])
    # f = [2/3, 1/3], P = [2/3, 1/3] -> 2 * (4/9 + 1/9) = 10/9
    lb = load_balance_loss(probs, routes, jnp.array([True, True, True]), 2)
    assert float(lb) == pytest.approx(10 / 9, rel=1e-6)
    # third token is padding: f = [1/2, 1/2], P = [0.55, 0.45] -> 2 * 0.5 = 1
    lb = load_balance_loss(probs, routes, jnp.array([True, True, False]), 2)
    assert float(lb) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_matches_dense_reference(shared):
    cfg = CFG.replace(n_shared_experts=shared)
    mod, params = _init(cfg)
    x = _x()
    y, routes, aux = jax.jit(mod.apply)({"params": params}, x)
    y_ref, routes_ref = moe_reference(params, x, cfg)
    np.testing.assert_array_equal(routes, routes_ref)
    np.testing.assert_allclose(y, y_ref, **TOL)
    assert routes.dtype == jnp.int32 and routes.shape == (2, 8, 2)
    assert float(aux["dropped_fraction"]) == 0.0
    assert len(np.unique(np.asarray(routes))) > 2  # the test exercises several experts
    # aux losses against their definitions
    logits = jnp.einsum("BTD,DE->BTE", x, params["router"], precision="highest")
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    np.testing.assert_allclose(aux["z_loss"], z, rtol=1e-5)
    want = cfg.router_aux_weight * aux["load_balance_loss"] + cfg.router_z_weight * z
    np.testing.assert_allclose(aux["aux_loss"], want, rtol=1e-5)


def test_tie_breaking_in_module():
    mod, params = _init(CFG)
    params = dict(params)
    w = np.array(params["router"])
    w[:, 3] = w[:, 1]  # experts 1 and 3 always tie exactly
    w[:, 1] += 0.0
    w[:, [1, 3]] *= 4.0  # ...and often win
    params["router"] = jnp.asarray(w)
    _, routes, _ = jax.jit(mod.apply)({"params": params}, _x())
    r = np.asarray(routes).reshape(-1, 2)
    has3 = (r == 3).any(-1)
    assert has3.any()
    assert ((r[has3] == [1, 3]).all(-1)).all()  # 3 only ever as second choice, behind 1


def test_replay_reproduces_outputs_and_reaches_router():
    mod, params = _init(CFG)
    x = _x()
    apply = jax.jit(mod.apply)
    y, routes, _ = apply({"params": params}, x)
    y2, routes2, _ = apply({"params": params}, x, replay_routes=routes)
    np.testing.assert_array_equal(routes2, routes)
    np.testing.assert_array_equal(y2, y)
    # replaying other experts follows the reference with those experts
    other = (routes + 3) % CFG.n_experts
    y3, _, _ = apply({"params": params}, x, replay_routes=other)
    np.testing.assert_allclose(y3, moe_reference(params, x, CFG, replay_routes=other)[0], **TOL)

    def loss(p):
        out, _, aux = mod.apply({"params": p}, x, replay_routes=other)
        return jnp.sum(out**2) + aux["aux_loss"]

    grads = jax.jit(jax.grad(loss))(params)
    for name, g in grads.items():
        assert np.isfinite(np.asarray(g)).all(), name
    assert float(jnp.abs(grads["router"]).max()) > 0
    # router gradient through the gates alone (aux losses excluded) is nonzero too
    g_gate = jax.grad(lambda p: jnp.sum(mod.apply({"params": p}, x, replay_routes=other)[0] ** 2))(
        params
    )["router"]
    assert float(jnp.abs(g_gate).max()) > 0


def test_capacity_drops_and_padding():
    cfg = CFG.replace(capacity_factor=0.5, n_shared_experts=1)  # C = ceil(.5*16*2/8) = 2
    mod, params = _init(cfg)
    x = _x()
    valid = np.ones((2, 8), bool)
    valid[1, 5:] = False
    y, routes, aux = jax.jit(mod.apply)({"params": params}, x, valid=jnp.asarray(valid))
    keep = _expected_keep(np.asarray(routes).reshape(16, 2), valid.reshape(16), 8, 2)
    assert 0 < (~keep[valid.reshape(16)]).sum()  # something was dropped
    y_ref, _ = moe_reference(params, x, cfg, valid=jnp.asarray(valid), keep=keep.reshape(2, 8, 2))
    np.testing.assert_allclose(y, y_ref, **TOL)
    n_valid_pairs = valid.sum() * 2
    want = (n_valid_pairs - keep.sum()) / n_valid_pairs
    assert float(aux["dropped_fraction"]) == pytest.approx(want, rel=1e-6)

    # padding rows never change valid rows' outputs, whatever they contain (dropless)
    mod0, _ = _init(CFG)
    p0 = {k: v for k, v in params.items() if not k.startswith("shared")}
    x2 = x.at[1, 5:].set(100.0 * _x((3, 16), seed=7))
    apply = jax.jit(mod0.apply)
    ya, _, auxa = apply({"params": p0}, x, valid=jnp.asarray(valid))
    yb, _, auxb = apply({"params": p0}, x2, valid=jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(ya)[valid], np.asarray(yb)[valid])
    np.testing.assert_array_equal(auxa["aux_loss"], auxb["aux_loss"])


def test_bf16_policy_runs_on_cpu():
    pol = get_policy("bf16")
    mod, params = _init(CFG, pol, x=_x().astype(jnp.bfloat16))
    x = _x().astype(jnp.bfloat16)
    y, routes, aux = jax.jit(mod.apply)({"params": params}, x)
    assert y.dtype == jnp.bfloat16 and params["w_gate"].dtype == jnp.float32
    y_ref, _ = moe_reference(params, x, CFG, replay_routes=routes)
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, rtol=5e-2, atol=5e-2)
    g = jax.grad(lambda p: jnp.sum(mod.apply({"params": p}, x)[0].astype(jnp.float32) ** 2))(params)
    assert all(np.isfinite(np.asarray(v)).all() for v in g.values())


@pytest.mark.parametrize(
    "mesh_cfg", [dict(data=2, expert=4), dict(data=1, expert=4, tensor=2)], ids=["d2e4", "e4t2"]
)
def test_expert_parallel_equals_one_device(mesh_cfg):
    cfg = CFG.replace(n_shared_experts=1)
    mod1, params = _init(cfg)
    x = _x((4, 8, 16), seed=3)
    valid = jnp.asarray(np.arange(32).reshape(4, 8) % 7 != 6)
    y1, r1, a1 = jax.jit(mod1.apply)({"params": params}, x, valid=valid)
    mesh = sharding.make_mesh(sharding.MeshConfig(**mesh_cfg))
    mod8 = MoE(cfg, FP32, mesh=mesh)
    y8, r8, a8 = jax.jit(mod8.apply)({"params": params}, x, valid=valid)
    np.testing.assert_array_equal(r8, r1)
    # Same math per token; only matmul blocking (and the tensor psum) reorder fp32 sums.
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    for key in a1:
        np.testing.assert_allclose(a8[key], a1[key], rtol=1e-6)


def test_expert_parallel_ambient_mesh_and_grads():
    mod1, params = _init(CFG)
    x = _x((2, 8, 16), seed=4)

    def loss(mod, p):
        y, _, aux = mod.apply({"params": p}, x)
        return jnp.sum(y**2) + aux["aux_loss"]

    g1 = jax.jit(jax.grad(lambda p: loss(mod1, p)))(params)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, expert=8))
    with sharding.activate(mesh):
        g8 = jax.jit(jax.grad(lambda p: loss(mod1, p)))(params)
    for name in g1:
        np.testing.assert_allclose(g8[name], g1[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_bad_inputs_raise():
    mod, params = _init(CFG)
    with pytest.raises(ValueError, match="d_model"):
        mod.apply({"params": params}, _x((2, 8, 12)))
    with pytest.raises(ValueError, match="replay_routes"):
        mod.apply({"params": params}, _x(), replay_routes=jnp.zeros((2, 8, 3), jnp.int32))
    with pytest.raises(ValueError, match="n_experts"):
        MoE(CFG.replace(n_experts=0), FP32).init(jax.random.key(0), _x())
