"""Mismatch metrics: hand-computed values and a numpy reference on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rl import mismatch

metrics_jit = jax.jit(mismatch.mismatch_metrics)


def test_hand_computed_logprob_metrics():
    d = np.array([[0.1, -0.2, 5.0], [0.3, 0.0, -7.0]], np.float32)  # 5 and -7 are masked out
    mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
    logp_rollout = jnp.full((2, 3), -2.0)
    out = metrics_jit(logp_rollout + d, logp_rollout, mask)
    valid = np.array([0.1, -0.2, 0.3, 0.0])
    np.testing.assert_allclose(out["n_tokens"], 4.0)
    np.testing.assert_allclose(out["mean_abs_dlogp"], 0.15, rtol=1e-5)
    np.testing.assert_allclose(out["max_abs_dlogp"], 0.3, rtol=1e-5)
    np.testing.assert_allclose(out["kl_k3"], np.mean(np.exp(valid) - 1 - valid), rtol=1e-4)
    # median of exp([0.1, -0.2, 0.3, 0]) is between exp(0) and exp(0.1)
    np.testing.assert_allclose(out["ratio_p50"], (1 + np.exp(0.1)) / 2, rtol=1e-5)
    w = np.exp(valid)
    np.testing.assert_allclose(out["ess"], w.sum() ** 2 / (4 * (w**2).sum()), rtol=1e-5)
    sw = np.exp([-0.1, 0.3])
    np.testing.assert_allclose(out["seq_ess"], sw.sum() ** 2 / (2 * (sw**2).sum()), rtol=1e-5)


def test_routing_agreement_hand_computed():
    # token 0: same experts in another order; token 1: one of two experts agrees;
    # token 2 disagrees but is masked out.
    train = jnp.array([[[[3, 5]], [[1, 2]], [[0, 1]]]], jnp.int32)  # [B=1, T=3, L=1, K=2]
    rollout = jnp.array([[[[5, 3]], [[1, 4]], [[6, 7]]]], jnp.int32)
    mask = jnp.array([[1, 1, 0]], bool)
    lp = jnp.full((1, 3), -1.0)
    out = metrics_jit(lp, lp, mask, routes_train=train, routes_rollout=rollout)
    np.testing.assert_allclose(out["routing_agreement"], 0.75)
    np.testing.assert_allclose(out["routing_exact_agreement"], 0.25)
    assert float(out["kl_k3"]) == 0.0 and float(out["ess"]) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    b, t, n_layers, k = 5, 16, 3, 2
    lp_roll = -rng.gamma(2.0, 1.0, size=(b, t)).astype(np.float32)
    lp_train = (lp_roll + rng.normal(0, 0.5, size=(b, t))).astype(np.float32)
    mask = rng.random((b, t)) < 0.6
    seq_mask = np.array([True, True, False, True, True])
    routes_t = rng.integers(0, 4, size=(b, t, n_layers, k)).astype(np.int32)
    routes_r = np.where(
        rng.random((b, t, n_layers, k)) < 0.7, routes_t, rng.integers(0, 4, size=routes_t.shape)
    ).astype(np.int32)
    out = metrics_jit(
        jnp.asarray(lp_train),
        jnp.asarray(lp_roll),
        jnp.asarray(mask),
        routes_train=jnp.asarray(routes_t),
        routes_rollout=jnp.asarray(routes_r),
        seq_mask=jnp.asarray(seq_mask),
    )

    valid = mask & seq_mask[:, None]
    d = (lp_train.astype(np.float64) - lp_roll)[valid]
    rho = np.exp(d)
    np.testing.assert_allclose(out["mean_abs_dlogp"], np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(out["max_abs_dlogp"], np.abs(d).max(), rtol=1e-5)
    np.testing.assert_allclose(out["kl_k3"], np.mean(rho - 1 - d), rtol=1e-4)
    for name, q in mismatch.QUANTILES:
        np.testing.assert_allclose(out[f"ratio_{name}"], np.quantile(rho, q), rtol=1e-5)
    np.testing.assert_allclose(out["ess"], rho.sum() ** 2 / (len(rho) * (rho**2).sum()), rtol=1e-5)
    seq_w = np.exp([(lp_train[i] - lp_roll[i])[valid[i]].sum() for i in range(b) if valid[i].any()])
    np.testing.assert_allclose(
        out["seq_ess"], seq_w.sum() ** 2 / (len(seq_w) * (seq_w**2).sum()), rtol=1e-4
    )
    member = [
        routes_t[i, j, layer, a] in routes_r[i, j, layer]
        for i in range(b)
        for j in range(t)
        if valid[i, j]
        for layer in range(n_layers)
        for a in range(k)
    ]
    exact = (routes_t == routes_r)[valid]
    np.testing.assert_allclose(out["routing_agreement"], np.mean(member), rtol=1e-6)
    np.testing.assert_allclose(out["routing_exact_agreement"], exact.mean(), rtol=1e-6)


def test_masked_quantiles_match_numpy():
    rng = np.random.default_rng(4)
    x = rng.normal(size=37).astype(np.float32)
    valid = rng.random(37) < 0.5
    qs = (0.0, 0.01, 0.33, 0.5, 0.9, 1.0)
    out = jax.jit(mismatch.masked_quantiles, static_argnums=2)(
        jnp.asarray(x), jnp.asarray(valid), qs
    )
    np.testing.assert_allclose(out, np.quantile(x[valid], qs), rtol=1e-6, atol=1e-7)


def test_empty_mask_is_finite_and_neutral():
    lp = jnp.asarray(np.random.default_rng(5).normal(size=(2, 4)), jnp.float32)
    routes = jnp.zeros((2, 4, 1, 2), jnp.int32)
    out = metrics_jit(
        lp, lp - 1.0, jnp.zeros((2, 4), bool), routes_train=routes, routes_rollout=routes + 1
    )
    assert all(np.isfinite(float(v)) for v in out.values())
    assert float(out["mean_abs_dlogp"]) == 0.0 and float(out["ratio_p50"]) == 1.0
    assert float(out["ess"]) == 1.0 and float(out["routing_agreement"]) == 1.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logp_rollout": jnp.zeros((2, 3))}, "logp_rollout"),
        ({"mask": jnp.ones((2,), bool)}, "mask"),
        ({"mask": jnp.ones((2, 4), jnp.float32)}, "mask must be bool"),
        ({"seq_mask": jnp.ones((3,), bool)}, "seq_mask"),
        ({"routes_train": jnp.zeros((2, 4, 1, 2), jnp.int32)}, "together"),
        (
            {
                "routes_train": jnp.zeros((2, 4, 2), jnp.int32),
                "routes_rollout": jnp.zeros((2, 4, 2), jnp.int32),
            },
            "routes_train",
        ),
        (
            {
                "routes_train": jnp.zeros((2, 4, 1, 2), jnp.int32),
                "routes_rollout": jnp.zeros((2, 4, 1, 3), jnp.int32),
            },
            "routes_rollout",
        ),
    ],
)
def test_bad_input_raises_naming_field(kwargs, match):
    args = {
        "logp_train": jnp.zeros((2, 4)),
        "logp_rollout": jnp.zeros((2, 4)),
        "mask": jnp.ones((2, 4), bool),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        mismatch.mismatch_metrics(**args)


def test_mismatch_by_source_hand_computed():
    f = lambda x: jnp.asarray([x], jnp.float32)  # noqa: E731
    rollout = f([0.0, -1.0, -2.0, -3.0])
    behaviour = f([0.0, -1.1, -2.0, -9.0])  # position 3 is masked out
    current = f([0.0, -1.0, -2.5, -9.0])
    routing = f([0.0, -1.0, -2.3, -9.0])
    mask = jnp.asarray([[False, True, True, False]])
    out = mismatch.mismatch_by_source(rollout, behaviour, current, mask, logp_routing_alt=routing)
    want = {"lag": (0.1 + 0.5) / 2, "numerics": 0.1 / 2, "routing": 0.2 / 2, "kv": 0.0}
    for name, value in want.items():
        np.testing.assert_allclose(float(out[name]), value, rtol=1e-5)
        np.testing.assert_allclose(float(out[f"{name}_share"]), value / 0.45, rtol=1e-5)
    np.testing.assert_allclose(float(out["total"]), 0.5 / 2, rtol=1e-5)
    same = mismatch.mismatch_by_source(rollout, rollout, rollout, mask)
    assert all(float(v) == 0.0 for v in same.values())
    with pytest.raises(ValueError, match="logp_kv_alt must have shape \\(1, 4\\)"):
        mismatch.mismatch_by_source(rollout, behaviour, current, mask, logp_kv_alt=rollout[:, :2])
