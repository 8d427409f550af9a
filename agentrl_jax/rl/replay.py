"""Rollout decisions the update replays: MoE routes, KV evictions / int8, sparse blocks.

Shape legend: B sequences, T tokens, L MoE layers, k experts per token, L_F sparse full (F)
layers, K kv heads, n selected blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.model.transformer import Transformer
from agentrl_jax.rl.state import RLConfig


def replay_fields(
    batch: dict, rl_cfg: RLConfig, model: Transformer, shape: tuple[int, int]
) -> dict[str, jax.Array]:
    """The batch's recorded rollout decisions the update needs, checked against ``shape``.

    Returns (each when present or needed): ``routes`` int32 [B,T,L,k] (routing replay) or
    ``rollout_routes`` (mismatch metrics only); ``evict_at`` / ``int8_at`` int32 [B,T] (KV-mask
    replay); ``blocks`` int32 [B,T,L_F,K,n] (block replay, from ``batch['sparse_blocks']``).

    Raises:
      ValueError: a field a replay option needs is missing, or a shape does not fit.
    """
    cfg, data = model.cfg, {}
    if "routes" in batch and cfg.is_moe:
        routes = jnp.asarray(batch["routes"], jnp.int32)
        want = (*shape, cfg.n_layers, cfg.experts_per_token)
        if tuple(routes.shape) != want:
            raise ValueError(f"batch['routes'] must have shape {want}, got {routes.shape}")
        data["routes" if rl_cfg.use_routing_replay else "rollout_routes"] = routes
    elif rl_cfg.use_routing_replay:
        raise ValueError("use_routing_replay=True needs an MoE model and batch['routes']")
    if rl_cfg.use_kv_mask_replay:
        if batch.get("kv_evict_at") is None:
            raise ValueError("use_kv_mask_replay=True needs batch['kv_evict_at']")
        evict = jnp.asarray(batch["kv_evict_at"], jnp.int32)
        if tuple(evict.shape) != shape:
            raise ValueError(f"batch['kv_evict_at'] must have shape {shape}, got {evict.shape}")
        data["evict_at"] = evict
        if batch.get("kv_int8_at") is not None:
            int8 = jnp.asarray(batch["kv_int8_at"], jnp.int32)
            if tuple(int8.shape) != shape:
                raise ValueError(f"batch['kv_int8_at'] must have shape {shape}, got {int8.shape}")
            data["int8_at"] = int8
    if rl_cfg.use_block_replay:
        if batch.get("sparse_blocks") is None:
            raise ValueError("use_block_replay=True needs batch['sparse_blocks']")
        blocks = jnp.asarray(batch["sparse_blocks"], jnp.int32)
        want = (*shape, cfg.layer_counts()["F"], cfg.n_kv_heads)
        if blocks.ndim != 5 or tuple(blocks.shape[:4]) != want:
            raise ValueError(
                f"batch['sparse_blocks'] must have shape {want} + (n,), got {blocks.shape}"
            )
        data["blocks"] = blocks
    return data
