"""The jitted RL update: ``update_fn(state, batch, rng) -> (state, metrics)``, state donated.

One call = one update step:
  1. (pre-update pass, no gradient) teacher-forced logprobs of the batch with the current
     parameters: the PPO anchor ``logp_old`` when ``old_logprobs='recompute'`` and the source of
     the rollout-vs-train mismatch metrics (``mismatch/*``, incl. MoE routing agreement). With a
     single update per step (1 epoch, 1 minibatch) this pass is fused into the gradient pass,
     whose stop-gradient logprobs are then exactly the pre-update ones (ratio 1);
     with routing replay on, the train routes are the replayed ones (agreement reads 1; measure
     the router's own agreement with replay off). Parity policies get bitwise rollout logprobs
     from the separate pass (micro-batches of the sampler's ``n_slots``); in the fused pass only
     when ``micro_batch`` equals ``n_slots``;
  2. ``ppo_epochs`` x ``n_minibatches`` optimiser updates as two nested ``lax.scan``s; the batch
     is permuted per epoch from ``fold_in(fold_in(rng, step), epoch)``;
  3. each minibatch gradient is accumulated over micro-batches with a ``lax.scan``; micro-batch
     losses are weighted so that the sum equals the minibatch loss exactly (token-mean: share of
     action tokens, seq-mean-*: share of non-empty sequences, seq-mean-token-sum-norm: share of
     sequences); MoE load-balance/z losses are averaged over micro-batches;
  4. clip_by_global_norm + AdamW (``rl.state.rl_optimizer``); an update whose loss, gradient norm or
     update norm is not finite is skipped (params and optimiser state kept via ``jnp.where``).
     A step with any skipped update counts as non-finite (``skipped``, ``nonfinite_steps``).

Batch (numpy or jax arrays, B sequences padded to T; see the trajectory contract):
  tokens int32 [B,T]; valid bool [B,T] (default all); action_mask bool [B,T];
  advantages f32 [B,T] (on action tokens, from ``rl.advantages``); rollout_logprobs f32 [B,T]
  (needed by old_logprobs='rollout', mismatch metrics and corrections); ref_logprobs f32 [B,T]
  (when loss.kl_coef > 0); routes int32 [B,T,L,k] (MoE; required by routing replay);
  kv_evict_at int32 [B,T] (KV-mask replay, parity policies; see ``rollout.trajectory``);
  kv_int8_at int32 [B,T] (optional: int8 KV decisions, replayed with the evictions);
  sparse_blocks int32 [B,T,L_F,K,n] (sparse block selections; required by block replay);
  value_targets, old_values f32 [B,T] (``loss.vf_coef`` > 0, a model with a value head): the
  critic's targets and the values the batch was scored with, on action tokens, V taken before
  each token (``old_values[:, t]`` = the head's output at position t - 1).

Shape legend: B sequences, T tokens, L MoE layers, k experts per token, M minibatches,
U micro-batches per minibatch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from agentrl_jax.model.chunked import as_chunk_spec, sequence_logprobs, with_policy
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import DTypePolicy
from agentrl_jax.rl.logprobs import target_mask
from agentrl_jax.rl.losses import policy_loss, value_loss
from agentrl_jax.rl.mismatch import mismatch_metrics
from agentrl_jax.rl.replay import replay_fields
from agentrl_jax.rl.state import RLConfig, TrainState, rl_optimizer
from agentrl_jax.sharding import StepShardings

log = logging.getLogger(__name__)

UpdateFn = Callable[..., tuple[TrainState, dict[str, jax.Array]]]
# policy_loss metrics combined with max / min instead of a weighted mean over micro-batches
_MAX_METRICS = ("ratio_max",)
_MIN_METRICS = ("ratio_min",)
# metrics that are aggregated losses: combined with the loss weights (sum = minibatch value)
_AGG_METRICS = ("loss", "pg_loss", "kl_ref", "entropy", "value_loss")


def prepare_batch(batch: dict, rl_cfg: RLConfig, model: Transformer) -> dict[str, jax.Array]:
    """Per-sequence arrays the update indexes by row, shifted to the logprob alignment.

    Returns a dict with tokens [B,T], valid [B,T], mask [B,T-1], adv [B,T-1] and, when present
    or needed, logp_rollout [B,T-1], logp_ref [B,T-1], v_target / v_old [B,T-1] (value loss)
    and the replayed rollout decisions (``rl.replay.replay_fields``).

    Raises:
      ValueError: a missing required field or a shape mismatch.
    """
    for field in ("tokens", "action_mask", "advantages"):
        if field not in batch:
            raise ValueError(f"batch is missing {field!r}")
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"batch['tokens'] must be [B, T] with T >= 2, got {tokens.shape}")
    shape = tuple(tokens.shape)
    valid = jnp.asarray(batch.get("valid", jnp.ones(shape, bool)), bool)
    per_token = ("valid", "action_mask", "advantages", "rollout_logprobs", "ref_logprobs")
    for field in (*per_token, "value_targets", "old_values"):
        if field in batch and tuple(jnp.shape(batch[field])) != shape:
            raise ValueError(
                f"batch[{field!r}] must have shape {shape}, got {jnp.shape(batch[field])}"
            )
    data = {
        "tokens": tokens,
        "valid": valid,
        "mask": target_mask(jnp.asarray(batch["action_mask"], bool), valid),
        "adv": jnp.asarray(batch["advantages"], jnp.float32)[:, 1:],
    }
    if "rollout_logprobs" in batch:
        data["logp_rollout"] = jnp.asarray(batch["rollout_logprobs"], jnp.float32)[:, 1:]
    elif rl_cfg.old_logprobs == "rollout":
        raise ValueError("old_logprobs='rollout' needs batch['rollout_logprobs']")
    if rl_cfg.loss.kl_coef > 0:
        if "ref_logprobs" not in batch:
            raise ValueError("loss.kl_coef > 0 needs batch['ref_logprobs']")
        data["logp_ref"] = jnp.asarray(batch["ref_logprobs"], jnp.float32)[:, 1:]
    if rl_cfg.loss.vf_coef > 0:
        for field in ("value_targets", "old_values"):
            if field not in batch:
                raise ValueError(f"loss.vf_coef > 0 needs batch[{field!r}]")
        data["v_target"] = jnp.asarray(batch["value_targets"], jnp.float32)[:, 1:]
        data["v_old"] = jnp.asarray(batch["old_values"], jnp.float32)[:, 1:]
    data.update(replay_fields(batch, rl_cfg, model, shape))
    return data


def _split(tree, n: int):
    return jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), tree)


def _tree_where(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _check_divides(b: int, rl_cfg: RLConfig) -> int:
    if b % rl_cfg.n_minibatches:
        raise ValueError(
            f"RLConfig.n_minibatches={rl_cfg.n_minibatches} must divide the batch size {b}"
        )
    bm = b // rl_cfg.n_minibatches
    if rl_cfg.micro_batch is not None and bm % rl_cfg.micro_batch:
        raise ValueError(
            f"RLConfig.micro_batch={rl_cfg.micro_batch} must divide the minibatch size {bm}"
        )
    return bm


def _micro_weights(mask: jax.Array, agg_mode: str) -> tuple[jax.Array, jax.Array]:
    """(loss weights, token weights) f32 [U] of micro-batches; mask bool [U, b, T-1]."""
    tok = jnp.sum(mask, axis=(1, 2)).astype(jnp.float32)
    tok_w = tok / jnp.maximum(jnp.sum(tok), 1.0)
    if agg_mode == "token-mean":
        return tok_w, tok_w
    if agg_mode == "seq-mean-token-sum-norm":
        u = mask.shape[0]
        return jnp.full((u,), 1.0 / u, jnp.float32), tok_w
    seq = jnp.sum(jnp.any(mask, axis=2), axis=1).astype(jnp.float32)
    return seq / jnp.maximum(jnp.sum(seq), 1.0), tok_w


def _combine(stacked: dict[str, jax.Array], loss_w: jax.Array, tok_w: jax.Array) -> dict:
    out = {}
    for name, v in stacked.items():
        if name in _MAX_METRICS:
            out[name] = jnp.max(v)
        elif name in _MIN_METRICS:
            out[name] = jnp.min(v)
        elif name in _AGG_METRICS:
            out[name] = jnp.sum(v * loss_w)
        elif name.startswith("moe_"):
            out[name] = jnp.mean(v)
        else:
            out[name] = jnp.sum(v * tok_w)
    return out


def _micro_loss(model: Transformer, spec, lcfg, params, x, loss_w, n_micro):
    """One micro-batch's weighted objective and its ``(metrics, aux)`` (``make_grad_fn``)."""
    sg = jax.lax.stop_gradient
    logp, ent, extras = sequence_logprobs(
        model,
        params,
        x["tokens"],
        valid=x["valid"],
        replay_routes=x.get("routes"),
        evict_at=x.get("evict_at"),
        int8_at=x.get("int8_at"),
        replay_blocks=x.get("blocks"),
        chunk_spec=spec,
    )
    loss, metrics = policy_loss(
        logp,
        sg(logp) if x.get("logp_old") is None else x["logp_old"],
        x.get("logp_rollout"),
        x["adv"],
        x["mask"],
        lcfg,
        logp_ref=x.get("logp_ref"),
        entropy=ent if lcfg.entropy_coef > 0 else sg(ent),
    )
    if lcfg.vf_coef > 0:  # values[:, j]: V of the prefix that predicts token j + 1
        v_loss, v_metrics = value_loss(
            extras["values"][:, :-1], x["v_old"], x["v_target"], x["mask"], lcfg
        )
        loss = loss + lcfg.vf_coef * v_loss
        metrics |= v_metrics | {"loss": metrics["loss"] + lcfg.vf_coef * v_metrics["value_loss"]}
    total = loss_w * loss
    if model.cfg.is_moe:
        lb, z = extras["load_balance_loss"], extras["z_loss"]
        total = total + (lcfg.moe_lb_coef * lb + lcfg.moe_z_coef * z) / n_micro
        metrics["moe_lb_loss"] = sg(lb)
        metrics["moe_z_loss"] = sg(z)
        metrics["moe_dropped_fraction"] = sg(extras["dropped_fraction"])
    aux = {"logp": sg(logp)}
    if "routes" in extras:
        aux["routes"] = extras["routes"]
    return total, (metrics, aux)


def make_grad_fn(
    model: Transformer,
    rl_cfg: RLConfig,
    policy: DTypePolicy | None = None,
    sampling_meta: Any = None,
) -> Callable[[Any, dict], tuple[Any, dict[str, jax.Array]]]:
    """``grad_fn(params, minibatch) -> (grads, metrics)`` with micro-batch accumulation.

    ``minibatch`` is a row subset of :func:`prepare_batch`'s output plus ``logp_old`` [b, T-1];
    without ``logp_old`` the anchor is the gradient pass's own logprobs (stop-gradient: ratio 1),
    which is the recomputed anchor whenever these are the pre-update parameters.
    Returns ``(grads, metrics, aux)`` with aux ``logp`` [b, T-1] (no gradient) and, for MoE,
    ``routes`` [b, T, L, k] of the gradient pass.
    The returned gradient is that of the minibatch objective
      policy_loss(minibatch) + vf_coef * value_loss(minibatch)
        + moe_lb_coef * mean_u lb_u + moe_z_coef * mean_u z_u
    (equal to the unsplit gradient up to float rounding when the MoE terms are off or dropless
    routing makes them batch-independent). Not jitted (trace it inside your own jit).

    Raises:
      ValueError: ``loss.vf_coef`` > 0 with a model without a value head.
    """
    model = with_policy(model, policy)
    spec = as_chunk_spec(sampling_meta)
    lcfg = rl_cfg.loss
    if lcfg.vf_coef > 0 and not model.cfg.value_head:
        raise ValueError(
            f"loss.vf_coef={lcfg.vf_coef} needs a model with a value head "
            "(model.value_head='shared' or 'detached')"
        )
    micro_loss = functools.partial(_micro_loss, model, spec, lcfg)

    def grad_fn(params, mb):
        bm = mb["tokens"].shape[0]
        mbs = rl_cfg.micro_batch or bm
        if bm % mbs:
            raise ValueError(f"RLConfig.micro_batch={mbs} must divide the minibatch size {bm}")
        n_micro = bm // mbs
        micro = _split(mb, n_micro)
        loss_w, tok_w = _micro_weights(micro["mask"], lcfg.agg_mode)
        vg = jax.value_and_grad(micro_loss, has_aux=True)

        def body(acc, xs):
            x, w = xs
            (_, (metrics, aux)), g = vg(params, x, w, n_micro)
            return jax.tree.map(jnp.add, acc, g), (metrics, aux)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (stacked, aux) = jax.lax.scan(body, zeros, (micro, loss_w))
        aux = jax.tree.map(lambda a: a.reshape(bm, *a.shape[2:]), aux)
        metrics = _combine(stacked, loss_w, tok_w)
        if model.cfg.is_moe:
            metrics["loss"] = metrics["loss"] + (
                lcfg.moe_lb_coef * metrics["moe_lb_loss"] + lcfg.moe_z_coef * metrics["moe_z_loss"]
            )
        return grads, metrics, aux

    return grad_fn


def _pre_update(model, rl_cfg, spec, params, data):
    """No-gradient pass: (logp [B,T-1], entropy [B,T-1], routes [B,T,L,k] or None)."""
    b = data["tokens"].shape[0]
    # Parity policies need the sampler's batch size for bitwise numbers: one full-batch call.
    mbs = b if model.policy.parity else (rl_cfg.micro_batch or b)

    def run(x):
        logp, ent, extras = sequence_logprobs(
            model,
            params,
            x["tokens"],
            valid=x["valid"],
            replay_routes=x.get("routes"),
            evict_at=x.get("evict_at"),
            int8_at=x.get("int8_at"),
            replay_blocks=x.get("blocks"),
            chunk_spec=spec,
        )
        return logp, ent, extras.get("routes")

    keys = [k for k in ("tokens", "valid", "routes", "evict_at", "int8_at", "blocks") if k in data]
    x = {k: data[k] for k in keys}
    if mbs == b:
        out = run(x)
    else:
        out = jax.lax.map(run, _split(x, b // mbs))
        out = jax.tree.map(lambda a: a.reshape(b, *a.shape[2:]), out)
    return jax.tree.map(jax.lax.stop_gradient, out)


def _as_key(rng):
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    return jax.random.wrap_key_data(rng)


def _optimizer_steps(grad_fn, tx, rl_cfg: RLConfig, rows: dict, carry, key, single: bool):
    """``ppo_epochs`` x ``n_minibatches`` optimiser updates as two nested ``lax.scan``s (the
    batch permuted per epoch from ``fold_in(key, epoch)``); an update whose loss, gradient norm
    or update norm is not finite is skipped. Returns ``((params, opt_state), (per-update
    metrics [E, M], applied [E, M], aux of the single update or None))``."""
    b = rows["tokens"].shape[0]
    bm = b // rl_cfg.n_minibatches

    def minibatch_step(carry, idx):
        params, opt_state = carry
        mb = jax.tree.map(lambda a: a[idx], rows)
        grads, m, aux = grad_fn(params, mb)
        gnorm = optax.global_norm(grads)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        ok = jnp.isfinite(m["loss"]) & jnp.isfinite(gnorm)
        ok = ok & jnp.isfinite(optax.global_norm(updates))
        params = _tree_where(ok, new_params, params)
        opt_state = _tree_where(ok, new_opt, opt_state)
        return (params, opt_state), (m | {"grad_norm": gnorm}, ok, aux if single else None)

    def epoch(carry, e):
        if rl_cfg.n_minibatches == 1:
            order = jnp.arange(b)
        else:
            order = jax.random.permutation(jax.random.fold_in(key, e), b)
        return jax.lax.scan(minibatch_step, carry, order.reshape(rl_cfg.n_minibatches, bm))

    return jax.lax.scan(epoch, carry, jnp.arange(rl_cfg.ppo_epochs))


def _mismatch(data: dict, pre, aux) -> dict[str, jax.Array]:
    """``mismatch/*`` metrics of the trainer's pre-update logprobs (the separate pass ``pre``,
    else the single update's gradient pass) against the rollout's."""
    b = data["tokens"].shape[0]
    if pre is not None:
        logp_train, _, routes_train = pre
    else:  # the single update's gradient pass saw the pre-update parameters
        logp_train = aux["logp"].reshape(b, -1)
        routes_train = aux.get("routes")
        if routes_train is not None:
            routes_train = routes_train.reshape(b, *routes_train.shape[3:])
    rollout_routes = data.get("routes", data.get("rollout_routes"))
    with_routes = routes_train is not None and rollout_routes is not None
    mm = mismatch_metrics(
        logp_train,
        data["logp_rollout"],
        data["mask"],
        routes_train=routes_train[:, :-1] if with_routes else None,
        routes_rollout=rollout_routes[:, :-1] if with_routes else None,
    )
    return {f"mismatch/{k}": v for k, v in mm.items()}


def _applied_metrics(per_update: dict, ok: jax.Array) -> dict[str, jax.Array]:
    """Per-update metrics averaged (max / min for ratio extremes) over the applied updates
    ``ok`` bool [U]; with none applied, the raw (non-finite) values: that is the news."""
    n_ok = jnp.sum(ok.astype(jnp.float32))
    metrics = {}
    for name, v in per_update.items():
        v = v.reshape(-1)
        if name in _MAX_METRICS:
            metrics[name] = jnp.max(jnp.where(ok, v, -jnp.inf))
        elif name in _MIN_METRICS:
            metrics[name] = jnp.min(jnp.where(ok, v, jnp.inf))
        else:
            metrics[name] = jnp.sum(jnp.where(ok, v, 0.0)) / jnp.maximum(n_ok, 1.0)
        metrics[name] = jnp.where(n_ok > 0, metrics[name], jnp.mean(v))
    metrics["grad_norm_max"] = jnp.max(per_update["grad_norm"])
    metrics["skipped_updates"] = jnp.sum((~ok).astype(jnp.int32)).astype(jnp.float32)
    metrics["n_updates"] = jnp.float32(ok.shape[0])
    return metrics


def make_update_fn(
    model: Transformer,
    rl_cfg: RLConfig,
    policy: DTypePolicy | None = None,
    sampling_meta: Any = None,
    shardings: StepShardings | None = None,
) -> UpdateFn:
    """The jitted ``update_fn(state, batch, rng=None) -> (state, metrics)`` (state donated):
    ``jax.jit`` of :func:`make_update`; with ``shardings`` (``sharding.StepShardings``) one
    program over the mesh with explicit in/out shardings (state sharded by the rules, batch
    rows over the batch axes, rng and metrics replicated)."""
    update = make_update(model, rl_cfg, policy, sampling_meta)
    if shardings is None:
        return jax.jit(update, donate_argnums=(0,))
    step = shardings.jit(update, n_rest=1)
    return lambda state, batch, rng=None: step(state, batch, rng)


def make_update(
    model: Transformer,
    rl_cfg: RLConfig,
    policy: DTypePolicy | None = None,
    sampling_meta: Any = None,
) -> UpdateFn:
    """Builds ``update(state, batch, rng=None) -> (state, metrics)``, not jitted.

    ``make_update_fn`` jits it; a vectorised sweep jits ``jax.vmap`` of it over states stacked
    by point, each point's learning rate and weight decay in its optimiser state and its loss's
    traced hyperparameters in ``state.hparams``.

    Args:
      model: the Transformer (its parameters live in ``state.params``).
      rl_cfg: RLConfig.
      policy: dtype policy to train under (default ``model.policy``; the fallback passes
        another preset, same parameters).
      sampling_meta: the sampler's chunk geometry (``ChunkSpec``, dict or object with
        ``chunk``/``page_size``/``max_len``); required by parity policies.

    ``rng`` (typed key or raw key data; default ``state.rng``) is folded with ``state.step``.
    ``state.hparams`` (the ``traced`` fields of the registered loss ``rl_cfg.loss.name``, e.g.
    ``ppo``'s ``clip_low`` / ``clip_high``, as traced values) override the loss config's. Metrics
    (f32 scalars): policy-loss parts averaged over the applied updates (``loss``, ``pg_loss``,
    clip fractions, ``approx_kl``, ratio stats, ``entropy``, MoE losses), ``grad_norm``
    (pre-clip, mean) and ``grad_norm_max``, ``skipped_updates``, ``skipped`` (1 if any update of
    the step was skipped), ``nonfinite_steps``, ``tokens`` (valid), ``action_tokens``,
    ``n_updates`` and ``mismatch/*`` (see ``rl.mismatch``) when rollout logprobs are given.

    Raises:
      ValueError: unsupported options (KV-mask replay without a parity policy, routing replay
        without MoE, block replay without F layers, parity policy without ``sampling_meta``);
        at trace time, batch fields or sizes that do not fit.
    """
    model = with_policy(model, policy)
    spec = as_chunk_spec(sampling_meta)
    if rl_cfg.use_kv_mask_replay and not model.policy.parity:
        raise ValueError(
            "RLConfig.use_kv_mask_replay=True needs a parity policy (the chunked path replays "
            f"evictions), got {model.policy.name!r}"
        )
    if rl_cfg.use_routing_replay and not model.cfg.is_moe:
        raise ValueError("RLConfig.use_routing_replay=True needs an MoE model (n_experts > 0)")
    if rl_cfg.use_block_replay and "F" not in model.cfg.layer_pattern:
        raise ValueError("RLConfig.use_block_replay=True needs sparse full attention (F layers)")
    if model.policy.parity and spec is None:
        raise ValueError(f"policy {model.policy.name!r} needs sampling_meta (chunk geometry)")
    tx = rl_optimizer(rl_cfg, model.cfg.frozen_groups)
    config_grad_fn = make_grad_fn(model, rl_cfg, None, spec)

    def update(state: TrainState, batch: dict, rng=None):
        grad_fn = config_grad_fn
        if state.hparams:  # traced loss hyperparameters (a vectorised sweep)
            traced = rl_cfg.replace(loss=rl_cfg.loss.with_traced(**state.hparams))
            grad_fn = make_grad_fn(model, traced, None, spec)
        data = prepare_batch(batch, rl_cfg, model)
        _check_divides(data["tokens"].shape[0], rl_cfg)
        key = jax.random.fold_in(_as_key(state.rng if rng is None else rng), state.step)
        # One update per step: the gradient pass runs on the pre-update parameters, so its own
        # (stop-gradient) logprobs are the recomputed anchor and the mismatch source: no extra
        # forward pass.
        single = rl_cfg.ppo_epochs == 1 and rl_cfg.n_minibatches == 1
        fused = single and rl_cfg.old_logprobs == "recompute"
        mismatch = rl_cfg.log_mismatch and "logp_rollout" in data
        need_pre = not fused and (rl_cfg.old_logprobs == "recompute" or mismatch)
        pre = _pre_update(model, rl_cfg, spec, state.params, data) if need_pre else None
        if rl_cfg.old_logprobs == "rollout":
            data["logp_old"] = data["logp_rollout"]
        elif not fused:
            data["logp_old"] = pre[0]
        rows = {k: v for k, v in data.items() if k != "rollout_routes"}
        (params, opt_state), (per_update, ok, aux) = _optimizer_steps(
            grad_fn, tx, rl_cfg, rows, (state.params, state.opt_state), key, single
        )
        metrics = _mismatch(data, pre, aux) if mismatch else {}
        metrics |= _applied_metrics(per_update, ok.reshape(-1))
        skipped = metrics["skipped_updates"] > 0
        nonfinite = state.nonfinite_count + skipped.astype(jnp.int32)
        consecutive = jnp.where(skipped, state.consecutive_nonfinite + 1, 0).astype(jnp.int32)
        metrics |= {
            "skipped": skipped.astype(jnp.float32),
            "nonfinite_steps": nonfinite.astype(jnp.float32),
            "tokens": jnp.sum(data["valid"]).astype(jnp.float32),
            "action_tokens": jnp.sum(data["mask"]).astype(jnp.float32),
        }
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            rng=state.rng,
            nonfinite_count=nonfinite,
            consecutive_nonfinite=consecutive,
            hparams=state.hparams,
        )
        return new_state, metrics

    return update
