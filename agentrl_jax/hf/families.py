"""Hugging Face model families: ``config.json`` <-> ``ModelConfig`` and parameter-name maps.

Families: Llama (``LlamaForCausalLM``: SmolLM2, Llama 2/3 without llama3 RoPE scaling), Qwen3
(``Qwen3ForCausalLM``), Qwen3-MoE (``Qwen3MoeForCausalLM``) and gpt-oss (``GptOssForCausalLM``).
Each is a :class:`ModelConfig` of the project's model with the family's options
(``model.config``): unscaled embeddings, plain RMSNorm scales (all), q/k norms (Qwen3; Llama is
Qwen3 without them), attention biases, sinks, ungated sliding windows, YaRN RoPE, router and
expert biases, top-k softmax routing and the clamped SwiGLU (gpt-oss).

Parameter map: our parameters are a scanned stack (``groups/layer_i/...`` with a leading axis
of ``n_groups``); HF layer ``l`` is our group ``l // len(pattern)``, pattern position
``l % len(pattern)``. A :class:`TensorMap` says how one of our parameters is read from HF
tensors (``kind``):
  * ``same``: the HF tensor as is (norms, sinks, the embedding, gpt-oss expert tensors);
  * ``flat``: the HF tensor reshaped (attention biases ``[N*H]`` -> ``[N, H]``);
  * ``linear``: an ``nn.Linear`` weight ``[out, in]`` transposed and reshaped to ours, whose first
    ``n_in`` axes hold ``in`` (``q_proj [N*H, D]`` -> ``wq [D, N, H]``; ``o_proj [D, N*H]`` ->
    ``wo [N, H, D]`` with ``n_in=2``);
  * ``experts``: one ``linear`` HF tensor per expert (``{e}`` in the name), stacked (Qwen3-MoE);
  * ``even`` / ``odd``: every other entry of the HF tensor's last axis (gpt-oss stores gate and
    up interleaved in ``gate_up_proj [E, D, 2F]``);
  * gpt-oss MXFP4 checkpoints store ``gate_up_proj`` / ``down_proj`` as ``*_blocks`` and
    ``*_scales`` (``hf.checkpoint`` dequantises them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agentrl_jax.model.config import ModelConfig

LAYER_TYPES = {"full_attention": "D", "sliding_attention": "S"}


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one of our parameters is read from (and written to) HF tensors.

    Attributes:
      path: the parameter's path under ``params`` (e.g. ``("groups", "layer_0", "attn", "wq")``).
      hf: HF tensor name; ``{l}`` is the HF layer, ``{e}`` the expert (kind ``experts``).
      kind: 'same' | 'flat' | 'linear' | 'experts' | 'even' | 'odd' (module docstring).
      n_in: for 'linear' / 'experts', how many leading axes of ours hold the input dim.
      pos: pattern position for a scanned parameter (leading ``n_groups`` axis); -1 otherwise.
      mxfp4: for gpt-oss expert weights, the HF base name of ``*_blocks`` / ``*_scales``.
    """

    path: tuple[str, ...]
    hf: str
    kind: str = "same"
    n_in: int = 1
    pos: int = -1
    mxfp4: str = ""

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.hf.format(l=layer, e=expert)


def _get(hf: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return hf[key] if hf.get(key) is not None else default


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE fields from either ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (older files)."""
    params = dict(_get(hf, "rope_parameters", {}) or {})
    scaling = dict(_get(hf, "rope_scaling", {}) or {})
    theta = params.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    rope = {**scaling, **params}
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ("linear", "yarn"):
        raise ValueError(f"config.json rope type {kind!r} is not supported; allowed: linear, yarn")
    out.update(rope_scaling=kind, rope_factor=float(rope["factor"]))
    if kind == "yarn":
        if rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ValueError("config.json YaRN mscale / mscale_all_dim are not supported")
        out.update(
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
            yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
            yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
            yarn_truncate=bool(rope.get("truncate", True)),
            rope_attention_factor=float(rope.get("attention_factor") or 0.0),
        )
    return out


def _pattern(hf: Mapping[str, Any], n_layers: int) -> str:
    """Shortest repeating layer pattern of ``layer_types`` (all 'D' without it)."""
    types = _get(hf, "layer_types")
    if types is None:
        if _get(hf, "use_sliding_window", False):
            raise ValueError("config.json use_sliding_window without layer_types is not supported")
        return "D"
    if len(types) != n_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(
            f"config.json layer_types={types!r} must list {n_layers} of {sorted(LAYER_TYPES)}"
        )
    letters = "".join(LAYER_TYPES[t] for t in types)
    for p in range(1, n_layers + 1):
        if n_layers % p == 0 and letters == letters[:p] * (n_layers // p):
            return letters[:p]
    raise AssertionError("unreachable: p = n_layers always repeats")


def _common(hf: Mapping[str, Any]) -> dict[str, Any]:
    n_layers = int(hf["num_hidden_layers"])
    n_heads = int(hf["num_attention_heads"])
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}; allowed: 'silu'")
    pattern = _pattern(hf, n_layers)
    window = _get(hf, "sliding_window")
    return dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(_get(hf, "num_key_value_heads", n_heads)),
        head_dim=int(_get(hf, "head_dim", int(hf["hidden_size"]) // n_heads)),
        layer_pattern=pattern,
        window=int(window) if "S" in pattern and window else 64,
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        attn_bias=bool(_get(hf, "attention_bias", False)),
        init_std=float(_get(hf, "initializer_range", 0.02)),
        scaled_embeddings=False,
        norm_offset=False,
        window_gate=False,
        **_rope_fields(hf),
    )


def llama_config(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a Llama ``config.json`` (dense, full attention, no q/k norm)."""
    if _get(hf, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=True is not supported for llama")
    return ModelConfig(**_common(hf), d_ff=int(hf["intermediate_size"]))


def qwen3_config(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a Qwen3 (dense) ``config.json``."""
    return ModelConfig(**_common(hf), d_ff=int(hf["intermediate_size"]), qk_norm=True)


def qwen3_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a Qwen3-MoE ``config.json`` (every layer an MoE layer)."""
    if _get(hf, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=True is not supported for qwen3_moe")
    if _get(hf, "mlp_only_layers", []) or int(_get(hf, "decoder_sparse_step", 1)) != 1:
        raise ValueError(
            "config.json mlp_only_layers / decoder_sparse_step != 1 (dense layers among MoE "
            "layers) is not supported"
        )
    n_experts = _get(hf, "num_experts", _get(hf, "num_local_experts"))
    return ModelConfig(
        **_common(hf),
        d_ff=int(_get(hf, "intermediate_size", hf["moe_intermediate_size"])),
        qk_norm=True,
        n_experts=int(n_experts),
        experts_per_token=int(hf["num_experts_per_tok"]),
        d_expert=int(hf["moe_intermediate_size"]),
        route_renorm=bool(_get(hf, "norm_topk_prob", False)),
        router_aux_weight=float(_get(hf, "router_aux_loss_coef", 1e-3)),
    )


def gpt_oss_config(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a gpt-oss ``config.json``."""
    d_expert = int(hf["intermediate_size"])
    return ModelConfig(
        **_common(hf),
        d_ff=d_expert,
        attn_sinks=True,
        n_experts=int(hf["num_local_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        d_expert=d_expert,
        router_bias=True,
        expert_bias=True,
        routing="topk_softmax",
        expert_act="clamped_swiglu",
        swiglu_alpha=float(_get(hf, "swiglu_alpha", 1.702)),
        swiglu_limit=float(_get(hf, "swiglu_limit", 7.0)),
        router_aux_weight=float(_get(hf, "router_aux_loss_coef", 1e-3)),
    )


def _rope_json(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"rope_type": cfg.rope_scaling, "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "yarn":
        out.update(
            original_max_position_embeddings=cfg.rope_original_max_len,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            truncate=cfg.yarn_truncate,
        )
        if cfg.rope_attention_factor:
            out["attention_factor"] = cfg.rope_attention_factor
    return out


def hf_config_json(family: str, cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields that describe ``cfg`` as ``family`` (inverse of the parsers)."""
    types = {"D": "full_attention", "S": "sliding_attention"}
    out: dict[str, Any] = {
        "architectures": [FAMILIES[family].architecture],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attn_bias,
        "initializer_range": cfg.init_std,
        "rope_parameters": _rope_json(cfg),
        "layer_types": [types[k] for k in cfg.layer_pattern * cfg.n_groups],
        "sliding_window": cfg.window if "S" in cfg.layer_pattern else None,
    }
    if family == "llama":
        if set(cfg.layer_pattern) != {"D"}:
            raise ValueError(
                f"layer_pattern={cfg.layer_pattern!r}: the llama family has dense full attention "
                "layers ('D') only"
            )
        out.update(intermediate_size=cfg.d_ff, mlp_bias=False)
        del out["layer_types"], out["sliding_window"]
    elif family == "qwen3":
        out.update(intermediate_size=cfg.d_ff, use_sliding_window="S" in cfg.layer_pattern)
    elif family == "qwen3_moe":
        out.update(
            intermediate_size=cfg.d_ff,
            moe_intermediate_size=cfg.d_expert,
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token,
            norm_topk_prob=cfg.route_renorm,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=cfg.router_aux_weight,
        )
        del out["layer_types"], out["sliding_window"]  # the family has full attention only
    else:
        out.update(
            intermediate_size=cfg.d_expert,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.experts_per_token,
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
            router_aux_loss_coef=cfg.router_aux_weight,
        )
    return out


def _attention_maps(cfg: ModelConfig, i: int, family: str) -> list[TensorMap]:
    pre = ("groups", f"layer_{i}")
    a = "model.layers.{l}.self_attn."
    maps = [
        TensorMap((*pre, "attn_norm", "scale"), "model.layers.{l}.input_layernorm.weight", pos=i),
        TensorMap(
            (*pre, "ffn_norm", "scale"), "model.layers.{l}.post_attention_layernorm.weight", pos=i
        ),
        TensorMap((*pre, "attn", "wq"), a + "q_proj.weight", "linear", pos=i),
        TensorMap((*pre, "attn", "wk"), a + "k_proj.weight", "linear", pos=i),
        TensorMap((*pre, "attn", "wv"), a + "v_proj.weight", "linear", pos=i),
        TensorMap((*pre, "attn", "wo"), a + "o_proj.weight", "linear", n_in=2, pos=i),
    ]
    if cfg.attn_bias:
        maps += [
            TensorMap((*pre, "attn", f"b{x}"), a + f"{x}_proj.bias", "flat", pos=i) for x in "qkvo"
        ]
    if cfg.qk_norm:
        maps += [
            TensorMap((*pre, "attn", f"{x}_norm", "scale"), a + f"{x}_norm.weight", pos=i)
            for x in "qk"
        ]
    if cfg.attn_sinks:
        maps.append(TensorMap((*pre, "attn", "sinks"), a + "sinks", pos=i))
    return maps


def _ffn_maps(cfg: ModelConfig, i: int, family: str) -> list[TensorMap]:
    pre = ("groups", f"layer_{i}")
    m = "model.layers.{l}.mlp."
    if not cfg.is_moe:
        return [
            TensorMap((*pre, "mlp", f"w_{x}"), m + f"{x}_proj.weight", "linear", pos=i)
            for x in ("gate", "up", "down")
        ]
    if family == "qwen3_moe":
        return [
            TensorMap((*pre, "moe", "router"), m + "gate.weight", "linear", pos=i),
            *(
                TensorMap(
                    (*pre, "moe", f"w_{x}"),
                    m + "experts.{e}." + f"{x}_proj.weight",
                    "experts",
                    pos=i,
                )  # fmt: skip
                for x in ("gate", "up", "down")
            ),
        ]
    e = m + "experts."
    gate_up, down = e + "gate_up_proj", e + "down_proj"
    return [
        TensorMap((*pre, "moe", "router"), m + "router.weight", "linear", pos=i),
        TensorMap((*pre, "moe", "router_bias"), m + "router.bias", pos=i),
        TensorMap((*pre, "moe", "w_gate"), gate_up, "even", pos=i, mxfp4=gate_up),
        TensorMap((*pre, "moe", "w_up"), gate_up, "odd", pos=i, mxfp4=gate_up),
        TensorMap((*pre, "moe", "w_down"), down, pos=i, mxfp4=down),
        TensorMap((*pre, "moe", "b_gate"), gate_up + "_bias", "even", pos=i),
        TensorMap((*pre, "moe", "b_up"), gate_up + "_bias", "odd", pos=i),
        TensorMap((*pre, "moe", "b_down"), down + "_bias", pos=i),
    ]


def tensor_maps(family: str, cfg: ModelConfig) -> list[TensorMap]:
    """Every parameter of ``cfg``'s model with its HF source (see module docstring)."""
    maps = [
        TensorMap(("embed", "table"), "model.embed_tokens.weight"),
        TensorMap(("final_norm", "scale"), "model.norm.weight"),
    ]
    if not cfg.tie_embeddings:
        maps.append(TensorMap(("embed", "unembed"), "lm_head.weight", "linear"))
    for i in range(len(cfg.layer_pattern)):
        maps += _attention_maps(cfg, i, family) + _ffn_maps(cfg, i, family)
    return maps


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF family: its architecture name and ``config.json`` parser."""

    name: str
    architecture: str
    parse: Any

    def model_config(self, hf: Mapping[str, Any]) -> ModelConfig:
        """ModelConfig of this family's ``config.json`` dict. Raises ValueError on what the
        model cannot express (naming the field)."""
        try:
            return self.parse(hf)
        except KeyError as e:
            raise ValueError(f"config.json of {self.name} lacks the field {e.args[0]!r}") from e


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", llama_config),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qwen3_config),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_config),
    "gpt_oss": Family("gpt_oss", "GptOssForCausalLM", gpt_oss_config),
}


def family_of(hf: Mapping[str, Any]) -> Family:
    """The family of a ``config.json`` dict (by ``model_type``, else ``architectures``).

    Raises:
      ValueError: unknown architecture (naming it and the known ones).
    """
    model_type = hf.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    archs = hf.get("architectures") or []
    for fam in FAMILIES.values():
        if fam.architecture in archs:
            return fam
    known = sorted(f.architecture for f in FAMILIES.values())
    raise ValueError(
        f"unknown architecture: model_type={model_type!r}, architectures={archs!r}; "
        f"supported: {known}"
    )
