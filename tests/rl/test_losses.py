"""Policy losses: hand-computed values, a numpy reference on random inputs, gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rl import losses
from agentrl_jax.rl.losses import LossConfig

CFG = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)

# (advantage, ratio, expected per-token loss, clipped, clipped_low, clipped_high, dual_clipped)
SURROGATE_CASES = [
    (1.0, 1.5, -1.28, 1, 0, 1, 0),  # clip-higher bound 1 + 0.28
    (1.0, 0.5, -0.5, 0, 0, 0, 0),  # below 1 - eps_low with A > 0: unclipped
    (-1.0, 0.5, 0.8, 1, 1, 0, 0),  # A < 0, ratio under 1 - 0.2
    (-1.0, 5.0, 3.0, 0, 0, 0, 1),  # dual clip bounds the loss by -c A = 3
    (-1.0, 2.0, 2.0, 0, 0, 0, 0),  # within the dual bound
    (2.0, 1.1, -2.2, 0, 0, 0, 0),
]


@functools.cache
def _surrogate_all():
    """Runs every SURROGATE_CASES row in one jitted call (one compile for all cases)."""
    a = jnp.array([[c[0] for c in SURROGATE_CASES]])
    r = jnp.array([[c[1] for c in SURROGATE_CASES]])
    loss, flags = jax.jit(losses.ppo_surrogate, static_argnums=2)(r, a, CFG)
    return np.asarray(loss)[0], {k: np.asarray(v)[0] for k, v in flags.items()}


@pytest.mark.parametrize("i", range(len(SURROGATE_CASES)))
def test_ppo_surrogate_hand_computed(i):
    expected, *indicators = SURROGATE_CASES[i][2:]
    loss, flags = _surrogate_all()
    np.testing.assert_allclose(loss[i], expected, rtol=1e-6)
    names = ("clipped", "clipped_low", "clipped_high", "dual_clipped")
    assert [float(flags[k][i]) for k in names] == indicators


LOSS_MAT = jnp.array([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
AGG_MASK = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)


@pytest.mark.parametrize(
    "mode,norm,expected",
    [
        ("token-mean", None, 29 / 6),
        ("seq-mean-token-mean", None, (1.5 + 6.5) / 2),
        ("seq-mean-token-sum", None, (3 + 26) / 2),
        ("seq-mean-token-sum-norm", None, 29 / (3 * 4)),
        ("seq-mean-token-sum-norm", 8.0, 29 / (3 * 8)),
    ],
)
def test_aggregate_hand_computed(mode, norm, expected):
    out = jax.jit(losses.aggregate, static_argnums=(2, 3))(LOSS_MAT, AGG_MASK, mode, norm)
    np.testing.assert_allclose(float(out), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "estimator,expected",
    [("k1", [0.5, -1.0]), ("k2", [0.125, 0.5]), ("k3", [np.exp(-0.5) - 0.5, np.e - 2.0])],
)
def test_kl_estimators_hand_computed(estimator, expected):
    logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    out = jax.jit(losses.kl_penalty, static_argnums=2)(logp, ref, estimator)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_correction_weights_hand_computed():
    rho = np.array([[0.5, 1.0, 3.0, 1.2], [1.0, 1.0, 0.9, 100.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
    logp_old = jnp.full((2, 4), -1.0)
    logp_rollout = logp_old - jnp.log(jnp.asarray(rho, jnp.float32))
    weights = jax.jit(losses.correction_weights, static_argnums=3)
    w, m = weights(logp_old, logp_rollout, mask, LossConfig(tis_cap=2.0))
    np.testing.assert_allclose(w, [[0.5, 1, 2, 1.2], [1, 1, 0.9, 2]], rtol=1e-5)
    np.testing.assert_allclose(m["tis_truncated_frac"], 1 / 7, rtol=1e-6)
    w, m = losses.correction_weights(
        logp_old, logp_rollout, mask, LossConfig(icepop_band=(0.6, 2.5))
    )
    np.testing.assert_array_equal(w, [[0, 1, 0, 1], [1, 1, 1, 0]])
    np.testing.assert_allclose(m["icepop_dropped_frac"], 2 / 7, rtol=1e-6)
    # geometric means: row 0 1.8 ** (1/4) = 1.158 (rejected); row 1 0.9 ** (1/3) (the masked
    # 100 must not count)
    w, m = weights(logp_old, logp_rollout, mask, LossConfig(geo_band=(0.8, 1.1)))
    np.testing.assert_array_equal(w, [[0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(m["geo_rejected_seq_frac"], 0.5)


def test_policy_loss_hand_computed_total():
    logp_old = jnp.array([[-1.0, -2.0]])
    logp_new = logp_old + jnp.log(jnp.array([[1.5, 0.5]]))
    cfg = LossConfig(
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.5,
        kl_estimator="k1",
        entropy_coef=0.1,
        moe_lb_coef=0.01,
        moe_z_coef=0.001,
    )
    loss, m = jax.jit(functools.partial(losses.policy_loss, cfg=cfg))(
        logp_new,
        logp_old,
        None,
        jnp.array([[1.0, -1.0]]),
        jnp.ones((1, 2), bool),
        logp_ref=logp_new - jnp.array([[0.1, 0.3]]),
        entropy=jnp.array([[1.0, 3.0]]),
        moe_lb_loss=jnp.float32(0.7),
        moe_z_loss=jnp.float32(2.0),
    )
    # pg: mean(-1.2, 0.8) = -0.2; kl: 0.5 * 0.2; entropy: -0.1 * 2; moe: 0.007 + 0.002
    np.testing.assert_allclose(float(loss), -0.2 + 0.1 - 0.2 + 0.009, rtol=1e-5)
    np.testing.assert_allclose(float(m["pg_loss"]), -0.2, rtol=1e-5)
    np.testing.assert_allclose(float(m["clipped_frac"]), 1.0)
    np.testing.assert_allclose(float(m["ratio_max"]), 1.5, rtol=1e-6)
    np.testing.assert_allclose(float(m["ratio_min"]), 0.5, rtol=1e-6)
    expected_kl = np.mean([1.5 - 1 - np.log(1.5), 0.5 - 1 - np.log(0.5)])
    np.testing.assert_allclose(float(m["approx_kl"]), expected_kl, rtol=1e-5)


def test_negative_adv_weight_hand_computed():
    # ratios (1.1, 0.9, 1.5), advantages (2, -1, -2), clip 0.2, token-mean; weight 0.25 scales
    # the negative advantages to (-0.25, -0.5): per-token losses -2.2, 0.25 * 0.9 = 0.225,
    # max(0.5 * 1.5, 0.5 * 1.2) = 0.75; mean = (-2.2 + 0.225 + 0.75) / 3
    logp_old = jnp.array([[-1.0, -2.0, -0.5]])
    logp_new = logp_old + jnp.log(jnp.array([[1.1, 0.9, 1.5]]))
    adv = jnp.array([[2.0, -1.0, -2.0]])
    mask = jnp.ones((1, 3), bool)
    for weight, expected in ((1.0, (-2.2 + 0.9 + 3.0) / 3), (0.25, (-2.2 + 0.225 + 0.75) / 3)):
        cfg = LossConfig(clip_low=0.2, clip_high=0.2, negative_adv_weight=weight)
        loss, _ = losses.policy_loss(logp_new, logp_old, None, adv, mask, cfg)
        np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    # weight 0: failures give no gradient, successes the same as with weight 1
    cfg0 = LossConfig(negative_adv_weight=0.0)
    grad = jax.grad(lambda lp: losses.policy_loss(lp, logp_old, None, adv, mask, cfg0)[0])
    g = np.asarray(grad(logp_new))[0]
    np.testing.assert_allclose(g[1:], 0.0)
    np.testing.assert_allclose(g[0], -2.0 * 1.1 / 3, rtol=1e-5)


def test_policy_loss_gradient_hand_computed():
    # token-mean over 4 tokens: clipped tokens have zero gradient, others -A r w / n.
    ratio = jnp.array([[1.5, 0.5, 0.5, 1.1]])
    adv_ = jnp.array([[1.0, -1.0, 1.0, -2.0]])
    logp_old = jnp.array([[-1.0, -0.5, -2.0, -3.0]])
    logp_rollout = logp_old - jnp.log(jnp.array([[1.0, 1.0, 3.0, 1.0]]))  # rho 3 truncated to 2
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    fn = lambda lp: losses.policy_loss(
        lp, logp_old, logp_rollout, adv_, jnp.ones((1, 4), bool), cfg
    )[0]
    grad = jax.jit(jax.grad(fn))(logp_old + jnp.log(ratio))
    np.testing.assert_allclose(grad, [[0.0, 0.0, -1.0 * 0.5 * 2.0 / 4, 2.0 * 1.1 / 4]], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Numpy reference on random inputs.


def _np_policy_loss(logp_new, logp_old, logp_rollout, adv_, mask, cfg, logp_ref, entropy):
    m = mask.astype(np.float64)
    r = np.exp(logp_new - logp_old)
    pg = np.maximum(-adv_ * r, -adv_ * np.clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
    if cfg.dual_clip is not None:
        pg = np.where(adv_ < 0, np.minimum(pg, -cfg.dual_clip * adv_), pg)
    rho = np.exp(logp_old - logp_rollout)
    w = np.ones_like(rho)
    if cfg.tis_cap is not None:
        w *= np.minimum(rho, cfg.tis_cap)
    if cfg.icepop_band is not None:
        w *= (rho >= cfg.icepop_band[0]) & (rho <= cfg.icepop_band[1])
    if cfg.geo_band is not None:
        geo = np.exp((np.log(rho) * m).sum(1) / np.maximum(m.sum(1), 1))
        w *= ((geo >= cfg.geo_band[0]) & (geo <= cfg.geo_band[1]))[:, None]

    def agg(x):
        per_seq, n = (x * m).sum(1), m.sum(1)
        if cfg.agg_mode == "token-mean":
            return per_seq.sum() / n.sum()
        if cfg.agg_mode == "seq-mean-token-mean":
            return np.mean([per_seq[i] / n[i] for i in range(len(n)) if n[i] > 0])
        if cfg.agg_mode == "seq-mean-token-sum":
            return np.mean([per_seq[i] for i in range(len(n)) if n[i] > 0])
        return per_seq.sum() / (x.shape[0] * (cfg.norm_constant or x.shape[1]))

    d = logp_new - logp_ref
    kl = {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) - 1 + d}[cfg.kl_estimator]
    return agg(pg * w) + cfg.kl_coef * agg(kl) - cfg.entropy_coef * agg(entropy)


REF_CONFIGS = [
    LossConfig(),
    LossConfig(clip_high=0.28, dual_clip=3.0, agg_mode="seq-mean-token-mean", tis_cap=2.0),
    LossConfig(
        agg_mode="seq-mean-token-sum", icepop_band=(0.5, 2.0), kl_coef=0.1, kl_estimator="k1"
    ),
    LossConfig(
        agg_mode="seq-mean-token-sum-norm",
        norm_constant=16.0,
        geo_band=(0.9, 1.1),
        kl_coef=0.2,
        kl_estimator="k2",
        entropy_coef=0.01,
    ),
    LossConfig(
        agg_mode="seq-mean-token-sum-norm",
        kl_coef=0.05,
        kl_estimator="k3",
        entropy_coef=0.02,
        tis_cap=1.5,
        icepop_band=(0.2, 5.0),
    ),
]


def _random_batch(seed, b=4, t=10):
    rng = np.random.default_rng(seed)
    logp_old = -rng.gamma(2.0, 1.0, size=(b, t))
    mask = rng.random((b, t)) < 0.7
    mask[-1] = False  # an empty row must not count as a sequence
    return dict(
        logp_new=logp_old + rng.normal(0, 0.3, size=(b, t)),
        logp_old=logp_old,
        logp_rollout=logp_old + rng.normal(0, 0.4, size=(b, t)),
        adv_=rng.normal(size=(b, t)),
        mask=mask,
        logp_ref=logp_old + rng.normal(0, 0.2, size=(b, t)),
        entropy=rng.gamma(2.0, 1.0, size=(b, t)),
    )


@pytest.mark.parametrize("idx", range(len(REF_CONFIGS)))
def test_policy_loss_matches_numpy_reference(idx):
    cfg = REF_CONFIGS[idx]
    x = _random_batch(idx)
    j = {k: jnp.asarray(v, jnp.float32 if v.dtype != bool else bool) for k, v in x.items()}

    @functools.partial(jax.jit)
    def run(j):
        return jax.value_and_grad(
            lambda lp: losses.policy_loss(
                lp,
                j["logp_old"],
                j["logp_rollout"],
                j["adv_"],
                j["mask"],
                cfg,
                logp_ref=j["logp_ref"],
                entropy=j["entropy"],
            )[0]
        )(j["logp_new"])

    loss, grad = run(j)
    expected = _np_policy_loss(
        **{k: np.asarray(v, np.float64) if v.dtype != bool else v for k, v in x.items()}, cfg=cfg
    )
    np.testing.assert_allclose(float(loss), expected, rtol=1e-4, atol=1e-6)
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[~x["mask"]] == 0.0)


def test_gradients_finite_under_extreme_ratios():
    b, t = 2, 6
    rng = np.random.default_rng(3)
    logp_old = jnp.asarray(-rng.gamma(2.0, 1.0, size=(b, t)), jnp.float32)
    logp_new = logp_old + jnp.asarray([[60.0, -60.0, 0.0, 30.0, -30.0, 1.0]] * b)
    cfg = LossConfig(dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", tis_cap=2.0, geo_band=(0.5, 2))
    fn = lambda lp: losses.policy_loss(
        lp,
        logp_old,
        logp_old - 40.0,
        jnp.ones((b, t)),
        jnp.ones((b, t), bool),
        cfg,
        logp_ref=logp_old + 50.0,
    )
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp_new)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
    assert all(np.all(np.isfinite(v)) for v in metrics.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": 0.0}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"agg_mode": "mean"}, "agg_mode"),
        ({"norm_constant": 0.0}, "norm_constant"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"tis_cap": 0.5}, "tis_cap"),
        ({"icepop_band": (1.2, 2.0)}, "icepop_band"),
        ({"geo_band": (0.5,)}, "geo_band"),
        ({"negative_adv_weight": -0.5}, "negative_adv_weight"),
    ],
)
def test_loss_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)


def test_policy_loss_input_validation():
    x = jnp.zeros((2, 3))
    m = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match="advantages"):
        losses.policy_loss(x, x, None, jnp.zeros((2, 4)), m, LossConfig())
    with pytest.raises(ValueError, match="logp_ref"):
        losses.policy_loss(x, x, None, x, m, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="mask must be bool"):
        losses.policy_loss(x, x, None, x, m.astype(jnp.float32), LossConfig())
    with pytest.raises(ValueError, match="logp_rollout is required when tis_cap"):
        losses.policy_loss(x, x, None, x, m, LossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="entropy"):
        losses.policy_loss(x, x, None, x, m, LossConfig(entropy_coef=0.1))


def test_per_token_correction_of_mixed_version_episodes_is_unbiased():
    """Tokens of one episode sampled by two policy versions (the first half by mu_a, the rest
    by mu_b, as after a mid-episode weight switch): truncated IS with each token's own
    behaviour logprob gives the on-policy gradient of sum_t E_pi[A(t, a)] in expectation;
    without it the estimate is biased (here by many standard errors)."""
    t, v, n = 6, 4, 40_000
    rng = np.random.default_rng(0)
    theta = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
    mu = np.concatenate([rng.normal(size=(t // 2, v)), 2 * rng.normal(size=(t - t // 2, v))])
    log_mu = jax.nn.log_softmax(jnp.asarray(mu, jnp.float32))
    actions = jax.random.categorical(jax.random.key(1), log_mu, shape=(n, t))  # [n, t]
    cols = jnp.arange(t)[None]
    mask = jnp.ones((n, t), bool)

    def estimate(tis_cap):
        cfg = LossConfig(clip_low=0.2, clip_high=0.2, tis_cap=tis_cap)

        def loss(th):
            logp = jax.nn.log_softmax(th)[cols, actions]
            lp_old = jax.lax.stop_gradient(logp)  # the recomputed anchor: ratio 1
            return losses.policy_loss(logp, lp_old, log_mu[cols, actions], adv[cols, actions],
                                      mask, cfg)[0]  # fmt: skip

        return -jax.grad(loss)(theta) * t  # token-mean over n * t tokens

    exact = jax.grad(lambda th: jnp.sum(jax.nn.softmax(th) * adv))(theta)
    corrected = estimate(1e6)  # a cap no weight reaches: plain per-token IS
    err = float(jnp.max(jnp.abs(corrected - exact)))
    assert err < 0.05, err
    uncorrected = estimate(None)
    assert float(jnp.max(jnp.abs(uncorrected - exact))) > 5 * err
