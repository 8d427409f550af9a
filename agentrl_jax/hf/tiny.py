"""Tiny random models of each HF family, built and saved by ``transformers`` itself.

Tests, ``benchmarks/hf_parity.py`` and smoke experiments start from these: a few layers, GQA,
several experts for the MoE families, sliding and full layers with sinks for gpt-oss. Every norm
weight, bias and sink is perturbed away from its initial ones/zeros so that a wrong mapping of
any tensor shows in the logits. Needs ``torch`` and ``transformers`` (the ``dev`` extras);
they are imported only when a model is built.
"""

from __future__ import annotations

from typing import Any

FAMILY_NAMES = ("qwen3", "qwen3_moe", "gpt_oss")


def tiny_hf_config(family: str, *, vocab_size: int = 256, **overrides: Any):
    """A ``transformers`` config object of ``family`` with tiny sizes.

    Raises:
      ValueError: unknown family.
    """
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if family == "qwen3":
        kw = dict(common, intermediate_size=96, tie_word_embeddings=True)
        return transformers.Qwen3Config(**{**kw, **overrides})
    if family == "qwen3_moe":
        kw = dict(
            common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
        return transformers.Qwen3MoeConfig(**{**kw, **overrides})
    if family == "gpt_oss":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        }
        kw = dict(
            common,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters=rope,
        )
        return transformers.GptOssConfig(**{**kw, **overrides})
    raise ValueError(f"family={family!r}; allowed: {FAMILY_NAMES}")


def make_tiny_hf(family: str, path: str, *, seed: int = 0, **overrides: Any):
    """Builds a random tiny ``family`` model with ``transformers``, saves it to ``path``.

    Returns the float32 ``transformers`` model (eval mode, eager attention).
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model
