"""The terms every registered policy loss shares: aggregation over tokens, the KL penalty to a
reference policy, rollout/train mismatch correction weights, and the critic's value loss.

``rl.losses.policy_loss`` composes them around the registered loss's per-token surrogate, so a
loss variant gets every aggregation mode, the KL and entropy terms and the corrections (truncated
IS, IcePop, geometric-mean rejection) without restating them.

Shape legend: B sequences, T tokens.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from jax import Array

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_CAP = 20.0  # exp(20) ~ 5e8: keeps exp finite in f32 for outlier tokens


class TermSettings(Protocol):
    """The settings the shared terms read; ``rl.losses.LossConfig`` holds them (documented
    there)."""

    agg_mode: str
    norm_constant: float | None
    tis_cap: float | None
    icepop_band: tuple[float, float] | None
    geo_band: tuple[float, float] | None
    vf_clip: float | None


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of ``x`` over the tokens where ``mask`` is set (0 when none is)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def aggregate(
    loss_mat: Array,
    mask: Array,
    mode: str,
    norm_constant: float | None = None,
) -> Array:
    """Reduces a per-token loss to a scalar.

    With m the mask, L_b = sum_t l[b,t] m[b,t], n_b = sum_t m[b,t] and S the sequences with n_b > 0:
      token-mean:               sum_b L_b / sum_b n_b
      seq-mean-token-mean:      mean_{b in S} L_b / n_b
      seq-mean-token-sum:       mean_{b in S} L_b
      seq-mean-token-sum-norm:  sum_b L_b / (B * C), C = norm_constant or T (Dr.GRPO: a constant
                                normaliser independent of lengths).

    Raises:
      ValueError: if mode is not in ``AGG_MODES``.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg_mode={mode!r} must be one of {AGG_MODES}")
    m = mask.astype(jnp.float32)
    per_seq = jnp.sum(loss_mat * m, axis=1)
    n_tok = jnp.sum(m, axis=1)
    n_seq = jnp.maximum(jnp.sum((n_tok > 0).astype(jnp.float32)), 1.0)
    if mode == "token-mean":
        return jnp.sum(per_seq) / jnp.maximum(jnp.sum(n_tok), 1.0)
    if mode == "seq-mean-token-mean":
        return jnp.sum(per_seq / jnp.maximum(n_tok, 1.0)) / n_seq
    if mode == "seq-mean-token-sum":
        return jnp.sum(per_seq) / n_seq
    c = float(loss_mat.shape[1]) if norm_constant is None else float(norm_constant)
    return jnp.sum(per_seq) / (loss_mat.shape[0] * c)


def value_loss(
    values: Array,
    old_values: Array,
    targets: Array,
    mask: Array,
    cfg: TermSettings,
) -> tuple[Array, dict[str, Array]]:
    """PPO value loss of a critic, aggregated like the policy loss (``cfg.agg_mode``).

      l_t = 1/2 (V_t - R_t)^2                                  (vf_clip None)
      l_t = 1/2 max((V_t - R_t)^2, (V_old + clip(V_t - V_old, -eps_v, eps_v) - R_t)^2)

    with V the current prediction (differentiated), V_old the prediction the batch was scored
    with and R the target (e.g. GAE advantage + V_old); V_old and R are constants.

    Args:
      values, old_values, targets: f32 [B, T]; mask: bool [B, T] tokens to fit.

    Returns:
      (scalar loss, metrics ``value_loss``, ``value_clipped_frac``, ``value_mean``).
    """
    sg = jax.lax.stop_gradient
    v = values.astype(jnp.float32)
    v_old, r = sg(old_values.astype(jnp.float32)), sg(targets.astype(jnp.float32))
    sq = jnp.square(v - r)
    clipped = jnp.zeros_like(sq)
    if cfg.vf_clip is not None:
        v_clip = v_old + jnp.clip(v - v_old, -cfg.vf_clip, cfg.vf_clip)
        sq_clip = jnp.square(v_clip - r)
        clipped = (sq_clip > sq).astype(jnp.float32)
        sq = jnp.maximum(sq, sq_clip)
    loss = aggregate(0.5 * sq, mask, cfg.agg_mode, cfg.norm_constant)
    m = mask.astype(jnp.float32)
    metrics = {
        "value_loss": sg(loss),
        "value_clipped_frac": masked_mean(clipped, m),
        "value_mean": masked_mean(sg(v), m),
    }
    return loss, metrics


def kl_penalty(logp: Array, logp_ref: Array, estimator: str) -> Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with d = logp - logp_ref:

    k1 = d,   k2 = d^2 / 2,   k3 = exp(-d) - 1 + d   (unbiased, >= 0; d clipped to +-20).

    Raises:
      ValueError: if estimator is not in ``KL_ESTIMATORS``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} must be one of {KL_ESTIMATORS}")
    d = logp - logp_ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    d = jnp.clip(d, -LOG_RATIO_CAP, LOG_RATIO_CAP)
    return jnp.exp(-d) - 1.0 + d


def correction_weights(
    logp_old: Array,
    logp_rollout: Array | None,
    mask: Array,
    cfg: TermSettings,
) -> tuple[Array, dict[str, Array]]:
    """Per-token weights (no gradient) correcting for rollout-vs-train mismatch.

    rho = exp(logp_old - logp_rollout). Starting from w = 1:
      tis_cap C:          w *= min(rho, C)
      icepop_band [l, h]: w *= [l <= rho <= h]
      geo_band [l, h]:    w *= [l <= exp(mean_{t in seq} log rho) <= h]   (whole sequence)
    With ``logp_rollout`` None, or no correction enabled, w = 1.

    Returns:
      (w f32 [B, T], metrics: fraction of tokens truncated / dropped, of sequences rejected).
    """
    metrics: dict[str, Array] = {}
    w = jnp.ones(mask.shape, jnp.float32)
    if logp_rollout is None:
        return w, metrics
    log_rho = jax.lax.stop_gradient(logp_old - logp_rollout).astype(jnp.float32)
    log_rho = jnp.clip(log_rho, -LOG_RATIO_CAP, LOG_RATIO_CAP)
    rho = jnp.exp(log_rho)
    m = mask.astype(jnp.float32)
    if cfg.tis_cap is not None:
        w = w * jnp.minimum(rho, cfg.tis_cap)
        metrics["tis_truncated_frac"] = masked_mean((rho > cfg.tis_cap).astype(jnp.float32), m)
    if cfg.icepop_band is not None:
        lo, hi = cfg.icepop_band
        keep = (rho >= lo) & (rho <= hi)
        w = w * keep
        metrics["icepop_dropped_frac"] = masked_mean((~keep).astype(jnp.float32), m)
    if cfg.geo_band is not None:
        lo, hi = cfg.geo_band
        n_tok = jnp.sum(m, axis=1)
        geo = jnp.exp(jnp.sum(log_rho * m, axis=1) / jnp.maximum(n_tok, 1.0))
        keep_seq = (geo >= lo) & (geo <= hi)
        w = w * keep_seq[:, None]
        has = (n_tok > 0).astype(jnp.float32)
        rejected = jnp.sum((~keep_seq) * has) / jnp.maximum(jnp.sum(has), 1.0)
        metrics["geo_rejected_seq_frac"] = rejected
    return w, metrics
