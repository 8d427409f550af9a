"""The critic: value head on the model, PPO value loss, GAE with learned values in the update and
in the RL loop (starting from a checkpoint that has no value head)."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.config import load_config
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, forward_chunked, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.losses import LossConfig, value_loss
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir
from agentrl_jax.train.main import run
from benchmarks.common import preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"
B, T = 4, 12
CFG = preset("tiny-dense", vocab_size=48, layer_pattern="D", d_ff=64)


def _model(value_head):
    return Transformer(dataclasses.replace(CFG, value_head=value_head), get_policy("fp32"))


def _with_random_head(params, seed=1):
    rng = np.random.default_rng(seed)
    head = {
        "kernel": jnp.asarray(rng.normal(size=(CFG.d_model, 1)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(1,)), jnp.float32),
    }
    return {**params, "params": {**params["params"], "value_head": head}}


@pytest.mark.parametrize("clip", [None, 0.5])
def test_value_loss_hand_computed(clip):
    v = jnp.array([[1.0, 2.0, -1.0], [0.5, 3.0, 0.0]])
    v_old = jnp.array([[0.0, 2.5, 0.0], [0.0, 0.0, 9.0]])
    r = jnp.array([[2.0, 1.0, 1.0], [1.0, 1.0, 5.0]])
    mask = jnp.array([[True, True, True], [True, True, False]])
    loss, m = value_loss(v, v_old, r, mask, LossConfig(agg_mode="token-mean", vf_clip=clip))
    if clip is None:  # 1/2 (v - r)^2 on the 5 masked tokens: 0.5, 0.5, 2, 0.125, 2
        expect, frac = (0.5 + 0.5 + 2.0 + 0.125 + 2.0) / 5, 0.0
    else:
        # clipped v: 0.5, 2.0, -0.5, 0.5, 0.5 -> squared errors 2.25, 1, 2.25, .25, .25; max
        # with the unclipped 1, 1, 4, .25, 4 -> 2.25, 1, 4, .25, 4: the clipped term is larger
        # on the first token only
        expect, frac = 0.5 * (2.25 + 1.0 + 4.0 + 0.25 + 4.0) / 5, 1 / 5
    np.testing.assert_allclose(float(loss), expect, rtol=1e-6)
    np.testing.assert_allclose(float(m["value_clipped_frac"]), frac, rtol=1e-6)
    g = jax.grad(lambda x: value_loss(x, v_old, r, mask, LossConfig(vf_clip=clip))[0])(v)
    assert float(jnp.abs(g[1, 2])) == 0.0  # masked token: no gradient


def test_value_head_leaves_logits_alone_and_starts_at_zero():
    plain, shared = _model(""), _model("shared")
    params = init_params(shared, jax.random.key(0))
    assert params["params"]["value_head"]["kernel"].shape == (CFG.d_model, 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    logits, _, extras = shared.apply(params, tokens)
    np.testing.assert_array_equal(extras["values"], np.zeros((B, T)))  # zero-initialised
    trunk = {"params": {k: v for k, v in params["params"].items() if k != "value_head"}}
    ref_logits, _, ref_extras = plain.apply(trunk, tokens)
    np.testing.assert_array_equal(logits, ref_logits)
    assert "values" not in ref_extras
    # the chunked (parity) path gives the teacher-forced values, per token
    params = _with_random_head(params)
    _, _, extras = shared.apply(params, tokens)
    _, chunked = forward_chunked(shared, params, tokens, chunk=4)
    assert chunked["values"].shape == (B, T)
    np.testing.assert_allclose(chunked["values"], extras["values"], rtol=1e-5, atol=1e-5)
    assert float(jnp.std(extras["values"])) > 0.1


@pytest.mark.parametrize("mode", ["shared", "detached"])
def test_value_gradient_reaches_the_trunk_only_when_shared(mode):
    model = _model(mode)
    params = _with_random_head(init_params(model, jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    grads = jax.grad(lambda p: jnp.sum(model.apply(p, tokens)[2]["values"] ** 2))(params)
    head = grads["params"].pop("value_head")
    assert float(jnp.abs(head["kernel"]).sum()) > 0
    trunk = sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads))
    assert (trunk > 0) == (mode == "shared")


def test_update_fits_the_critic():
    """loss.vf_coef > 0: repeated updates on one batch pull the values to their targets."""
    model = _model("shared")
    params = init_params(model, jax.random.key(0))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    action = rng.random((B, T)) < 0.6
    action[:, 0] = False
    targets = np.where(action, rng.normal(size=(B, T)), 0.0).astype(np.float32)
    batch = {
        "tokens": tokens,
        "action_mask": action,
        "advantages": np.zeros((B, T), np.float32),  # no policy gradient: the critic alone
        "value_targets": targets,
        "old_values": np.zeros((B, T), np.float32),
    }
    cfg = RLConfig(lr=1e-2, loss=LossConfig(vf_coef=1.0))
    update = make_update_fn(model, cfg)
    state = init_train_state(params, cfg, jax.random.key(3))
    losses = []
    for _ in range(30):
        state, m = update(state, batch)
        losses.append(float(m["value_loss"]))
    assert losses[-1] < 0.3 * losses[0], losses
    assert float(m["loss"]) == pytest.approx(float(m["value_loss"]) + float(m["pg_loss"]), 1e-5)
    with pytest.raises(ValueError, match="needs batch\\['value_targets'\\]"):
        update(state, {k: v for k, v in batch.items() if k != "value_targets"})
    with pytest.raises(ValueError, match="needs a model with a value head"):
        make_update_fn(_model(""), cfg)


@pytest.mark.slow
def test_rl_with_a_critic_from_a_checkpoint_without_one(tmp_path):
    """PPO with GAE and a learned critic: RL starts from params saved without a value head (as
    an SFT checkpoint is), adds a fresh one and trains it; value metrics are logged."""
    base = load_config(SMOKE, [f"workdir={tmp_path}", "mesh.devices=1"])  # one device
    model = Transformer(ModelConfig(**base.model.to_dict()), get_policy(base.policy))
    sft = init_params(model, jax.random.key(5))
    src = stage_dir(str(tmp_path / "src"), "sft")
    with Checkpointer(src) as ckpt:
        ckpt.save(3, params=sft, opt_state={}, rng=jax.random.key(0))
    sets = [
        f"workdir={tmp_path}",
        "train.sft=False",
        f"train.init_from={tmp_path / 'src'}",
        "train.eval_before=False",
        "rl.advantage=gae",
        "rl.advantage_kwargs={'lam': 0.9, 'whiten': True}",
        "model.value_head=shared",
        "rl.loss.vf_coef=0.5",
        "rl.loss.vf_clip=0.2",
        "mesh.devices=1",
    ]
    summary = run(load_config(SMOKE, sets), progress=False)
    lines = [json.loads(x) for x in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    rl = [x for x in lines if "rl/value_loss" in x]
    assert len(rl) == base.train.rl_steps
    assert all(np.isfinite(x["rl/value_loss"]) and "rl/value_explained_var" in x for x in rl)
    assert summary["nonfinite_steps"] == 0
    with Checkpointer(stage_dir(summary["run_dir"], "rl"), resume=True) as ckpt:
        template = init_params(
            Transformer(dataclasses.replace(model.cfg, value_head="shared"), model.policy),
            jax.random.key(0),
        )
        params = ckpt.restore(params=template)["params"]
    head = np.asarray(params["params"]["value_head"]["kernel"])
    assert np.abs(head).sum() > 0  # trained away from its zero init
    trunk = jax.tree.leaves({k: v for k, v in params["params"].items() if k != "value_head"})
    moved = [not np.array_equal(a, b) for a, b in zip(trunk, jax.tree.leaves(sft), strict=True)]
    assert any(moved)


def test_initial_params_keeps_a_saved_head_and_adds_a_missing_one(tmp_path):
    from agentrl_jax.train.stages import initial_params

    model = _model("detached")
    template = init_params(model, jax.random.key(0))
    saved = _with_random_head(init_params(model, jax.random.key(1)), seed=2)
    trunk = {"params": {k: v for k, v in saved["params"].items() if k != "value_head"}}
    for name, params in (("with", saved), ("without", trunk)):
        with Checkpointer(str(tmp_path / name)) as ckpt:
            ckpt.save(1, params=params, opt_state={}, rng=jax.random.key(0))
    got = initial_params(str(tmp_path / "with"), template)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    got = initial_params(str(tmp_path / "without"), template)
    np.testing.assert_array_equal(got["params"]["value_head"]["kernel"], 0.0)  # fresh head
    for a, b in zip(
        jax.tree.leaves({k: v for k, v in got["params"].items() if k != "value_head"}),
        jax.tree.leaves(trunk),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="no checkpoint"):
        initial_params(str(tmp_path / "missing"), template)
