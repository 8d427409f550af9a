"""Rollout-vs-train mismatch metrics, logged every step (jittable, no gradient use).

With d = logp_train - logp_rollout on valid action tokens and ratio rho = exp(d) (the weight that
turns samples of the rollout policy into samples of the training policy):
  mean_abs_dlogp, max_abs_dlogp   mean / max |d|
  kl_k3                           mean (rho - 1 - d), unbiased for KL(pi_rollout || pi_train)
  ratio_p01 ... ratio_p99         quantiles of rho (linear interpolation, as numpy's default)
  ess                             normalised effective sample size of the token ratios,
                                  (sum rho)^2 / (n sum rho^2) in (0, 1]
  seq_ess                         the same for sequence ratios exp(sum_t d) (log space)
  routing_agreement               fraction of train route entries (token, layer, k) whose expert
                                  is among the rollout's top-k experts of that token and layer
                                  (order-insensitive); routing_exact_agreement compares entry by
                                  entry. Only with routes.
With no valid token every metric reads its no-mismatch value (0 differences, ratios and ESS 1).

By source (:func:`mismatch_by_source`), from teacher-forced recomputations of the same tokens:
  lag        behaviour version vs current parameters (both teacher-forced, same replay)
  numerics   rollout vs trainer at the behaviour version (dtype, kernels, and under a
             "continue" partial rollout the KV an older version computed)
  routing    current parameters with vs without MoE routing replay
  kv         current parameters with vs without KV-mask (eviction / int8) replay

Shape legend: B sequences, T tokens, L MoE layers, K experts per token (top-k), N = B*T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

QUANTILES = (("p01", 0.01), ("p10", 0.10), ("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
_LOG_RATIO_CAP = 20.0


def masked_quantiles(x: Array, valid: Array, qs: tuple[float, ...]) -> Array:
    """Quantiles of the valid entries of x, linear interpolation (numpy 'linear' method).

    Returns f32 [len(qs)]; NaN-free: all entries read 0 when nothing is valid.
    """
    x = x.reshape(-1).astype(jnp.float32)
    valid = valid.reshape(-1)
    s = jnp.sort(jnp.where(valid, x, jnp.inf))
    n = jnp.sum(valid.astype(jnp.int32))
    pos = jnp.asarray(qs, jnp.float32) * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    frac = pos - lo.astype(jnp.float32)
    s_lo, s_hi = s[lo], s[hi]
    out = s_lo + frac * (s_hi - s_lo)
    return jnp.where(n > 0, out, 0.0)


def normalised_ess(log_w: Array, valid: Array) -> Array:
    """(sum w)^2 / (n sum w^2) over valid entries, computed from log weights; 1 if none valid."""
    lw = jnp.where(valid, log_w.astype(jnp.float32), -jnp.inf)
    n = jnp.sum(valid.astype(jnp.float32))
    safe = jnp.where(n > 0, lw, 0.0)
    log_ess = 2.0 * jax.nn.logsumexp(safe) - jax.nn.logsumexp(2.0 * safe)
    return jnp.where(n > 0, jnp.exp(log_ess - jnp.log(jnp.maximum(n, 1.0))), 1.0)


def routing_agreement(
    routes_train: Array,
    routes_rollout: Array,
    valid: Array,
) -> tuple[Array, Array]:
    """(set agreement, exact entry agreement) of expert routes over valid tokens; 1 if none."""
    member = jnp.any(routes_train[..., :, None] == routes_rollout[..., None, :], axis=-1)
    exact = routes_train == routes_rollout
    w = valid.astype(jnp.float32)[:, :, None, None]
    denom = jnp.sum(w) * routes_train.shape[2] * routes_train.shape[3]
    ok = denom > 0
    safe = jnp.maximum(denom, 1.0)
    return (
        jnp.where(ok, jnp.sum(member * w) / safe, 1.0),
        jnp.where(ok, jnp.sum(exact * w) / safe, 1.0),
    )


def mismatch_metrics(
    logp_train: Array,
    logp_rollout: Array,
    mask: Array,
    *,
    routes_train: Array | None = None,
    routes_rollout: Array | None = None,
    seq_mask: Array | None = None,
) -> dict[str, Array]:
    """Rollout-vs-train mismatch metrics (see the module docstring for definitions).

    Args:
      logp_train: f32 [B, T] trainer's (teacher-forced) logprobs of the sampled tokens.
      logp_rollout: f32 [B, T] sampler's logprobs of the same tokens.
      mask: bool [B, T] action tokens to compare.
      routes_train, routes_rollout: optional int [B, T, L, K] expert ids chosen by the trainer's
        and the sampler's routers; both or neither.
      seq_mask: optional bool [B], sequences to include (e.g. excluding padding rows).

    Returns:
      dict of f32 scalars: mean_abs_dlogp, max_abs_dlogp, kl_k3, ratio_p01, ratio_p10,
      ratio_p50, ratio_p90, ratio_p99, ess, seq_ess, n_tokens, and with routes
      routing_agreement, routing_exact_agreement.

    Raises:
      ValueError: on a shape mismatch, a non-bool mask, or when only one of the route arrays is
        given.
    """
    shape = tuple(logp_train.shape)
    if len(shape) != 2:
        raise ValueError(f"logp_train must be [B, T], got shape {shape}")
    for field, value in (("logp_rollout", logp_rollout), ("mask", mask)):
        if tuple(value.shape) != shape:
            raise ValueError(f"{field} must have shape {shape}, got {tuple(value.shape)}")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if seq_mask is not None and tuple(seq_mask.shape) != shape[:1]:
        raise ValueError(f"seq_mask must have shape {shape[:1]}, got {tuple(seq_mask.shape)}")
    if (routes_train is None) != (routes_rollout is None):
        raise ValueError("routes_train and routes_rollout must be given together")
    if routes_train is not None:
        r_shape = tuple(routes_train.shape)
        if len(r_shape) != 4 or r_shape[:2] != shape:
            raise ValueError(
                f"routes_train must be [B, T, L, K] with B, T = {shape}, got {r_shape}"
            )
        if tuple(routes_rollout.shape) != r_shape:
            raise ValueError(
                f"routes_rollout must have shape {r_shape}, got {tuple(routes_rollout.shape)}"
            )

    valid = mask if seq_mask is None else mask & seq_mask[:, None]
    m = valid.astype(jnp.float32)
    n = jnp.sum(m)
    safe_n = jnp.maximum(n, 1.0)
    d = jnp.where(valid, logp_train.astype(jnp.float32) - logp_rollout.astype(jnp.float32), 0.0)
    d = jnp.clip(d, -_LOG_RATIO_CAP, _LOG_RATIO_CAP)
    rho = jnp.exp(d)
    out = {
        "n_tokens": n,
        "mean_abs_dlogp": jnp.sum(jnp.abs(d) * m) / safe_n,
        "max_abs_dlogp": jnp.max(jnp.abs(d) * m),
        "kl_k3": jnp.sum((rho - 1.0 - d) * m) / safe_n,
    }
    qs = masked_quantiles(rho, valid, tuple(q for _, q in QUANTILES))
    for i, (name, _) in enumerate(QUANTILES):
        out[f"ratio_{name}"] = jnp.where(n > 0, qs[i], 1.0)
    out["ess"] = normalised_ess(d, valid)
    seq_valid = jnp.any(valid, axis=1)
    out["seq_ess"] = normalised_ess(jnp.sum(d * m, axis=1), seq_valid)
    if routes_train is not None:
        agree, exact = routing_agreement(routes_train, routes_rollout, valid)
        out["routing_agreement"] = agree
        out["routing_exact_agreement"] = exact
    return out


SOURCES = ("lag", "numerics", "routing", "kv")


def mismatch_by_source(
    logp_rollout: Array,
    logp_behaviour: Array,
    logp_current: Array,
    mask: Array,
    *,
    logp_routing_alt: Array | None = None,
    logp_kv_alt: Array | None = None,
) -> dict[str, Array]:
    """The rollout/trainer logprob gap split by source (module docstring), on ``mask`` tokens.

    Each source is the mean absolute logprob difference its switch makes (``routing`` and
    ``kv`` read 0 without their alternative pass); ``<source>_share`` is its part of the sum of
    the four (0 when that is 0). ``total`` is mean |logp_current - logp_rollout|: the sources
    are the terms of a chain of differences, so the sum of lag and numerics bounds it.

    Args:
      logp_rollout: f32 [B, T] the sampler's logprobs.
      logp_behaviour: f32 [B, T] teacher-forced under the version that sampled each token, with
        the replay settings of the update.
      logp_current: f32 [B, T] teacher-forced under the current parameters, same settings.
      mask: bool [B, T] action tokens.
      logp_routing_alt: f32 [B, T] current parameters with routing replay switched (MoE).
      logp_kv_alt: f32 [B, T] current parameters with KV-mask replay switched.

    Returns:
      f32 scalars ``lag``, ``numerics``, ``routing``, ``kv``, their ``*_share`` and ``total``.

    Raises:
      ValueError: shapes that differ or a non-bool mask.
    """
    shape = tuple(mask.shape)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    named = {"logp_rollout": logp_rollout, "logp_behaviour": logp_behaviour}
    named |= {"logp_current": logp_current}
    named |= {"logp_routing_alt": logp_routing_alt, "logp_kv_alt": logp_kv_alt}
    for field, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{field} must have shape {shape}, got {tuple(value.shape)}")
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)

    def gap(a, b):
        if a is None or b is None:
            return jnp.float32(0.0)
        d = jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))
        return jnp.sum(jnp.where(mask, d, 0.0)) / n

    out = {
        "lag": gap(logp_current, logp_behaviour),
        "numerics": gap(logp_behaviour, logp_rollout),
        "routing": gap(logp_current, logp_routing_alt),
        "kv": gap(logp_current, logp_kv_alt),
    }
    total = sum(out.values())
    for name in SOURCES:
        out[f"{name}_share"] = jnp.where(total > 0, out[name] / jnp.maximum(total, 1e-30), 0.0)
    out["total"] = gap(logp_current, logp_rollout)
    return out
