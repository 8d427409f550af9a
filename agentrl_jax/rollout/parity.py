"""The trainer's logprobs of a trajectory, computed the way the sampler computed them.

``trainer_logprobs`` is what training uses to recompute logprobs of rollout tokens:
  * ``policy.parity`` (``fp32-parity``, ``bf16-parity``): ``model.chunked.chunked_logits`` with
    the sampler's chunk, page size and cache capacity, over micro-batches of the sampler's slot
    count; the result equals the rollout's logprobs bitwise (tested), MoE included;
  * otherwise the plain teacher-forced pass (fast; its mismatch is measured, not zero).
With ``replay_kv`` the recorded KV eviction (``Trajectory.kv_evict_at``) and int8 decisions
(``Trajectory.kv_int8_at``) are applied chunk by chunk, so a compressed rollout stays on-policy;
without it training sees the full-precision, full context. With ``replay_blocks`` every sparse
full-attention layer attends to the blocks the rollout selected (``Trajectory.sparse_blocks``),
in either path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.chunked import NEVER, as_chunk_spec, sequence_logprobs
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import DTypePolicy
from agentrl_jax.rollout.sampler import RolloutConfig
from agentrl_jax.rollout.trajectory import Trajectory


def rollout_aligned_logprobs(
    model: Transformer,
    params,
    tokens: jax.Array,
    sampling_cfg: RolloutConfig | None = None,
    *,
    evict_at: jax.Array | None = None,
    int8_at: jax.Array | None = None,
    replay_routes: jax.Array | None = None,
    replay_blocks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Jittable, differentiable logprobs of ``tokens`` as training computes them, aligned with
    the tokens as ``Trajectory.rollout_logprobs`` is.

    ``model.chunked.sequence_logprobs`` (under ``model.policy.parity`` the sampler's chunked
    pass with ``sampling_cfg``'s chunk, page size and max_len, and the optional recorded
    ``evict_at`` / ``int8_at`` int32 [B, T]; else the plain teacher pass), shifted by one
    position: entry t is the logprob of token t itself.

    Args:
      model: the Transformer (its policy decides the path).
      params: model parameters.
      tokens: int32 [B, T] (T a multiple of the chunk and <= max_len for parity).
      sampling_cfg: the sampler's config; required by parity policies.
      evict_at: optional int32 [B, T] recorded KV evictions (parity only).
      int8_at: optional int32 [B, T] recorded int8 KV decisions (parity only).
      replay_routes: optional int32 [B, T, L_moe, k] routing replay.
      replay_blocks: optional int32 [B, T, L_F, K, n] sparse block replay.

    Returns:
      (logp f32 [B, T], logp[:, 0] = 0, routes int32 [B, T, L_moe, k] or None).

    Raises:
      ValueError: a parity policy without ``sampling_cfg``, or ``evict_at`` / ``int8_at``
        without one.
    """
    spec = as_chunk_spec(sampling_cfg)  # the sampler's chunk geometry and temperature
    if model.policy.parity:
        if sampling_cfg is None:
            raise ValueError("a parity policy needs the sampler's sampling_cfg")
    elif evict_at is not None or int8_at is not None:
        raise ValueError("evict_at / int8_at (KV replay) needs a parity policy")
    lp, _, extras = sequence_logprobs(
        model,
        params,
        tokens,
        evict_at=evict_at,
        int8_at=int8_at,
        replay_routes=replay_routes,
        replay_blocks=replay_blocks,
        chunk_spec=spec,
        with_entropy=False,
    )
    return jnp.pad(lp, ((0, 0), (1, 0))), extras.get("routes")


@functools.cache
def _logprob_fn(model_cfg, policy: DTypePolicy, sampling_cfg: RolloutConfig | None, replay):
    model = Transformer(model_cfg, policy)

    @jax.jit
    def fn(params, tokens, evict_at, int8_at, blocks):
        return rollout_aligned_logprobs(
            model,
            params,
            tokens,
            sampling_cfg,
            evict_at=evict_at if replay else None,
            int8_at=int8_at if replay == "int8" else None,
            replay_blocks=blocks,
        )

    return fn


def trainer_logprobs(
    model: Transformer,
    params,
    traj: Trajectory,
    policy: DTypePolicy | None = None,
    sampling_cfg: RolloutConfig | None = None,
    *,
    n_slots: int | None = None,
    replay_kv: bool = False,
    replay_blocks: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Teacher-forced logprobs of ``traj.tokens`` in the rollout's layout.

    Args:
      model, params: the policy (``policy`` overrides ``model.policy`` if given).
      traj: the trajectory (tokens int32 [B, T]).
      policy: dtype policy; ``policy.parity`` selects the chunked parity path.
      sampling_cfg: the sampler's config (chunk, page size, max_len); required for parity.
      n_slots: the sampler's batch size (default B); parity runs micro-batches of this size.
      replay_kv: apply the recorded ``kv_evict_at`` and, when the trajectory has int8 decisions,
        ``kv_int8_at`` (parity path only).
      replay_blocks: attend to the recorded ``sparse_blocks`` (either path).

    Returns:
      (logp float32 [B, T] with logp[:, t] = log p(tokens[:, t] | tokens[:, :t]) and 0 at
      t = 0, routes int32 [B, T, L_moe, k] of this pass or None).

    Raises:
      ValueError: parity without ``sampling_cfg``, T not a multiple of the chunk or above
        ``max_len``, ``replay_kv`` without recorded masks or without parity, or
        ``replay_blocks`` without recorded blocks.
    """
    policy = policy or model.policy
    tokens = np.asarray(traj.tokens, np.int32)
    b, t = tokens.shape
    if policy.parity:
        if sampling_cfg is None:
            raise ValueError("a parity policy needs the sampler's sampling_cfg")
        c, m = sampling_cfg.chunk, sampling_cfg.max_len
        if t % c or t > m:
            raise ValueError(f"traj length {t} must be a multiple of chunk={c} and <= {m}")
    if replay_kv and (traj.kv_evict_at is None or not policy.parity):
        raise ValueError("replay_kv needs traj.kv_evict_at and a parity policy")
    if replay_blocks and traj.sparse_blocks is None:
        raise ValueError("replay_blocks needs traj.sparse_blocks (RolloutConfig.record_blocks)")
    never = np.full((b, t), NEVER, np.int32)
    evict = np.asarray(traj.kv_evict_at, np.int32) if replay_kv else never
    int8 = never
    if replay_kv and traj.kv_int8_at is not None and (np.asarray(traj.kv_int8_at) != NEVER).any():
        int8 = np.asarray(traj.kv_int8_at, np.int32)
    replay = "int8" if int8 is not never else bool(replay_kv)
    fn = _logprob_fn(model.cfg, policy, sampling_cfg, replay)
    mb = b if (n_slots is None or not policy.parity) else n_slots
    blocks = np.asarray(traj.sparse_blocks, np.int32) if replay_blocks else None
    outs, routes = [], []
    for lo in range(0, b, mb):
        rows = [a[lo : lo + mb] for a in (tokens, evict, int8)]
        rows.append(None if blocks is None else blocks[lo : lo + mb])
        n = rows[0].shape[0]
        if n < mb:  # pad the last micro-batch with copies of row 0 (same shapes, discarded)
            rows = [
                None if a is None else np.concatenate([a, np.repeat(a[:1], mb - n, 0)])
                for a in rows
            ]
        lp, rt = fn(params, *rows)
        outs.append(np.asarray(lp)[:n])
        if rt is not None:
            routes.append(np.asarray(rt)[:n])
    return np.concatenate(outs), (np.concatenate(routes) if routes else None)
