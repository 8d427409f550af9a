"""``agentrl plan``: size a model without allocating it (``jax.eval_shape`` only).

Counts total and active parameters, FLOPs per token for prefill and decode, KV-cache bytes per
token per layer kind and per sequence, and the mesh and per-device memory on N devices. FLOPs
count multiply-adds as 2; attention FLOPs are ``4 * keys * n_heads * head_dim`` per token and
layer (scores + weighted values), with ``keys`` the keys a token actually attends to: ``window``
for S layers, ``sparse_topk_tokens`` (plus the block scorer's ``2 * context/B * K * H``) for F,
the context for D.
"""

from __future__ import annotations

import json
import math
import sys

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax.config import load_config, to_dataclass
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.sharding import MESH_AXES, MeshConfig


def abstract_params(cfg: ModelConfig, policy):
    """Boxed abstract parameters (ShapeDtypeStructs with logical axis names)."""
    model = Transformer(cfg, policy)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(lambda r, t: model.init(r, t), jax.random.key(0), tokens)["params"]


def _leaves_with_axes(boxed):
    out = []
    for leaf in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)):
        if isinstance(leaf, nn.Partitioned):
            out.append((leaf.value, tuple(leaf.names)))
        else:
            out.append((leaf, (None,) * len(leaf.shape)))
    return out


def count_params(cfg: ModelConfig, policy=None) -> dict[str, int]:
    """total, expert (routed) and active-per-token parameter counts."""
    policy = policy or get_policy("fp32")
    total = expert = embed = 0
    for value, names in _leaves_with_axes(abstract_params(cfg, policy)):
        n = math.prod(value.shape)
        total += n
        if "expert" in names:
            expert += n
        if "vocab" in names:
            embed += n
    active = total - expert
    if cfg.is_moe:
        active += expert * cfg.experts_per_token // cfg.n_experts
    return {"total": total, "expert": expert, "embedding": embed, "active": active}


def attention_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Attention FLOPs of one token that sees ``context`` earlier tokens (all layers)."""
    per_key = 4 * cfg.n_heads * cfg.head_dim
    counts = cfg.layer_counts()
    s_keys = min(cfg.window, context)
    f_keys = min(cfg.sparse_topk_tokens, context)
    scorer = 2 * (context / cfg.sparse_block_size) * cfg.n_kv_heads * cfg.head_dim
    return (
        counts["S"] * per_key * s_keys
        + counts["F"] * (per_key * f_keys + scorer)
        + counts["D"] * per_key * context
    )


def kv_bytes(cfg: ModelConfig, dtype_bytes: int, seq_len: int) -> dict[str, float]:
    """KV bytes per token per layer kind and per sequence (ring buffers vs dense cache)."""
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    counts = cfg.layer_counts()
    ring = counts["S"] * per_token_layer * min(cfg.window, seq_len)
    full = (counts["F"] + counts["D"]) * per_token_layer * seq_len
    dense = cfg.n_layers * per_token_layer * seq_len
    return {
        "kv_bytes_per_token_per_layer": {k: per_token_layer for k, c in counts.items() if c},
        "kv_bytes_per_token_all_layers": cfg.n_layers * per_token_layer,
        "kv_bytes_per_seq_ring": ring + full,
        "kv_bytes_per_seq_dense": dense,
    }


def plan_mesh(cfg: ModelConfig, n_devices: int, mesh_cfg: MeshConfig | None = None) -> dict:
    """Mesh sizes for ``n_devices``: the configured ``mesh_cfg`` as given, or without one,
    experts over ``expert`` (largest power-of-two divisor of both) and the rest over ``fsdp``.

    Raises:
      ValueError: ``mesh_cfg`` cannot use exactly ``n_devices`` devices (both named).
    """
    if mesh_cfg is not None:
        try:
            return mesh_cfg.shape(n_devices)
        except ValueError as e:
            sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
            raise ValueError(
                f"the configured mesh {sizes} cannot use {n_devices} devices ({e}); "
                "pick a device count it divides or set mesh.* (-1: all remaining devices)"
            ) from None
    expert = 1
    if cfg.is_moe:
        while (
            expert * 2 <= n_devices
            and n_devices % (expert * 2) == 0
            and cfg.n_experts % (expert * 2) == 0
        ):
            expert *= 2
    return {"data": 1, "fsdp": n_devices // expert, "expert": expert, "tensor": 1}


def per_device_param_bytes(cfg: ModelConfig, policy, mesh: dict, rules) -> int:
    """Parameter bytes per device when logical axes are sharded by ``rules`` over ``mesh``."""
    rule = dict(rules)
    total = 0
    for value, names in _leaves_with_axes(abstract_params(cfg, policy)):
        shards = 1
        used = set()
        for dim, name in zip(value.shape, names):
            axes = rule.get(name)
            axes = (axes,) if isinstance(axes, str) else (axes or ())
            size = math.prod(mesh[a] for a in axes if a not in used)
            if size > 1 and dim % size == 0:
                shards *= size
                used.update(axes)
        total += math.prod(value.shape) * jnp.dtype(value.dtype).itemsize // shards
    return total


def make_plan(cfg: ModelConfig, policy, n_devices: int, mesh_cfg: MeshConfig, context: int) -> dict:
    """The plan as a JSON-ready dict (see module docstring).

    Raises:
      ValueError: ``mesh_cfg`` cannot use ``n_devices`` (checked before any tracing).
    """
    mesh = plan_mesh(cfg, n_devices, mesh_cfg)
    counts = count_params(cfg, policy)
    matmul = 2 * (counts["active"] - counts["embedding"]) + 2 * cfg.d_model * cfg.vocab_size
    kv_dtype_bytes = 1 if policy.kv_cache_dtype == "int8" else jnp.dtype(policy.kv_cache).itemsize
    kv = kv_bytes(cfg, kv_dtype_bytes, 1 << 20)
    param_dev = per_device_param_bytes(cfg, policy, mesh, mesh_cfg.logical_rules())
    return {
        "n_layers": cfg.n_layers,
        "layer_pattern": cfg.layer_pattern,
        "layer_counts": cfg.layer_counts(),
        "total_params": counts["total"],
        "expert_params": counts["expert"],
        "active_params_per_token": counts["active"],
        "context_tokens": context,
        # causal prefill: a token attends to context/2 keys on average
        "prefill_flops_per_token": matmul + attention_flops_per_token(cfg, context // 2),
        "decode_flops_per_token": matmul + attention_flops_per_token(cfg, context),
        "kv_dtype": policy.kv_cache_dtype,
        **{k: v for k, v in kv.items()},
        "kv_bytes_per_seq_1m_ring": kv["kv_bytes_per_seq_ring"],
        "kv_bytes_per_seq_1m_dense": kv["kv_bytes_per_seq_dense"],
        "devices": n_devices,
        "mesh": {a: mesh[a] for a in MESH_AXES},
        "param_bytes_per_device": param_dev,
        # AdamW: fp32 mu and nu, sharded like the params; gradients like the params.
        "opt_state_bytes_per_device": param_dev * 2 * 4 // jnp.dtype(policy.param).itemsize,
        "grad_bytes_per_device": param_dev,
        "train_state_bytes_per_device": param_dev * (2 + 2 * 4 // jnp.dtype(policy.param).itemsize),
    }


def run_from_cli(args) -> int:
    """``agentrl plan SPEC [--devices N] [--set k=v] [--context T]``: prints one JSON line.

    Raises:
      ValueError: a bad config, ``--devices`` < 1, or a configured mesh that cannot use the
        devices.
    """
    cfg = load_config(args.spec, getattr(args, "set", None) or [])
    model_cfg = to_dataclass(cfg.model, ModelConfig)
    mesh_cfg = to_dataclass(cfg.mesh, MeshConfig)
    policy = get_policy(cfg.policy)
    n = getattr(args, "devices", None) or len(jax.devices())
    context = getattr(args, "context", None) or 131072
    if n <= 0:
        raise ValueError(f"--devices={n} must be > 0")
    sys.stdout.write(json.dumps(make_plan(model_cfg, policy, n, mesh_cfg, context)) + "\n")
    return 0
