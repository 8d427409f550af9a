"""Attention mass for attention-based credit: a numpy reference, the model pass, the loop."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.config import load_config
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.attention_credit import attention_credit_mass, final_turn_queries, layer_mass
from benchmarks.common import preset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"


def _reference_layer_mass(q, k, queries, valid, window):
    """Loops over rows, heads and keys (float64)."""
    b, t, n, h = q.shape
    rep = n // k.shape[2]
    out = np.zeros((b, t))
    for bi in range(b):
        rows = [i for i in range(t) if queries[bi, i]]
        for i in rows:
            for ni in range(n):
                keys = [
                    j
                    for j in range(t)
                    if j <= i and valid[bi, j] and (window is None or i - j < window)
                ]
                s = np.array([q[bi, i, ni] @ k[bi, j, ni // rep] for j in keys]) / np.sqrt(h)
                p = np.exp(s - s.max())
                p /= p.sum()
                for j, pj in zip(keys, p):
                    out[bi, j] += pj / (n * len(rows))
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_layer_mass_matches_reference(window):
    r = np.random.default_rng(0)
    b, t, n, kh, h = 2, 7, 4, 2, 5
    q = r.normal(size=(b, t, n, h))
    k = r.normal(size=(b, t, kh, h))
    queries = np.zeros((b, t), bool)
    queries[0, 4:6] = True
    queries[1, 6] = True
    valid = np.ones((b, t), bool)
    valid[1, 2] = False  # a padding key inside the row
    got = layer_mass(
        jnp.asarray(q, jnp.float32),
        jnp.asarray(k, jnp.float32),
        jnp.asarray(queries),
        jnp.asarray(valid),
        window,
    )
    want = _reference_layer_mass(q, k, queries, valid, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got).sum(1), 1.0, rtol=1e-5)


def test_final_turn_queries_hand_computed():
    action = jnp.array([[0, 1, 1, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], bool)
    turns = jnp.array([[0, 0, 0, 1, 1, 1, -1], [0, 0, 1, 1, -1, -1, -1], [0] * 7])
    want = [[0, 0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0], [0] * 7]
    np.testing.assert_array_equal(
        np.asarray(final_turn_queries(action, turns)), np.array(want, bool)
    )


def test_model_mass_from_the_training_pass():
    """Mass of a 4-layer hybrid model (S then D, twice) from the sown q / k: the logits are
    those of a plain pass, the final turn's tokens get 0, the rest sums to what the final turn
    does not take, and a hand-rebuilt reference from the sown q / k agrees."""
    cfg = preset("tiny-dense", n_layers=4, d_ff=64, window=4, init_std=0.02)
    model = Transformer(cfg, get_policy("fp32"))
    params = init_params(model, jax.random.key(0))
    r = np.random.default_rng(1)
    tokens = jnp.asarray(r.integers(0, 64, (2, 10)), jnp.int32)
    valid = jnp.ones((2, 10), bool).at[1, 8:].set(False)
    action = jnp.zeros((2, 10), bool).at[:, 2:4].set(True).at[0, 7:9].set(True).at[1, 5:7].set(True)
    turns = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    mass = np.asarray(attention_credit_mass(model, params, tokens, valid, action, turns))

    plain, _, _ = model.apply(params, tokens, valid=valid)
    (sown, _, _), state = model.apply(params, tokens, valid=valid, mutable=["intermediates"])
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(sown))
    assert np.all(mass[np.asarray(turns) == 1] == 0.0)
    assert np.all(mass >= 0) and np.all(mass[:, :4].sum(1) < 1.0) and np.all(mass[:, :4] > 0)

    queries = np.asarray(final_turn_queries(action, turns))
    attn = state["intermediates"]["groups"]
    want = np.zeros((2, 10))
    for i, window in ((0, 4), (1, None)):
        ((q, k),) = attn[f"layer_{i}"]["attn"]["qk"]
        for g in range(2):  # 4 layers = 2 repetitions of the pattern
            want += _reference_layer_mass(
                np.asarray(q[g], np.float64), np.asarray(k[g], np.float64), queries, valid, window
            )
    want = np.where(np.asarray(turns) == 1, 0.0, want / 4)
    np.testing.assert_allclose(mass, want, rtol=1e-4, atol=1e-6)


def test_loop_runs_attention_credit(tmp_path):
    from agentrl_jax.experiment import build
    from agentrl_jax.train.rl_loop import RLRun

    cfg = load_config(
        SMOKE, ["train.sft=False", "train.eval_before=False", "rl.advantage=attn_credit"]
    )
    model_cfg = ModelConfig(**cfg.model.to_dict())
    params = init_params(Transformer(model_cfg, get_policy(cfg.policy)), jax.random.key(0))
    metrics = RLRun(build(cfg), str(tmp_path), params, seed=cfg.seed, resume=False).step(0)
    assert np.isfinite(metrics["loss"])
