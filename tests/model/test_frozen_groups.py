"""Frozen lower groups (``ModelConfig.frozen_groups``): no gradient reaches them or the embedding,
the trained groups' gradients are the unfrozen model's, and the optimisers leave them as they
are (weight decay included)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params, training_view
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import make_optimizer

CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=4, layer_pattern="D", n_heads=4, n_kv_heads=2,
    head_dim=8, d_ff=48, tie_embeddings=True,
)  # fmt: skip
TOKENS = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)


def _grads(cfg, params, view: bool):
    model = Transformer(cfg, get_policy("fp32"))

    def loss(p):
        m, pp = training_view(model, p) if view else (model, p)
        logits = m.apply(pp, TOKENS)[0]
        return jnp.sum(jax.nn.log_softmax(logits) * jax.random.normal(jax.random.key(2), (64,)))

    return jax.grad(loss)(params)["params"]


@pytest.fixture(scope="module")
def params():
    return init_params(Transformer(CFG, get_policy("fp32")), jax.random.key(0))


@pytest.mark.parametrize("view", [False, True])
def test_no_gradient_below_the_trained_groups(params, view):
    full = _grads(CFG, params, view=False)
    frozen = _grads(CFG.replace(frozen_groups=3), params, view=view)
    assert not np.any(np.asarray(frozen["embed"]["table"]))
    for name, g in jax.tree_util.tree_leaves_with_path(frozen["groups"]):
        g, want = np.asarray(g), np.asarray(_at(full["groups"], name))
        assert not np.any(g[:3]), name
        np.testing.assert_allclose(g[3:], want[3:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(frozen["final_norm"]["scale"]), np.asarray(full["final_norm"]["scale"]),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_training_view_unstacks_only_when_frozen(params):
    model = Transformer(CFG, get_policy("fp32"))
    assert training_view(model, params) == (model, params)
    m, p = training_view(Transformer(CFG.replace(frozen_groups=1), get_policy("fp32")), params)
    assert m.unstacked and sorted(k for k in p["params"] if k.startswith("group_")) == [
        f"group_{g}" for g in range(4)
    ]
    a = Transformer(CFG, get_policy("fp32")).apply(params, TOKENS)[0]
    np.testing.assert_allclose(np.asarray(m.apply(p, TOKENS)[0]), np.asarray(a), atol=1e-5)


def test_optimizer_leaves_frozen_parameters_unchanged(params):
    grads = jax.tree.map(lambda a: jnp.ones_like(a), params)
    tx = make_optimizer(1e-2, weight_decay=0.1, frozen_groups=2)
    updates, _ = tx.update(grads, tx.init(params), params)
    inner = updates["params"]
    assert not np.any(np.asarray(inner["embed"]["table"]))
    for leaf in jax.tree.leaves(inner["groups"]):
        assert not np.any(np.asarray(leaf[:2])) and np.all(np.asarray(leaf[2:]) != 0)
    assert np.all(np.asarray(inner["final_norm"]["scale"]) != 0)


def test_bad_frozen_groups(params):
    with pytest.raises(ValueError, match="frozen_groups=-1 must be >= 0"):
        CFG.replace(frozen_groups=-1)
    every = Transformer(CFG.replace(frozen_groups=4), get_policy("fp32"))
    with pytest.raises(ValueError, match="frozen_groups=4 must be < n_groups=4"):
        training_view(every, params)
