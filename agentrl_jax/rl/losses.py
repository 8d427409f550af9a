"""Policy losses: a registry of per-token surrogates by name, composed with the shared terms.

A registered loss is ``fn(inputs: LossInputs, cfg: LossConfig) -> (loss [B, T], flags)``: the
per-token policy-gradient loss and per-token f32 indicators (averaged over action tokens into
``<flag>_frac`` metrics). ``LossConfig.name`` picks it; ``policy_loss`` wraps every loss in the
same shared terms (``rl.loss_terms``): negative-advantage weighting, rollout/train mismatch
corrections, aggregation over tokens, the KL penalty to a reference, the entropy bonus, MoE
auxiliaries and the ratio metrics. A new variant is one decorated function, declaring the
``LossConfig`` fields a vectorised sweep may trace:

    @register_loss("my_variant", traced=("clip_low",))
    def my_variant(inputs, cfg):
        return get_loss("ppo").fn(inputs, cfg)

Registered here: ``ppo`` (clipped surrogate with clip-higher ``clip_low`` / ``clip_high`` and the
dual clip ``dual_clip``).

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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from agentrl_jax.rl.loss_terms import (
    AGG_MODES,
    KL_ESTIMATORS,
    LOG_RATIO_CAP,
    aggregate,
    correction_weights,
    kl_penalty,
    masked_mean,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LossConfig",
    "LossInputs",
    "RegisteredLoss",
    "aggregate",
    "correction_weights",
    "get_loss",
    "kl_penalty",
    "loss_names",
    "policy_loss",
    "ppo_surrogate",
    "register_loss",
    "value_loss",
]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Every knob of ``policy_loss`` (hashable, usable as a static argument).

    Attributes:
      name: the registered loss (``loss_names()``); the fields below it reads are its own,
        the others are the shared terms every loss gets.
      clip_low: ``ppo``: lower clip eps_low; ratio clipped to [1 - clip_low, ...], in (0, 1).
      clip_high: ``ppo``: upper clip eps_high (clip-higher when > clip_low), > 0.
      dual_clip: ``ppo``: dual-clip constant c > 1 bounding the loss of negative-advantage
        tokens by -c * A; None disables.
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

    name: str = "ppo"
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
        get_loss(self.name)  # ValueError lists the registered names
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
        ``jax.vmap``-ed sweep). The values themselves are not validated: they were validated as
        floats on the host, and the loss uses them arithmetically only.

        Raises:
          ValueError: a name the registered loss does not declare ``traced``.
        """
        traced = get_loss(self.name).traced
        bad = sorted(set(values) - set(traced))
        if bad:
            raise ValueError(
                f"loss {self.name!r} cannot trace {bad}; its traced hyperparameters: {traced}"
            )
        out = object.__new__(LossConfig)
        for f in dataclasses.fields(LossConfig):
            object.__setattr__(out, f.name, values.get(f.name, getattr(self, f.name)))
        return out


class LossInputs(NamedTuple):
    """What ``policy_loss`` hands a registered loss (f32 [B, T] unless noted).

    Attributes:
      log_ratio: logp_new - logp_old clipped to +-``LOG_RATIO_CAP`` (differentiable through
        logp_new; logp_old is a constant).
      ratio: exp(log_ratio), the per-token importance ratio.
      advantages: constants, negative values already scaled by ``negative_adv_weight``.
      mask: bool [B, T] action tokens to train on.
    """

    log_ratio: Array
    ratio: Array
    advantages: Array
    mask: Array


LossFn = Callable[[LossInputs, LossConfig], tuple[Array, dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class RegisteredLoss:
    """A policy loss of the registry.

    Attributes:
      name: its registry name (``LossConfig.name``).
      fn: ``fn(inputs: LossInputs, cfg: LossConfig) -> (loss f32 [B, T], flags)``, flags a
        dict of f32 [B, T] per-token indicators.
      traced: the float ``LossConfig`` fields of the loss a vectorised sweep may vary per point
        (``LossConfig.with_traced``, ``train/sweep_vmap.py``): the loss uses them arithmetically
        only, never in a Python branch.
    """

    name: str
    fn: LossFn
    traced: tuple[str, ...] = ()


_REGISTRY: dict[str, RegisteredLoss] = {}


def register_loss(
    name: str, *, traced: tuple[str, ...] = (), overwrite: bool = False
) -> Callable[[LossFn], LossFn]:
    """Decorator registering ``fn(inputs: LossInputs, cfg: LossConfig)`` under ``name``.

    Args:
      name: the registry name.
      traced: ``LossConfig`` fields the loss only uses arithmetically, which a vectorised
        sweep may therefore vary per point.
      overwrite: replace a loss already registered under ``name``.

    Raises:
      ValueError: ``name`` empty or already registered (without ``overwrite``), or a ``traced``
        entry that is not a ``LossConfig`` field.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"loss name must be a non-empty string, got {name!r}")
    fields = {f.name for f in dataclasses.fields(LossConfig)} - {"name"}
    unknown = sorted(set(traced) - fields)
    if unknown:
        raise ValueError(f"loss {name!r}: traced={unknown} are not LossConfig fields")

    def wrap(fn: LossFn) -> LossFn:
        if name in _REGISTRY and not overwrite:
            raise ValueError(
                f"loss {name!r} is already registered; pass overwrite=True to replace it"
            )
        _REGISTRY[name] = RegisteredLoss(name, fn, tuple(traced))
        return fn

    return wrap


def get_loss(name: str) -> RegisteredLoss:
    """Returns the loss registered as ``name``.

    Raises:
      ValueError: if ``name`` is not registered (the message lists the registered names).
    """
    if name not in _REGISTRY:
        raise ValueError(f"loss {name!r} is not registered; known: {loss_names()}")
    return _REGISTRY[name]


def loss_names() -> tuple[str, ...]:
    """Sorted names of all registered losses."""
    return tuple(sorted(_REGISTRY))


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


@register_loss("ppo", traced=("clip_low", "clip_high"))
def ppo(inputs: LossInputs, cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    """PPO's clipped surrogate on the token ratio (``ppo_surrogate``): clip-higher when
    ``clip_high`` > ``clip_low``, the dual clip with ``dual_clip``."""
    return ppo_surrogate(inputs.ratio, inputs.advantages, cfg)


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
    """Total policy loss and its metrics: the registered loss ``cfg.name`` in the shared terms.

      loss = agg(w * l) + kl_coef * agg(k(logp_new, logp_ref)) - entropy_coef * agg(H)
             + moe_lb_coef * lb + moe_z_coef * z

    with ``agg`` the configured aggregation over ``mask``, l the per-token loss of
    ``get_loss(cfg.name)`` (on advantages whose negative values are scaled by
    ``negative_adv_weight``) and w from ``correction_weights``. Gradients flow through
    logp_new (and entropy / MoE losses if they depend on the parameters); logp_old,
    logp_rollout, logp_ref and advantages are constants.

    Args:
      logp_new, logp_old, advantages: f32 [B, T]; logp_rollout optional f32 [B, T].
      mask: bool [B, T] action tokens to train on.
      cfg: LossConfig.
      logp_ref: f32 [B, T] reference-policy logprobs, required when cfg.kl_coef > 0.
      entropy: f32 [B, T] per-token policy entropy, required when cfg.entropy_coef > 0.
      moe_lb_loss, moe_z_loss: scalar MoE auxiliary losses (skipped if None).

    Returns:
      (scalar loss, dict of scalar metrics: pg_loss, the loss's flag fractions (``ppo``: clip
      fractions), approx_kl (k3 estimate of
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
    log_ratio = jnp.clip(logp_new - logp_old, -LOG_RATIO_CAP, LOG_RATIO_CAP)
    ratio = jnp.exp(log_ratio)
    pg_tok, flags = get_loss(cfg.name).fn(LossInputs(log_ratio, ratio, advantages, mask), cfg)
    w, metrics = correction_weights(logp_old, logp_rollout, mask, cfg)
    pg_loss = aggregate(pg_tok * w, mask, cfg.agg_mode, cfg.norm_constant)
    loss = pg_loss

    sg = jax.lax.stop_gradient
    metrics["pg_loss"] = sg(pg_loss)
    for name, flag in flags.items():
        metrics[f"{name}_frac"] = masked_mean(flag, m)
    r = sg(ratio)
    metrics["ratio_mean"] = masked_mean(r, m)
    any_tok = jnp.any(mask)  # with no valid token the ratio stats read 1 (no change)
    metrics["ratio_max"] = jnp.where(any_tok, jnp.max(jnp.where(mask, r, -jnp.inf)), 1.0)
    metrics["ratio_min"] = jnp.where(any_tok, jnp.min(jnp.where(mask, r, jnp.inf)), 1.0)
    metrics["approx_kl"] = masked_mean(r - 1.0 - sg(log_ratio), m)
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
