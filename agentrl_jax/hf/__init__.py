"""Hugging Face models in and out: checkpoints, tokenizers, chat templates and tool calls.

``load_pretrained`` / ``save_pretrained`` (``checkpoint``) move weights between an HF directory
and the project's model (``families`` maps configs and parameter names: Llama, Qwen3, Qwen3-MoE,
gpt-oss); ``gguf`` converts a llama.cpp GGUF file into an HF directory (once, cached:
``gguf.converted_dir``; ``gguf.smollm2_gguf_path()`` is SmolLM2-135M-Instruct); ``load_tokenizer``
(``tokenizer``) wraps ``tokenizer.json`` and the directory's chat template behind the
``envs.base.Tokenizer`` protocol; ``tool_calls`` parses and renders the families' tool-call
formats; ``chat_env.ChatEnv`` lets a chat model play any ``envs.base.TextEnv`` through the
token-level ``Env`` protocol the agent loop speaks.
"""

from agentrl_jax.hf.checkpoint import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
