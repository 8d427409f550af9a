"""A chat model plays a ``TextEnv`` through the token-level ``Env`` protocol.

``ChatEnv(inner, tokenizer)`` is an ``envs.base.Env``: the agent loop, the sampler and the
trainer run it unchanged. ``reset`` renders the inner environment's system prompt, its tool
schemas and the first user message with the family's chat template plus the generation prompt.
``step(action_tokens)`` decodes the model's turn, parses its tool call in the family's format
(``hf.tool_calls``; a malformed call, an unknown tool or bad arguments go to
``inner.step_call(None, None, error)``), and returns the observation: the template's text that
follows the assistant turn (the tool-response turn, then the next generation prompt), tokenised
on its own.

A turn without a well-formed call is answered as a user message naming the problem. A
code-acting environment (one whose ``code_action`` names a tool) takes the turn's first fenced
code block as that tool's call instead (``tool_calls.code_call``): the assistant turn stays the
model's text and the observation comes back as a user message.

Token in, token out: the model's action ids are never re-tokenised; only observation text is
encoded. It starts right after the end marker of the assistant turn (for ChatML the ``\n``
after ``<|im_end|>``, for harmony everything after ``<|call|>``). A turn that stopped before its
end marker (at ``</tool_call>``, or on the token budget) gets the format's closing token at the
head of the observation, so every turn is closed exactly once. The observation is cut from the
template's rendering of the whole conversation so far, so separators between turns are the
template's own, and every cut falls next to a special token, where no BPE merge can cross.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from agentrl_jax.envs.base import StepResult, TextEnv
from agentrl_jax.envs.coderepair.text import call_from_words
from agentrl_jax.hf.tokenizer import HFTokenizer
from agentrl_jax.hf.tool_calls import HarmonyToolCalls, QwenToolCalls, check_call, code_call

_SENTINEL = "REPLY0x5f3759df"  # stands for a reply's content while the cut is located


def _assistant_message(call_name: str | None, arguments: dict | None, text: str) -> dict:
    if call_name is None:
        return {"role": "assistant", "content": text}
    call = {"type": "function", "function": {"name": call_name, "arguments": arguments or {}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class ChatEnv:
    """``envs.base.Env`` over a ``TextEnv`` for a chat model (module docstring).

    Args:
      inner: the text environment (e.g. ``CodeRepairEnv``).
      tokenizer: the model's tokenizer and chat template (``hf.load_tokenizer``).
      fmt: tool-call format; default the tokenizer's.

    Attributes:
      messages: the conversation so far as chat messages (what the template rendered).
      last_call: the parsed call of the last turn (``ParsedCall``).
    """

    def __init__(
        self,
        inner: TextEnv,
        tokenizer: HFTokenizer,
        fmt: QwenToolCalls | HarmonyToolCalls | None = None,
    ):
        self.inner, self.tokenizer = inner, tokenizer
        self.fmt = fmt or tokenizer.fmt
        self.tools: list[dict[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.last_call = None

    def reset(self, task: Any) -> list[int]:
        """Starts ``task``; returns the prompt ids (system + tools + user + generation prompt)."""
        system, user = self.inner.reset_text(task)
        self.tools = [spec.as_json() for spec in self.inner.tool_specs]  # the task's level's
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tokenizer.render(self.messages, self.tools, add_generation_prompt=True)
        return self.tokenizer.encode(text)

    def step(self, action_tokens: Sequence[int]) -> tuple[list[int], StepResult]:
        """Applies one model turn; returns the observation ids and the step result.

        Raises:
          RuntimeError: before ``reset`` (from the inner environment).
        """
        if not self.messages:
            raise RuntimeError("step() needs reset() first")
        tok, fmt = self.tokenizer, self.fmt
        text = tok.decode(action_tokens)
        code_tool = getattr(self.inner, "code_action", None)
        call = code_call(text, code_tool) if code_tool else fmt.parse(text)
        error = check_call(call, self.inner.tool_specs)
        if error is None:
            obs_text, result = self.inner.step_call(call.name, call.arguments)
        else:
            obs_text, result = self.inner.step_call(None, None, error)
        self.last_call = call
        result = dataclasses.replace(result, log={**result.log, "text": text})
        ok = error is None
        as_call = ok and not code_tool
        assistant = _assistant_message(call.name if as_call else None, call.arguments, text)
        if as_call:
            reply = {"role": "tool", "name": call.name, "content": obs_text}
        else:
            reply = {"role": "user", "content": obs_text}
        last = tok.token(action_tokens[-1]) if len(action_tokens) else ""
        closing = "" if last in fmt.end_markers else fmt.turn_close
        return tok.encode(closing + self._observation(assistant, reply, result.done)), result

    def _observation(self, assistant: dict, reply: dict, done: bool) -> str:
        """Template text after the assistant turn's end marker: the separator that follows
        it, ``reply`` and, unless the episode is over, the next generation prompt.

        The cut is found on a rendering whose reply content is a sentinel: the last end marker
        before the sentinel closes the assistant turn. Only the text after it is used, so a
        template that renders earlier turns differently once a turn follows them (Qwen3 drops
        the thinking block of all but the last assistant turn) still gives the right suffix.

        Raises:
          ValueError: the template renders no end marker before the reply, or the reply
            changes the text before it.
        """
        tok, markers = self.tokenizer, self.fmt.end_markers
        msgs, gen = [*self.messages, assistant], not done
        probe = tok.render([*msgs, {**reply, "content": _SENTINEL}], self.tools, gen)
        head = probe[: probe.index(_SENTINEL)]
        ends = [head.rindex(m) + len(m) for m in markers if m in head]
        if not ends:
            raise ValueError(f"chat template renders none of {markers} before a reply")
        full = tok.render([*msgs, reply], self.tools, gen)
        if full[: max(ends)] != probe[: max(ends)]:
            raise ValueError("chat template renders text before a reply that depends on it")
        self.messages = [*msgs, reply]
        return full[max(ends) :]


class ChatExpertPolicy:
    """A scripted expert speaking a chat model's format: SFT demonstrations for a chat model.

    The expert's ``plan`` is replayed turn by turn: a call ``(name, arguments)`` (the Python
    repair expert's) as it is, a word tuple (the mini-language expert's) through
    ``coderepair.text.call_from_words``. A call of ``code_tool`` (a code-acting environment's
    tool) is written as a fenced code block, any other call in the family's tool-call format,
    and encoded with the chat tokenizer.

    Args:
      expert: the scripted policy (its ``plan`` is replayed).
      tokenizer: the chat model's tokenizer.
      code_tool: the tool whose calls are fenced code blocks (``ChatEnv``'s ``code_action``).
    """

    def __init__(self, expert, tokenizer: HFTokenizer, code_tool: str | None = None):
        self.tokenizer, self.turn, self.code_tool = tokenizer, 0, code_tool
        self.calls = [step if _is_call(step) else call_from_words(step) for step in expert.plan]

    def __call__(self, stream: list[int]) -> list[int]:
        name, args = self.calls[min(self.turn, len(self.calls) - 1)]
        self.turn += 1
        if name == self.code_tool:
            return self.tokenizer.encode(f"```python\n{args['code']}```")
        return self.tokenizer.encode(self.tokenizer.fmt.render_call(name, args))


def _is_call(step) -> bool:
    return len(step) == 2 and isinstance(step[0], str) and isinstance(step[1], dict)
