"""The code-repair tools as a chat model sees them: JSON schemas and word-level calls.

``TOOL_SPECS`` describe the five tools as functions with named arguments; :func:`call_words`
turns a structured call into the words the token-level environment reads after ``<call>``, and
:func:`call_from_words` is its inverse (used to turn the scripted expert's calls into a chat
model's tool calls):

    run {}                                          <-> run
    view {"target": "L3 L9"}                        <-> view L3 L9
    edit {"line": "L4", "code": "x = a + 1"}        <-> edit L4 x = a + 1
    edit {"line": "L4", "end_line": "L6", "code": "a\\nb"} <-> edit L4 L6 a <nl> b
    sub {"line": "L5", "old": "*", "new": "+"}      <-> sub L5 * +
    submit {}                                       <-> submit

``line`` is optional for ``edit`` and ``sub`` (the cursor line, as with the word form).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl_jax.envs.base import ToolSpec

_LINE = re.compile(r"L\d+")
_LINE_ARG = {"type": "string", "description": "a line id such as L4"}

TOOL_SPECS = (
    ToolSpec("run", "Run the visible tests; shows failures and a value trace.", {
        "type": "object", "properties": {}, "required": []}),
    ToolSpec("view", "Show the function listing, one function, or a line range.", {
        "type": "object",
        "properties": {"target": {
            "type": "string", "description": "a function name or 'La Lb'; omit for the listing"}},
        "required": []}),
    ToolSpec("edit", "Replace one line (or lines line..end_line) by new code lines.", {
        "type": "object",
        "properties": {"line": _LINE_ARG, "end_line": _LINE_ARG, "code": {
            "type": "string", "description": "the new line(s), one per text line"}},
        "required": ["code"]}),
    ToolSpec("sub", "Replace the single occurrence of word old in a line by new words.", {
        "type": "object",
        "properties": {"line": _LINE_ARG, "old": {"type": "string"}, "new": {"type": "string"}},
        "required": ["old", "new"]}),
    ToolSpec("submit", "Run every test and end the episode.", {
        "type": "object", "properties": {}, "required": []}),
)  # fmt: skip

SYSTEM_PROMPT = (
    "You repair programs written in a small language. Call one tool per turn: run the tests, "
    "view code, edit lines or substitute words, and submit once every test passes. Keep the "
    "rule the task states."
)


def _text(arguments: Mapping[str, Any], key: str) -> str:
    value = arguments.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"argument {key} must be a string")
    return value


def call_words(name: str, arguments: Mapping[str, Any]) -> list[str]:
    """Words of the call ``name(arguments)`` as the environment reads them after ``<call>``.

    Raises:
      ValueError: an argument that is not a string (the environment answers an error).
    """
    words = [name]
    if name == "view":
        words += _text(arguments, "target").split()
    elif name in ("edit", "sub"):
        words += [w for w in (_text(arguments, "line"),) if w]
        if name == "edit":
            words += [w for w in (_text(arguments, "end_line"),) if w]
            lines = [line.split() for line in _text(arguments, "code").split("\n")]
            for k, line in enumerate(lines):
                words += (["<nl>"] if k else []) + line
        else:
            words += _text(arguments, "old").split()[:1] + _text(arguments, "new").split()
    return words


def call_from_words(words: Sequence[str]) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`call_words` for a well-formed word call (e.g. the expert's)."""
    name, rest = words[0], list(words[1:])
    args: dict[str, str] = {}
    if name == "view" and rest:
        args["target"] = " ".join(rest)
    elif name in ("edit", "sub"):
        if rest and _LINE.fullmatch(rest[0]) and (name == "edit" or len(rest) > 2):
            args["line"] = rest.pop(0)
            if name == "edit" and rest and _LINE.fullmatch(rest[0]):
                args["end_line"] = rest.pop(0)
        if name == "edit":
            args["code"] = " ".join(rest).replace(" <nl> ", "\n").replace("<nl>", "\n")
        else:
            args["old"], args["new"] = rest[0], " ".join(rest[1:])
    return name, args
