"""ModelConfig: the frozen, validated description of a model.

The layer pattern is a string over ``S`` (gated sliding-window attention), ``F`` (sparse full
attention, block top-k selection shared by a GQA group) and ``D`` (dense full attention). One
pattern group is one scanned step; it repeats ``n_layers / len(layer_pattern)`` times.

Pretrained families (``agentrl_jax.hf``) are configs too: their fields (q/k norm, attention
biases and sinks, ungated sliding windows, RoPE scaling, router/expert biases, routing and
expert-activation variants, unscaled embeddings and plain RMSNorm scales) default to the
project's own architecture, so a config that does not name them computes what it always did.
"""

from __future__ import annotations

import dataclasses
import math

LAYER_KINDS = ("S", "F", "D")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
VALUE_HEADS = ("", "shared", "detached")
ROPE_SCALINGS = ("none", "linear", "yarn")
ROUTINGS = ("softmax_topk", "topk_softmax")
EXPERT_ACTS = ("swiglu", "clamped_swiglu")


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
      sparse_gather: in the cached (chunk) path, F layers keep per-block mean keys and read
        only their selected blocks' keys and values from the pools, instead of gathering the
        whole context and masking it (``model.sparse_blocks``); the teacher-forced pass is
        unchanged.
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
      frozen_groups: the lowest this many pattern groups and the token embedding (with tied
        embeddings, the output projection too) are not trained: teacher-forced passes stop the
        gradient above them (``chunked.sequence_logprobs`` runs them unstacked so the backward
        pass skips them) and the optimisers leave them unchanged (``rl.state.freeze_lower``);
        in ``[0, n_groups)`` (``check_trainable``).
      init_std: stddev of weight init (output projections scaled by 1/sqrt(2*n_layers)).
      value_head: '' (none) | 'shared' | 'detached': a linear critic V(prefix) on the final
        normed hidden state (``extras['values']``, zero-initialised), trained by the RL value
        loss; 'shared' lets that loss's gradient into the trunk, 'detached' stops it there (a
        probe of the policy's features).
      scaled_embeddings: multiply embeddings by sqrt(d_model) (and a tied unembedding by
        1/sqrt(d_model)); False: the plain lookup and ``x @ table.T`` of HF families.
      norm_offset: RMSNorm multiplies by ``1 + scale`` (zero-initialised); False: by ``scale``
        (one-initialised, HF's convention).
      qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE (Qwen3).
      attn_bias: biases on the q/k/v/o projections (gpt-oss).
      attn_sinks: one learned sink logit per query head joins every softmax (its probability
        mass is dropped, gpt-oss); S and D layers only.
      window_gate: ``S`` layers carry the per-head output gate; False: plain sliding window.
      rope_scaling: 'none' | 'linear' (positions / rope_factor) | 'yarn'.
      rope_factor: scaling factor of 'linear' / 'yarn' (>= 1).
      rope_original_max_len: YaRN's pre-training context length.
      yarn_beta_fast, yarn_beta_slow: YaRN's ramp bounds in rotations.
      yarn_truncate: round YaRN's correction range to whole dimensions.
      rope_attention_factor: YaRN's cos/sin scale; 0 derives ``0.1 ln(factor) + 1``.
      router_bias: the MoE router has a bias.
      expert_bias: expert projections have biases.
      routing: 'softmax_topk' (softmax over experts, top-k, gates optionally renormalised) |
        'topk_softmax' (top-k of the logits, softmax over the k selected: gpt-oss).
      route_renorm: with 'softmax_topk', renormalise the k gates to sum to one.
      expert_act: 'swiglu' | 'clamped_swiglu' (gpt-oss: gate clamped above at
        ``swiglu_limit``, up clamped to +-limit, ``(up + 1) * gate * sigmoid(alpha * gate)``).
      swiglu_alpha, swiglu_limit: the clamped SwiGLU's constants.
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
    sparse_gather: bool = False
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
    frozen_groups: int = 0
    init_std: float = 0.02
    value_head: str = ""
    scaled_embeddings: bool = True
    norm_offset: bool = True
    qk_norm: bool = False
    attn_bias: bool = False
    attn_sinks: bool = False
    window_gate: bool = True
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True
    rope_attention_factor: float = 0.0
    router_bias: bool = False
    expert_bias: bool = False
    routing: str = "softmax_topk"
    route_renorm: bool = True
    expert_act: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

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
        if self.frozen_groups < 0:  # the upper bound: ``check_trainable`` (a pretrained
            # model's section is built before its config.json gives the depth)
            raise ValueError(f"ModelConfig.frozen_groups={self.frozen_groups} must be >= 0")
        if self.value_head not in VALUE_HEADS:
            raise ValueError(f"ModelConfig.value_head={self.value_head!r}; allowed: {VALUE_HEADS}")
        for field in ("rope_theta", "norm_eps", "init_std"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} must be > 0")
        self._check_family_fields()

    def _check_family_fields(self):
        """Validates the pretrained-family fields (see the class docstring)."""
        for field in (
            "scaled_embeddings",
            "norm_offset",
            "qk_norm",
            "attn_bias",
            "attn_sinks",
            "window_gate",
            "yarn_truncate",
            "router_bias",
            "expert_bias",
            "route_renorm",
            "sparse_gather",
        ):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r} must be a bool")
        for field, allowed in (
            ("rope_scaling", ROPE_SCALINGS),
            ("routing", ROUTINGS),
            ("expert_act", EXPERT_ACTS),
        ):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"ModelConfig.{field}={value!r}; allowed: {allowed}")
        if self.attn_sinks and "F" in self.layer_pattern:
            raise ValueError(
                f"ModelConfig.attn_sinks=True needs a layer_pattern over S and D only, got "
                f"{self.layer_pattern!r}"
            )
        if not self.rope_factor >= 1.0:
            raise ValueError(f"ModelConfig.rope_factor={self.rope_factor} must be >= 1")
        if self.rope_scaling == "yarn" and self.rope_original_max_len <= 0:
            raise ValueError(
                f"ModelConfig.rope_original_max_len={self.rope_original_max_len} must be > 0 "
                "with rope_scaling='yarn'"
            )
        if not self.yarn_beta_fast > self.yarn_beta_slow > 0:
            raise ValueError(
                f"ModelConfig.yarn_beta_fast={self.yarn_beta_fast} must be > "
                f"yarn_beta_slow={self.yarn_beta_slow} > 0"
            )
        for field in ("rope_attention_factor", "rope_original_max_len"):
            if getattr(self, field) < 0:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} must be >= 0")
        for field in ("swiglu_alpha", "swiglu_limit"):
            if not getattr(self, field) > 0:
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

    def check_trainable(self) -> ModelConfig:
        """``self``, or ValueError when ``frozen_groups`` leaves no group to train."""
        if self.frozen_groups >= self.n_groups:
            raise ValueError(
                f"ModelConfig.frozen_groups={self.frozen_groups} must be < n_groups="
                f"{self.n_groups} (n_layers={self.n_layers} / len(layer_pattern))"
            )
        return self

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
