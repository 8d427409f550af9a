"""Policy losses: PPO clipped surrogate (clip-higher, dual clip), KL, entropy, MoE auxiliaries,
and rollout/train mismatch corrections (truncated IS, IcePop masking, geometric-mean rejection).

Three log-probabilities per action token:
  logp_new      current parameters (differentiated),
  logp_old      parameters that produced the rollout, recomputed by the trainer (PPO anchor),
  logp_rollout  what the sampler reported for the same tokens: the behaviour policy's logprob
                of each token (differs from logp_old by numerics: dtype, kernels, KV
                compression, routing; and in asynchronous RL by the policy lag).
PPO ratio r = exp(logp_new - logp_old); rollout-correction ratio rho = exp(logp_old -
logp_rollout) (no gradient). Corrections turn rho into per-token weights w that multiply the
per-token loss; dropped tokens keep their place in the aggregation normaliser.

Asynchronous RL (``RLConfig.max_staleness`` > 0) trains on tokens sampled by older policy
versions, several of them within one episode when weights switch mid-rollout
(``Trajectory.policy_versions``). Every correction here is per token on that token's own
behaviour logprob, so a mixed-version episode is weighted token by token by the version that
sampled it (decoupled PPO: logp_old is the proximal policy, rho the behaviour correction);
``geo_band`` takes its geometric mean over the episode's tokens whatever their versions.

Shape legend: B sequences, T tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import Array

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
_LOG_RATIO_CAP = 20.0  # exp(20) ~ 5e8: keeps exp finite in f32 for outlier tokens


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Every knob of ``policy_loss`` (hashable, usable as a static argument).

    Attributes:
      clip_low: PPO lower clip eps_low; ratio clipped to [1 - clip_low, ...], in (0, 1).
      clip_high: PPO upper clip eps_high (clip-higher when > clip_low), > 0.
      dual_clip: dual-clip constant c > 1 bounding the loss of negative-advantage tokens by
        -c * A; None disables.
      agg_mode: one of ``AGG_MODES``.
      norm_constant: constant token normaliser of 'seq-mean-token-sum-norm' (> 0); None uses T.
      kl_coef: weight of KL(pi_new || pi_ref) (>= 0); 0 disables (logp_ref not needed).
      kl_estimator: 'k1' | 'k2' | 'k3' (Schulman's estimators with samples from pi_new).
      entropy_coef: weight of the entropy bonus (>= 0); the loss subtracts coef * entropy.
      moe_lb_coef: weight of the MoE load-balance loss (>= 0).
      moe_z_coef: weight of the MoE router z-loss (>= 0).
      tis_cap: truncated importance sampling cap C (>= 1): w *= min(rho, C); None disables.
      icepop_band: (low, high) with 0 <= low < 1 < high; tokens with rho outside are dropped
        (w = 0); None disables.
      geo_band: (low, high) with 0 <= low < 1 < high; sequences whose geometric-mean rho
        exp(mean_t log rho) is outside are dropped; None disables.
      negative_adv_weight: multiplies negative advantages (>= 0): A <- w * A where A < 0.
        1 is the plain objective; < 1 weighs reinforcing successes above suppressing failures
        (suppression spreads probability mass and raises entropy; 0 keeps successes only).
      vf_coef: weight of the value-head loss (>= 0; ``value_loss``); > 0 needs a model with
        ``value_head`` and batches with ``value_targets`` / ``old_values``.
      vf_clip: PPO value clip eps_v (> 0): the clipped prediction stays within eps_v of the
        value the rollout batch was scored with; None disables.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg_mode: str = "token-mean"
    norm_constant: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    moe_lb_coef: float = 0.0
    moe_z_coef: float = 0.0
    tis_cap: float | None = None
    icepop_band: tuple[float, float] | None = None
    geo_band: tuple[float, float] | None = None
    negative_adv_weight: float = 1.0
    vf_coef: float = 0.0
    vf_clip: float | None = None

    def __post_init__(self):
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(f"clip_low={self.clip_low} must be in (0, 1)")
        if not self.clip_high > 0.0:
            raise ValueError(f"clip_high={self.clip_high} must be > 0")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 or None")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode={self.agg_mode!r} must be one of {AGG_MODES}")
        if self.norm_constant is not None and not self.norm_constant > 0:
            raise ValueError(f"norm_constant={self.norm_constant} must be > 0 or None")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator={self.kl_estimator!r} must be one of {KL_ESTIMATORS}")
        for field in (
            "kl_coef",
            "entropy_coef",
            "moe_lb_coef",
            "moe_z_coef",
            "negative_adv_weight",
            "vf_coef",
        ):
            if not getattr(self, field) >= 0.0:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 0")
        if self.vf_clip is not None and not self.vf_clip > 0.0:
            raise ValueError(f"vf_clip={self.vf_clip} must be > 0 or None")
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap={self.tis_cap} must be >= 1 or None")
        for field in ("icepop_band", "geo_band"):
            band = getattr(self, field)
            if band is None:
                continue
            if len(band) != 2 or not 0.0 <= band[0] < 1.0 < band[1]:
                raise ValueError(f"{field}={band} must be (low, high) with 0 <= low < 1 < high")
            object.__setattr__(self, field, (float(band[0]), float(band[1])))

    def with_traced(self, **values) -> LossConfig:
        """A copy whose named fields hold traced values (e.g. per-point ``clip_low`` in a
        ``jax.vmap``-ed sweep). Not validated: the values were validated as floats on the host;
        the loss uses them arithmetically only."""
        out = object.__new__(LossConfig)
        for f in dataclasses.fields(LossConfig):
            object.__setattr__(out, f.name, values.get(f.name, getattr(self, f.name)))
        return out


def _masked_mean(x: Array, mask: Array) -> Array:
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
    cfg: LossConfig,
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
        "value_clipped_frac": _masked_mean(clipped, m),
        "value_mean": _masked_mean(sg(v), m),
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
    d = jnp.clip(d, -_LOG_RATIO_CAP, _LOG_RATIO_CAP)
    return jnp.exp(-d) - 1.0 + d


def correction_weights(
    logp_old: Array,
    logp_rollout: Array | None,
    mask: Array,
    cfg: LossConfig,
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
    log_rho = jnp.clip(log_rho, -_LOG_RATIO_CAP, _LOG_RATIO_CAP)
    rho = jnp.exp(log_rho)
    m = mask.astype(jnp.float32)
    if cfg.tis_cap is not None:
        w = w * jnp.minimum(rho, cfg.tis_cap)
        metrics["tis_truncated_frac"] = _masked_mean((rho > cfg.tis_cap).astype(jnp.float32), m)
    if cfg.icepop_band is not None:
        lo, hi = cfg.icepop_band
        keep = (rho >= lo) & (rho <= hi)
        w = w * keep
        metrics["icepop_dropped_frac"] = _masked_mean((~keep).astype(jnp.float32), m)
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


def ppo_surrogate(
    ratio: Array, advantages: Array, cfg: LossConfig
) -> tuple[Array, dict[str, Array]]:
    """Per-token PPO loss with clip-higher and dual clip.

      l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
      dual clip (A < 0):  l = min(l, -c A)

    Returns:
      (loss [B, T], per-token indicator arrays 'clipped', 'clipped_low', 'clipped_high',
      'dual_clipped' as f32 for masked averaging).
    """
    a = advantages.astype(jnp.float32)
    l1 = -a * ratio
    l2 = -a * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = jnp.maximum(l1, l2)
    flags = {
        "clipped": (l2 > l1).astype(jnp.float32),
        "clipped_low": ((ratio < 1.0 - cfg.clip_low) & (a < 0)).astype(jnp.float32),
        "clipped_high": ((ratio > 1.0 + cfg.clip_high) & (a > 0)).astype(jnp.float32),
    }
    if cfg.dual_clip is not None:
        l3 = -a * cfg.dual_clip
        dual = (a < 0) & (loss > l3)
        loss = jnp.where(dual, l3, loss)
        flags["dual_clipped"] = dual.astype(jnp.float32)
    return loss, flags


def policy_loss(
    logp_new: Array,
    logp_old: Array,
    logp_rollout: Array | None,
    advantages: Array,
    mask: Array,
    cfg: LossConfig,
    *,
    logp_ref: Array | None = None,
    entropy: Array | None = None,
    moe_lb_loss: Array | None = None,
    moe_z_loss: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Total policy loss and its metrics.

      loss = agg(w * l_ppo) + kl_coef * agg(k(logp_new, logp_ref)) - entropy_coef * agg(H)
             + moe_lb_coef * lb + moe_z_coef * z

    with ``agg`` the configured aggregation over ``mask``, l_ppo from ``ppo_surrogate`` (on
    advantages whose negative values are scaled by ``negative_adv_weight``) and w from
    ``correction_weights``. Gradients flow through logp_new (and entropy / MoE losses if they
    depend on the parameters); logp_old, logp_rollout, logp_ref and advantages are constants.

    Args:
      logp_new, logp_old, advantages: f32 [B, T]; logp_rollout optional f32 [B, T].
      mask: bool [B, T] action tokens to train on.
      cfg: LossConfig.
      logp_ref: f32 [B, T] reference-policy logprobs, required when cfg.kl_coef > 0.
      entropy: f32 [B, T] per-token policy entropy, required when cfg.entropy_coef > 0.
      moe_lb_loss, moe_z_loss: scalar MoE auxiliary losses (skipped if None).

    Returns:
      (scalar loss, dict of scalar metrics: pg_loss, clip fractions, approx_kl (k3 estimate of
      KL(old || new)), ratio_mean/min/max, kl, entropy, correction fractions).

    Raises:
      ValueError: on a shape mismatch, a non-bool mask, or a missing input the config needs
        (logp_ref for kl_coef > 0, entropy for entropy_coef > 0, logp_rollout for corrections).
    """
    shape = tuple(logp_new.shape)
    if len(shape) != 2:
        raise ValueError(f"logp_new must be [B, T], got shape {shape}")
    named = {"logp_old": logp_old, "logp_rollout": logp_rollout, "advantages": advantages}
    named |= {"mask": mask, "logp_ref": logp_ref, "entropy": entropy}
    for field, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{field} must have shape {shape}, got {tuple(value.shape)}")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    corrections = [f for f in ("tis_cap", "icepop_band", "geo_band") if getattr(cfg, f) is not None]
    if corrections and logp_rollout is None:
        raise ValueError(f"logp_rollout is required when {', '.join(corrections)} is set")
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError("logp_ref is required when kl_coef > 0")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy is required when entropy_coef > 0")

    m = mask.astype(jnp.float32)
    logp_new = logp_new.astype(jnp.float32)
    logp_old = jax.lax.stop_gradient(logp_old.astype(jnp.float32))
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    if cfg.negative_adv_weight != 1.0:
        advantages = jnp.where(advantages < 0, cfg.negative_adv_weight * advantages, advantages)
    log_ratio = jnp.clip(logp_new - logp_old, -_LOG_RATIO_CAP, _LOG_RATIO_CAP)
    ratio = jnp.exp(log_ratio)
    pg_tok, flags = ppo_surrogate(ratio, advantages, cfg)
    w, metrics = correction_weights(logp_old, logp_rollout, mask, cfg)
    pg_loss = aggregate(pg_tok * w, mask, cfg.agg_mode, cfg.norm_constant)
    loss = pg_loss

    sg = jax.lax.stop_gradient
    metrics["pg_loss"] = sg(pg_loss)
    for name, flag in flags.items():
        metrics[f"{name}_frac"] = _masked_mean(flag, m)
    r = sg(ratio)
    metrics["ratio_mean"] = _masked_mean(r, m)
    any_tok = jnp.any(mask)  # with no valid token the ratio stats read 1 (no change)
    metrics["ratio_max"] = jnp.where(any_tok, jnp.max(jnp.where(mask, r, -jnp.inf)), 1.0)
    metrics["ratio_min"] = jnp.where(any_tok, jnp.min(jnp.where(mask, r, jnp.inf)), 1.0)
    metrics["approx_kl"] = _masked_mean(r - 1.0 - sg(log_ratio), m)
    if cfg.kl_coef > 0:
        kl = aggregate(
            kl_penalty(logp_new, sg(logp_ref), cfg.kl_estimator),
            mask,
            cfg.agg_mode,
            cfg.norm_constant,
        )
        loss = loss + cfg.kl_coef * kl
        metrics["kl_ref"] = sg(kl)
    if entropy is not None:
        ent = aggregate(entropy.astype(jnp.float32), mask, cfg.agg_mode, cfg.norm_constant)
        metrics["entropy"] = sg(ent)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    if moe_lb_loss is not None:
        loss = loss + cfg.moe_lb_coef * moe_lb_loss
        metrics["moe_lb_loss"] = sg(moe_lb_loss)
    if moe_z_loss is not None:
        loss = loss + cfg.moe_z_coef * moe_z_loss
        metrics["moe_z_loss"] = sg(moe_z_loss)
    metrics["loss"] = sg(loss)
    return loss, metrics
