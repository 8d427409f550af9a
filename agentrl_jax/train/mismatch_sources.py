"""The teacher-forced passes that split the rollout/trainer mismatch by source
(``rl.mismatch_sources``; definitions in ``rl/mismatch.py: mismatch_by_source``).

Per step, over the batch's action tokens, under the update's replay settings unless a pass
switches one:
  * the current parameters (one pass: the update's own pass is inside its jitted function);
  * each behaviour version other than the current one (asynchronous RL: one pass per version
    present in the batch, at most ``max_staleness``), its tokens picked from it;
  * MoE models with recorded routes: the current parameters with routing replay switched;
  * parity policies with recorded KV marks: the current parameters with KV-mask replay switched.
So the extra cost is 1 + (versions other than the current) + (1 MoE) + (1 KV) forward passes
per step, no backward; ``mismatch_src/extra_passes`` and ``mismatch_src/seconds`` report it.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.chunked import as_chunk_spec, sequence_logprobs
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rl.mismatch import mismatch_by_source
from agentrl_jax.rl.state import RLConfig


def _logprobs(model_cfg, sampling, static, params, tokens, valid, routes, evict_at, int8_at):
    policy, replay_routes, replay_kv = static
    logp, _, _ = sequence_logprobs(
        Transformer(model_cfg, policy),
        params,
        tokens,
        valid=valid,
        replay_routes=routes if replay_routes else None,
        evict_at=evict_at if replay_kv else None,
        int8_at=int8_at if replay_kv else None,
        chunk_spec=as_chunk_spec(sampling),
        with_entropy=False,
    )
    return jnp.pad(logp, ((0, 0), (1, 0)))


class SourcePasses:
    """``passes(batch, version, current, version_params) -> {"mismatch_src/...": float}``.

    Args:
      model_cfg: the model.
      sampling: the sampler's config (chunk geometry of parity policies).
      rl_cfg: the update's replay switches and ``micro_batch`` (rows per pass off parity).
    """

    def __init__(self, model_cfg: ModelConfig, sampling, rl_cfg: RLConfig):
        self.model_cfg, self.rl = model_cfg, rl_cfg
        self._fn = jax.jit(functools.partial(_logprobs, model_cfg, sampling), static_argnums=(0,))

    def _run(self, static, params, arrays) -> jax.Array:
        """f32 [B, T] logprobs; off parity in ``rl.micro_batch`` rows at a time (one compile)."""
        b = arrays[0].shape[0]
        mb = self.rl.micro_batch
        if static[0].parity or not mb or b % mb:
            return self._fn(static, params, *arrays)
        parts = [
            self._fn(static, params, *(None if a is None else a[i : i + mb] for a in arrays))
            for i in range(0, b, mb)
        ]
        return jnp.concatenate(parts)

    def __call__(self, batch: dict, version: int, current, version_params) -> dict[str, float]:
        """The batch's ``mismatch_src/*`` metrics.

        Args:
          batch: the scored batch (``tokens``, ``valid``, ``action_mask``,
            ``rollout_logprobs``, ``policy_versions``, optional ``routes`` / KV marks).
          version: the current parameters' version.
          current: ``(params, policy)`` of the current version.
          version_params: ``v -> (params, policy)`` of an older version in the batch.
        """
        t0 = time.perf_counter()
        params, policy = current
        moe = self.model_cfg.is_moe and batch.get("routes") is not None
        kv = policy.parity and batch.get("kv_evict_at") is not None
        replay_r, replay_kv = self.rl.use_routing_replay and moe, self.rl.use_kv_mask_replay and kv
        arrays = [jnp.asarray(batch["tokens"]), jnp.asarray(batch["valid"])]
        for key in ("routes", "kv_evict_at", "kv_int8_at"):
            value = batch.get(key)
            arrays.append(None if value is None else jnp.asarray(value))
        cur = self._run((policy, replay_r, replay_kv), params, arrays)
        mask = np.asarray(batch["action_mask"]) & np.asarray(batch["valid"])
        versions = np.asarray(batch["policy_versions"])
        behaviour, passes = cur, 1
        for v in sorted(set(np.unique(versions[mask]).tolist()) - {version}):
            v_params, v_policy = version_params(v)
            logp = self._run((v_policy, replay_r, replay_kv), v_params, arrays)
            behaviour = jnp.where(jnp.asarray(versions == v), logp, behaviour)
            passes += 1
        alt_r = alt_kv = None
        if moe:
            alt_r = self._run((policy, not replay_r, replay_kv), params, arrays)
            passes += 1
        if kv:
            alt_kv = self._run((policy, replay_r, not replay_kv), params, arrays)
            passes += 1
        out = mismatch_by_source(
            jnp.asarray(batch["rollout_logprobs"]),
            behaviour,
            cur,
            jnp.asarray(mask),
            logp_routing_alt=alt_r,
            logp_kv_alt=alt_kv,
        )
        metrics = {f"mismatch_src/{k}": float(v) for k, v in jax.device_get(out).items()}
        metrics["mismatch_src/extra_passes"] = float(passes)
        metrics["mismatch_src/seconds"] = time.perf_counter() - t0
        return metrics
