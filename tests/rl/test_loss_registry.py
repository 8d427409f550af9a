"""The policy-loss registry: lookup, registration errors, traced fields, and a registered variant
wrapped in the shared terms (negative-advantage weight, corrections, aggregation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rl import losses
from agentrl_jax.rl.losses import LossConfig, LossInputs, get_loss, loss_names, register_loss


@register_loss("test_plain_pg", overwrite=True)
def _plain_pg(inputs: LossInputs, cfg: LossConfig):
    """A variant without clipping: l = -A r; flags the negative-advantage tokens."""
    del cfg
    return -inputs.advantages * inputs.ratio, {"negative": (inputs.advantages < 0).astype(float)}


def test_registry_lookup():
    assert "ppo" in loss_names()
    assert get_loss("ppo").traced == ("clip_low", "clip_high")
    assert LossConfig().name == "ppo"
    with pytest.raises(ValueError, match="'nope' is not registered; known: .*'ppo'"):
        get_loss("nope")
    with pytest.raises(ValueError, match="nope"):
        LossConfig(name="nope")


@pytest.mark.parametrize(
    "name,traced,match",
    [
        ("ppo", (), "already registered"),
        ("", (), "non-empty"),
        ("test_bad_traced", ("clip_lo",), r"traced=\['clip_lo'\]"),
    ],
)
def test_register_loss_errors(name, traced, match):
    with pytest.raises(ValueError, match=match):
        register_loss(name, traced=traced)(_plain_pg)


def test_with_traced_only_the_declared_fields():
    cfg = LossConfig(clip_low=0.3)
    out = cfg.with_traced(clip_high=jnp.float32(0.4))
    assert out.clip_low == 0.3 and float(out.clip_high) == pytest.approx(0.4)
    with pytest.raises(ValueError, match=r"cannot trace \['dual_clip'\]"):
        cfg.with_traced(dual_clip=3.0)
    with pytest.raises(ValueError, match="cannot trace"):
        LossConfig(name="test_plain_pg").with_traced(clip_low=0.3)


def test_registered_variant_gets_the_shared_terms():
    """Ratios (1.5, 0.5 | 2.0, pad), advantages (1, -1 | -2), rollout rho (1, 3 | 1): the plain
    variant's per-token losses -1.5, 0.5 | 4.0; negative_adv_weight 0.5 halves the negative
    advantages (0.25 and 2.0), tis_cap 2 weighs the second token by 2 (0.5), and
    seq-mean-token-mean averages (-1.5 + 0.5) / 2 and 2.0 / 1 to 0.75."""
    logp_old = jnp.array([[-1.0, -2.0], [-0.5, 0.0]])
    logp_new = logp_old + jnp.log(jnp.array([[1.5, 0.5], [2.0, 1.0]]))
    logp_rollout = logp_old - jnp.log(jnp.array([[1.0, 3.0], [1.0, 1.0]]))
    adv = jnp.array([[1.0, -1.0], [-2.0, 0.0]])
    mask = jnp.array([[True, True], [True, False]])
    cfg = LossConfig(
        name="test_plain_pg",
        agg_mode="seq-mean-token-mean",
        negative_adv_weight=0.5,
        tis_cap=2.0,
    )
    loss, m = jax.jit(losses.policy_loss, static_argnums=5)(
        logp_new, logp_old, logp_rollout, adv, mask, cfg
    )
    np.testing.assert_allclose(float(loss), 0.75, rtol=1e-5)
    np.testing.assert_allclose(float(m["negative_frac"]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["tis_truncated_frac"]), 1 / 3, rtol=1e-6)
    assert "clipped_frac" not in m  # ppo's flags belong to ppo
    ppo_loss, _ = losses.policy_loss(
        logp_new,
        logp_old,
        logp_rollout,
        adv,
        mask,
        LossConfig(agg_mode="seq-mean-token-mean", negative_adv_weight=0.5, tis_cap=2.0),
    )
    assert float(ppo_loss) != pytest.approx(0.75)  # the name picked the loss
