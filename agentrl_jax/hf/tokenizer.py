"""A Hugging Face tokenizer and chat template behind the ``envs.base.Tokenizer`` protocol.

``load_tokenizer(path)`` reads ``tokenizer.json`` (the ``tokenizers`` library) and the chat
template (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``), and renders
conversations with jinja2 configured as ``transformers`` configures it (sandboxed, trim/lstrip
blocks, loop controls, ``tojson`` without ASCII escaping, ``raise_exception``, ``strftime_now``),
so :meth:`HFTokenizer.render` returns what ``apply_chat_template(..., tokenize=False)`` returns.

Protocol ids (``envs.base.Tokenizer``) come from the family's tool-call format
(``hf.tool_calls``): ``eot_id`` ends an assistant turn (``<|im_end|>``; harmony ``<|return|>``),
``call_start_id`` / ``call_end_id`` bracket a call (``<tool_call>`` / ``</tool_call>``; harmony
``<|channel|>`` / ``<|call|>``), ``obs_start_id`` / ``obs_end_id`` bracket a tool result
(``<tool_response>`` / ``</tool_response>``; harmony's message brackets ``<|start|>`` /
``<|end|>``; ChatML without tool-call tokens (Llama chat models such as SmolLM2): the message
brackets ``<|im_start|>`` / ``<|im_end|>`` for both), ``eos_id`` / ``pad_id`` =
``<|endoftext|>``, ``bos_id`` = ``<|endoftext|>`` for ChatML (Qwen has no BOS token) and
``<|startoftext|>`` for harmony, ``nl_id`` = the id of ``"\\n"``,
``unk_id`` = the model's unknown token or, for byte-level BPEs that have none, ``pad_id``.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from agentrl_jax.hf.tool_calls import FORMATS, ChatMLToolCalls, HarmonyToolCalls, QwenToolCalls


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in the environment ``transformers`` renders templates in."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class HFTokenizer:
    """``envs.base.Tokenizer`` over a ``tokenizers.Tokenizer`` and a chat template.

    Args:
      tokenizer: the fast tokenizer (special tokens registered as added tokens).
      chat_template: jinja source of the chat template.
      fmt: the family's tool-call format (``QwenToolCalls`` / ``HarmonyToolCalls``).
      special_tokens_map: extra template variables (``bos_token``, ``eos_token``, ...).

    Raises:
      ValueError: a token the format needs is not in the vocabulary (naming it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        fmt: QwenToolCalls | HarmonyToolCalls,
        special_tokens_map: Mapping[str, str] | None = None,
    ):
        self.tokenizer, self.fmt = tokenizer, fmt
        self.chat_template = chat_template
        self._template = compile_template(chat_template)
        self.special_tokens_map = dict(special_tokens_map or {})
        ids = {}
        for field, token in fmt.special_tokens.items():
            i = tokenizer.token_to_id(token)
            if i is None:
                raise ValueError(f"tokenizer has no {token!r} (needed as {field}_id by {fmt.name})")
            ids[field] = i
        nl = tokenizer.encode("\n", add_special_tokens=False).ids
        if len(nl) != 1:
            raise ValueError(f"tokenizer encodes '\\n' as {nl}; one token expected")
        unk = tokenizer.model.unk_token if hasattr(tokenizer.model, "unk_token") else None
        unk_id = tokenizer.token_to_id(unk) if unk else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]
        self.call_start_id, self.call_end_id = ids["call_start"], ids["call_end"]
        self.obs_start_id, self.obs_end_id = ids["obs_start"], ids["obs_end"]
        self.eot_id, self.nl_id = ids["eot"], nl[0]
        self.unk_id = self.pad_id if unk_id is None else unk_id

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, special tokens kept."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def token(self, i: int) -> str:
        """The vocabulary string of id ``i``."""
        return self.tokenizer.id_to_token(int(i))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text of ``messages`` (``apply_chat_template(tokenize=False)``)."""
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_tokenizer(path: str, fmt: QwenToolCalls | HarmonyToolCalls | None = None) -> HFTokenizer:
    """Loads ``tokenizer.json`` and the chat template of an HF directory.

    Args:
      path: the directory.
      fmt: tool-call format; None picks it from ``config.json``'s ``model_type`` or, without
        one, from the vocabulary (``<|call|>``: harmony; ``<|im_end|>`` without ``<tool_call>``:
        ChatML with text tool calls; else Qwen's ChatML).

    Raises:
      FileNotFoundError: no ``tokenizer.json``.
      ValueError: no chat template, or a token the format needs is missing.
    """
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config: dict[str, Any] = {}
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
    template = config.get("chat_template")
    if os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
    if not isinstance(template, str) or not template:
        raise ValueError(f"{path} has no chat template (chat_template.jinja or tokenizer_config)")
    if fmt is None:
        model_type = None
        if os.path.exists(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        if model_type in FORMATS:
            fmt = FORMATS[model_type]()
        elif tok.token_to_id("<|call|>") is not None:
            fmt = HarmonyToolCalls()
        elif tok.token_to_id("<tool_call>") is None and tok.token_to_id("<|im_end|>") is not None:
            fmt = ChatMLToolCalls()
        else:
            fmt = QwenToolCalls()
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    special = {n: _token_str(config.get(n)) for n in names if _token_str(config.get(n))}
    return HFTokenizer(tok, template, fmt, special)
