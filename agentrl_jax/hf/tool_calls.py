"""Tool-call formats of the chat families: parse a model turn, render one, name the tokens.

  * :class:`QwenToolCalls` (Qwen3, ChatML): the assistant writes
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and ends its turn with
    ``<|im_end|>``; tool results come back as ``<tool_response>`` blocks in a user turn.
  * :class:`ChatMLToolCalls` (Llama chat models such as SmolLM2): the same blocks as plain text
    in a vocabulary without tool-call tokens.
  * :class:`HarmonyToolCalls` (gpt-oss, OpenAI harmony): a call is an assistant message on the
    ``commentary`` channel addressed ``to=functions.NAME`` whose body is the JSON arguments,
    ended by ``<|call|>``; the result is a message from ``functions.NAME to=assistant``. The
    ``openai-harmony`` package needs its tokenizer files from the network on first use, so the
    format is parsed and rendered here from its definition.

``parse`` returns a :class:`ParsedCall` whose ``error`` names the problem when the turn holds no
well-formed call (the environment answers with an error observation; the episode goes on).
:func:`code_call` reads the other action form, a fenced code block (code-acting environments:
the block is the argument of one tool), in every family.
:func:`validate_arguments` checks parsed arguments against a tool's JSON schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl_jax.envs.base import ToolSpec


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One parsed tool call: ``name`` and ``arguments``, or ``error`` (then both None)."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


def _bad(error: str) -> ParsedCall:
    return ParsedCall(None, None, error)


def _arguments(raw: Any) -> dict[str, Any] | str:
    """Arguments object (a JSON string holding an object is accepted), or an error string."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return "arguments are not a JSON object"
    if not isinstance(raw, dict):
        return "arguments are not a JSON object"
    return raw


class QwenToolCalls:
    """Qwen3's ChatML tool calls (module docstring).

    ``special_tokens`` maps the ``envs.base.Tokenizer`` id fields to token strings: ``eot`` =
    ``<|im_end|>`` (end of an assistant turn), ``call_start`` / ``call_end`` = ``<tool_call>`` /
    ``</tool_call>``, ``obs_start`` / ``obs_end`` = ``<tool_response>`` / ``</tool_response>``,
    ``eos`` / ``pad`` / ``bos`` = ``<|endoftext|>`` (Qwen has no BOS token).
    """

    name = "qwen"
    end_markers = ("<|im_end|>",)  # tokens that end an assistant turn
    turn_close = "<|im_end|>"  # closes a turn the model left open
    special_tokens = {
        "eot": "<|im_end|>",
        "call_start": "<tool_call>",
        "call_end": "</tool_call>",
        "obs_start": "<tool_response>",
        "obs_end": "</tool_response>",
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "bos": "<|endoftext|>",
    }
    extra_tokens = ("<|im_start|>", "<think>", "</think>")

    def parse(self, text: str) -> ParsedCall:
        """The single ``<tool_call>`` block of an assistant turn's text."""
        blocks = re.findall(r"<tool_call>(.*?)(</tool_call>|$)", text, flags=re.S)
        if not blocks:
            return _bad("no tool call: write <tool_call>{...}</tool_call>")
        if len(blocks) > 1:
            return _bad(f"one tool call per turn, got {len(blocks)}")
        body, closed = blocks[0]
        if not closed:
            return _bad("unterminated tool call: </tool_call> missing")
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            return _bad(f"tool call is not valid JSON ({e.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return _bad('tool call needs {"name": <string>, "arguments": {...}}')
        args = _arguments(obj.get("arguments", {}))
        return _bad(args) if isinstance(args, str) else ParsedCall(obj["name"], args)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """An assistant turn making this call, as the chat template renders it."""
        call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>{self.turn_close}"


class ChatMLToolCalls(QwenToolCalls):
    """Qwen's ``<tool_call>`` JSON blocks for a ChatML model whose vocabulary has no tool-call
    tokens (Llama-architecture chat models such as SmolLM2): the blocks are plain text.

    ``special_tokens``: the message brackets stand in for the call and observation brackets
    (``call_start`` / ``obs_start`` = ``<|im_start|>``, ``call_end`` / ``obs_end`` = ``eot`` =
    ``<|im_end|>``: a call ends its turn); ``eos`` / ``pad`` / ``bos`` = ``<|endoftext|>``.
    """

    name = "chatml"
    special_tokens = {
        **QwenToolCalls.special_tokens,
        "call_start": "<|im_start|>",
        "call_end": "<|im_end|>",
        "obs_start": "<|im_start|>",
        "obs_end": "<|im_end|>",
    }
    extra_tokens = ("<|im_start|>",)


class HarmonyToolCalls:
    """gpt-oss harmony tool calls (module docstring).

    ``special_tokens``: ``call_end`` = ``<|call|>`` (a turn ending in a call), ``eot`` =
    ``<|return|>`` (a final answer ends the turn), ``call_start`` = ``<|channel|>`` (harmony
    has no call bracket: a call is a channel message addressed to a function),
    ``obs_start`` / ``obs_end`` = ``<|start|>`` / ``<|end|>`` (message brackets), ``bos`` =
    ``<|startoftext|>``, ``eos`` / ``pad`` = ``<|endoftext|>``.
    """

    name = "harmony"
    end_markers = ("<|call|>", "<|return|>", "<|end|>")
    turn_close = "<|end|>"
    special_tokens = {
        "eot": "<|return|>",
        "call_start": "<|channel|>",
        "call_end": "<|call|>",
        "obs_start": "<|start|>",
        "obs_end": "<|end|>",
        "eos": "<|endoftext|>",
        "pad": "<|endoftext|>",
        "bos": "<|startoftext|>",
    }
    extra_tokens = ("<|message|>", "<|constrain|>")
    _header = re.compile(r"to=functions\.([A-Za-z0-9_\-.]+)")

    def parse(self, text: str) -> ParsedCall:
        """The function call of the turn's last message (``... to=functions.X ...<|call|>``)."""
        if "<|call|>" not in text:
            return _bad("no tool call: a call is a commentary message to=functions.NAME")
        message = text[: text.rindex("<|call|>")].split("<|start|>")[-1]
        if "<|message|>" not in message:
            return _bad("tool call without <|message|>")
        header, body = message.split("<|message|>", 1)
        m = self._header.search(header)
        if m is None:
            return _bad("tool call without a recipient to=functions.NAME")
        args = _arguments(body.strip() or "{}")
        return _bad(args) if isinstance(args, str) else ParsedCall(m.group(1), args)

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """An assistant turn (after the ``<|start|>assistant`` prompt) making this call."""
        body = json.dumps(dict(arguments), ensure_ascii=False)
        header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
        return f"{header}<|message|>{body}<|call|>"


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def code_call(text: str, tool: str) -> ParsedCall:
    """The first fenced code block of a turn (```` ```python ```` or a bare fence; a block the
    turn left open runs to its end) as a call of ``tool`` with argument ``code``; an error
    naming the expected form when the turn has none or it is empty."""
    m = _FENCE.search(text)
    if m is None or not m.group(1).strip():
        return _bad("no ```python code block in the reply")
    return ParsedCall(tool, {"code": m.group(1)})


FORMATS = {
    "llama": ChatMLToolCalls,
    "qwen3": QwenToolCalls,
    "qwen3_moe": QwenToolCalls,
    "gpt_oss": HarmonyToolCalls,
}

_JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
}


def validate_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> str | None:
    """Checks ``arguments`` against ``spec.parameters`` (properties' types, required keys, no
    unknown keys); returns an error naming the problem, or None."""
    props = spec.parameters.get("properties", {})
    missing = [k for k in spec.parameters.get("required", ()) if k not in arguments]
    if missing:
        return f"{spec.name} needs argument {missing[0]}"
    for key, value in arguments.items():
        if key not in props:
            return f"{spec.name} has no argument {key}; arguments: {', '.join(props) or 'none'}"
        want = props[key].get("type")
        bad_bool = isinstance(value, bool) and want in ("integer", "number")
        if want in _JSON_TYPES and (not isinstance(value, _JSON_TYPES[want]) or bad_bool):
            return f"{spec.name} argument {key} must be a {want}"
    return None


def check_call(call: ParsedCall, specs: Sequence[ToolSpec]) -> str | None:
    """Error for a parsed call to an unknown tool or with bad arguments, else None."""
    if call.error is not None:
        return call.error
    by_name = {s.name: s for s in specs}
    if call.name not in by_name:
        return f"unknown tool {call.name}; tools: {', '.join(by_name)}"
    return validate_arguments(by_name[call.name], call.arguments or {})
