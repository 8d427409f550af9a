"""ModelConfig: the frozen, validated description of a model.

The layer pattern is a string over ``S`` (gated sliding-window attention), ``F`` (sparse full
attention, block top-k selection shared by a GQA group) and ``D`` (dense full attention). One
pattern group is one scanned step; it repeats ``n_layers / len(layer_pattern)`` times.
"""

from __future__ import annotations

import dataclasses
import math

LAYER_KINDS = ("S", "F", "D")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
VALUE_HEADS = ("", "shared", "detached")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters. Every bad value raises ``ValueError`` naming the field.

    Attributes:
      vocab_size: vocabulary size.
      d_model: residual width.
      n_layers: total number of layers (a multiple of ``len(layer_pattern)``).
      n_heads: query heads.
      n_kv_heads: key/value heads (``n_heads`` must be a multiple).
      head_dim: per-head dimension.
      layer_pattern: e.g. ``"SSSF"``; repeated over depth.
      window: sliding-window size (keys t-window+1..t, current key included).
      sparse_block_size: key block size B of sparse full attention.
      sparse_topk_tokens: tokens kept per query (``sparse_topk_tokens / sparse_block_size``
        blocks, own block included).
      d_ff: hidden size of the dense FFN (used when ``n_experts == 0``).
      n_experts: routed experts per MoE layer (0 = dense FFN everywhere).
      experts_per_token: top-k experts per token.
      n_shared_experts: always-on shared experts (each ``d_expert`` wide).
      d_expert: hidden size of one expert.
      capacity_factor: expert capacity = ceil(factor * tokens * k / E); 0 means dropless.
      router_aux_weight: weight of the load-balance loss in ``aux_loss``.
      router_z_weight: weight of the router z-loss in ``aux_loss``.
      rope_theta: RoPE base.
      tie_embeddings: share input embedding and output projection.
      norm_eps: RMSNorm epsilon.
      remat: 'none' | 'full' | 'dots' | 'dots_no_batch' rematerialisation of a pattern group.
      init_std: stddev of weight init (output projections scaled by 1/sqrt(2*n_layers)).
      value_head: '' (none) | 'shared' | 'detached': a linear critic V(prefix) on the final
        normed hidden state (``extras['values']``, zero-initialised), trained by the RL value
        loss; 'shared' lets that loss's gradient into the trunk, 'detached' stops it there (a
        probe of the policy's features).
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    layer_pattern: str = "SSSF"
    window: int = 64
    sparse_block_size: int = 8
    sparse_topk_tokens: int = 64
    d_ff: int = 384
    n_experts: int = 0
    experts_per_token: int = 2
    n_shared_experts: int = 0
    d_expert: int = 128
    capacity_factor: float = 0.0
    router_aux_weight: float = 1e-2
    router_z_weight: float = 1e-3
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    remat: str = "none"
    init_std: float = 0.02
    value_head: str = ""

    def __post_init__(self):
        def positive(field):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field}={value!r} must be a positive int")

        for field in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "window",
            "sparse_block_size",
            "sparse_topk_tokens",
            "d_ff",
            "d_expert",
            "experts_per_token",
        ):
            positive(field)
        for field in ("n_experts", "n_shared_experts"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"ModelConfig.{field}={value!r} must be an int >= 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if not self.layer_pattern or set(self.layer_pattern) - set(LAYER_KINDS):
            raise ValueError(
                f"ModelConfig.layer_pattern={self.layer_pattern!r} must be a non-empty string "
                f"over {LAYER_KINDS}"
            )
        if self.n_layers % len(self.layer_pattern):
            raise ValueError(
                f"ModelConfig.n_layers={self.n_layers} must be a multiple of "
                f"len(layer_pattern)={len(self.layer_pattern)}"
            )
        if self.sparse_topk_tokens % self.sparse_block_size:
            raise ValueError(
                f"ModelConfig.sparse_topk_tokens={self.sparse_topk_tokens} must be a multiple of "
                f"sparse_block_size={self.sparse_block_size}"
            )
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise ValueError(
                f"ModelConfig.experts_per_token={self.experts_per_token} must be <= "
                f"n_experts={self.n_experts}"
            )
        if self.capacity_factor < 0:
            raise ValueError(f"ModelConfig.capacity_factor={self.capacity_factor} must be >= 0")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; allowed: {REMAT_POLICIES}")
        if self.value_head not in VALUE_HEADS:
            raise ValueError(f"ModelConfig.value_head={self.value_head!r}; allowed: {VALUE_HEADS}")
        for field in ("rope_theta", "norm_eps", "init_std"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} must be > 0")

    # Derived --------------------------------------------------------------------------------
    @property
    def n_groups(self) -> int:
        """Number of scanned repetitions of the layer pattern."""
        return self.n_layers // len(self.layer_pattern)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def sparse_topk_blocks(self) -> int:
        return self.sparse_topk_tokens // self.sparse_block_size

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_counts(self) -> dict[str, int]:
        """Number of layers of each kind over the whole depth."""
        return {k: self.layer_pattern.count(k) * self.n_groups for k in LAYER_KINDS}

    def capacity(self, n_tokens: int) -> int:
        """Expert capacity for ``n_tokens`` tokens (dropless: every token could hit one expert)."""
        if self.capacity_factor == 0:
            return n_tokens
        return max(
            1, math.ceil(self.capacity_factor * n_tokens * self.experts_per_token / self.n_experts)
        )

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
