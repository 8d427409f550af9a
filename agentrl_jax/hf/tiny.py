"""Tiny random models of each HF family, built and saved by ``transformers`` itself.

Tests, ``benchmarks/hf_parity.py`` and smoke experiments start from these: a few layers, GQA,
several experts for the MoE families, sliding and full layers with sinks for gpt-oss, SmolLM2's
RoPE base for Llama. Every norm
weight, bias and sink is perturbed away from its initial ones/zeros so that a wrong mapping of
any tensor shows in the logits. Needs ``torch`` and ``transformers`` (the ``dev`` extras);
they are imported only when a model is built.
"""

from __future__ import annotations

from typing import Any

FAMILY_NAMES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")


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
    if family == "llama":
        rope = {"rope_type": "default", "rope_theta": 100000.0}
        kw = dict(common, intermediate_size=96, tie_word_embeddings=True, rope_parameters=rope)
        return transformers.LlamaConfig(**{**kw, **overrides})
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
            max_position_embeddings=64 * 32,  # YaRN's original context times its factor
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


# Chat templates of the tiny tokenizers. Real checkpoints carry their own; these render the
# families' formats (ChatML with Qwen-style <tool_call> blocks; harmony) in the same structure.
CHATML_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
{%- if system or tools %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
{{- '\n\n# Tools\n\nFunction signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nCall one function per turn in <tool_call></tool_call> tags.' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": ' + (call.function.name | tojson) + ', "arguments": ' }}
{{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()

HARMONY_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}
{{- '<|start|>system<|message|>Valid channels: analysis, commentary, final.<|end|>' }}
{%- if system or tools %}
{{- '<|start|>developer<|message|># Instructions\n\n' + system }}
{%- if tools %}
{{- '\n\n# Tools\n\n## functions\n\nnamespace functions {\n' }}
{%- for tool in tools %}
{{- '\n// ' + tool.function.description + '\ntype ' + tool.function.name + ' = (_: ' }}
{{- (tool.function.parameters | tojson) + ') => any;\n' }}
{%- endfor %}
{{- '\n} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{{- '<|start|>functions.' + message.name + ' to=assistant<|channel|>commentary<|message|>' }}
{{- (message.content | tojson) + '<|end|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name + ' <|constrain|>json' }}
{{- '<|message|>' + (call.arguments | tojson) + '<|call|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|start|>assistant' + message.content + '<|end|>' }}
{%- else %}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
""".strip()


def make_tiny_tokenizer(path: str, family: str, texts, *, vocab_size: int = 512) -> None:
    """Trains a byte-level BPE on ``texts`` with the family's special tokens and writes
    ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template) into ``path``.

    The result loads with ``hf.load_tokenizer`` and with ``transformers.AutoTokenizer``.
    """
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from agentrl_jax.hf.tool_calls import FORMATS

    fmt = FORMATS[family]()
    specials = list(dict.fromkeys([*fmt.special_tokens.values(), *fmt.extra_tokens]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = HARMONY_TEMPLATE if fmt.name == "harmony" else CHATML_TEMPLATE
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": fmt.special_tokens["eos"],
        "pad_token": fmt.special_tokens["pad"],
        "bos_token": None,
        "model_max_length": 4096,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def env_corpus(env, n_tasks: int = 6, difficulty: int = 1) -> list[str]:
    """Texts a tokenizer for ``env`` (an ``EnvSpec`` whose environment has a text interface)
    should cover: tool schemas, prompts, the expert's calls in both formats and the tool
    outputs of a few tasks."""
    import json

    from agentrl_jax.envs.coderepair.text import call_from_words
    from agentrl_jax.hf.tool_calls import FORMATS

    tok = env.tokenizer()
    fmts = [cls() for cls in dict.fromkeys(FORMATS.values())]
    texts = []
    for seed in range(n_tasks):
        task = env.make_task(seed, difficulty, bug_types=(env.bug_types[seed % 2],))
        text_env = env.env(tok)
        system, user = text_env.reset_text(task)
        texts += [json.dumps([s.as_json() for s in text_env.tool_specs]), system, user]
        for words in getattr(env.expert(task, tok), "plan", ()):
            name, args = call_from_words(words)
            texts += [fmt.render_call(name, args) for fmt in fmts] + [json.dumps(args)]
            obs, result = text_env.step_call(name, args)
            texts.append(obs)
            if result.done:
                break
    return texts


def tiny_chat_model(family: str, env, directory: str, *, vocab_size: int = 600) -> str:
    """A random tiny ``family`` model with a BPE tokenizer trained on ``env``'s texts, in
    ``directory/<family>-<env>`` (built once: an existing complete one is reused; a concurrent
    builder's result is kept). Returns that path: an ``init.hf_path`` for smoke runs."""
    import os
    import shutil
    import tempfile

    path = os.path.join(directory, f"{family}-{env.name}-v{vocab_size}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(directory, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=directory)
    try:
        make_tiny_tokenizer(tmp, family, env_corpus(env), vocab_size=vocab_size)
        from agentrl_jax.hf.tokenizer import load_tokenizer

        make_tiny_hf(family, tmp, vocab_size=load_tokenizer(tmp).vocab_size, num_hidden_layers=2)
        os.rename(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
