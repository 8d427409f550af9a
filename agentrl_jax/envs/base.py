"""Environment protocol: tokenizer, tools, step results and the tool registry.

An environment speaks tokens on both sides. ``Env.reset(task)`` returns the prompt tokens (the
first observation); ``Env.step(action_tokens)`` takes the tokens the model emitted in one turn
(``<call> tool arg ... </call>``) and returns the observation tokens (``<obs> ... </obs>``) plus a
``StepResult``. The tokenizer is shared by environment and model, so the trainer sees exactly the
ids the sampler produced and observations are tokenized once, never re-tokenized.

Robustness contract (every environment built on this module):
  * a malformed call (no ``<call>``), an unknown tool, a wrong argument count, an out-of-range
    argument or any exception raised inside a tool becomes an *error observation*; the episode
    goes on and nothing propagates to the caller (``call_tool``);
  * tools get a time limit (``ToolContext.deadline``) and an instruction budget; exceeding either is
    a ``timeout`` observation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class Tokenizer(Protocol):
    """Token ids <-> text, shared by environment and model.

    Attributes:
      vocab_size: number of ids (ids are ``0 .. vocab_size - 1``).
      pad_id, bos_id, eos_id: padding, begin and end of an episode.
      call_start_id, call_end_id: bracket one tool call emitted by the model.
      obs_start_id, obs_end_id: bracket one observation emitted by the environment.
      eot_id: end of a model turn without a tool call (the sampler stops on it too).
      nl_id: line break inside observations and multi-line edits.
      unk_id: any word outside the vocabulary.
    """

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    call_start_id: int
    call_end_id: int
    obs_start_id: int
    obs_end_id: int
    eot_id: int
    nl_id: int
    unk_id: int

    def encode(self, text: str) -> list[int]:
        """Text -> ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text."""
        ...


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one environment step returns besides the observation tokens.

    Attributes:
      done: the episode is over (submitted or out of turns).
      outcome_reward: ORM reward, non-zero only on the final step (1.0 = solved and goal kept).
      process: PRM milestone signals of this step, e.g. ``{"parse": 1.0}``; signed floats, zero
        when nothing changed.
      log: record of the tool call: ``tool``, ``args``, ``output`` (text), ``error`` (bool) and,
        on the final step, ``success`` and ``goal_adhered``; a chat environment adds ``text``,
        the model's turn as decoded (the call as written, malformed or not).
    """

    done: bool
    outcome_reward: float
    process: dict[str, float]
    log: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    """A token-level, multi-turn environment."""

    tokenizer: Tokenizer

    def reset(self, task: Any) -> list[int]:
        """Starts an episode on ``task``; returns the prompt tokens (``<bos> <obs> ... </obs>``)."""
        ...

    def step(self, action_tokens: Sequence[int]) -> tuple[list[int], StepResult]:
        """Applies one model turn; returns observation tokens and the step result."""
        ...


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool as a chat model sees it (an OpenAI-style function schema).

    Attributes:
      name: the tool's name.
      description: one or two sentences for the model.
      parameters: JSON schema of the arguments object
        (``{"type": "object", "properties": {...}, "required": [...]}``).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]

    def as_json(self) -> dict[str, Any]:
        """The schema as chat templates take it: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@runtime_checkable
class TextEnv(Protocol):
    """An environment that also speaks text and structured tool calls.

    This is what a chat-model adapter needs to let a real LLM (its own tokenizer, chat template
    and tool-call format) play the environment: the adapter renders ``reset_text`` and each
    observation with the family's template, parses the model's tool call in the family's format
    and hands it to ``step_call``.
    """

    tool_specs: tuple[ToolSpec, ...]

    def reset_text(self, task: Any) -> tuple[str, str]:
        """Starts an episode on ``task``; returns ``(system_prompt, first_user_message)``."""
        ...

    def step_call(
        self, name: str | None, arguments: Mapping[str, Any] | None, error: str | None = None
    ) -> tuple[str, StepResult]:
        """Applies one model turn given as a parsed call (or ``error``: why it did not parse).

        A turn whose call did not parse (``name is None``, ``error`` set) still counts as a turn
        and returns an error observation naming the problem; the episode goes on.
        """
        ...


class ToolError(Exception):
    """Raised by a tool for a bad call; its message becomes the error observation."""


class ToolTimeout(ToolError):
    """Raised when a tool exceeds its instruction budget or wall-clock deadline."""


@dataclasses.dataclass
class ToolContext:
    """Per-call context handed to a tool.

    Attributes:
      state: the environment's mutable episode state (environment specific).
      deadline: ``time.monotonic()`` value after which the tool must raise ``ToolTimeout``.
    """

    state: Any
    deadline: float


@runtime_checkable
class Tool(Protocol):
    """A named tool.

    Attributes:
      name: the word the model writes after ``<call>``.
      min_args, max_args: allowed number of argument words (``max_args=-1`` for unbounded).
      mutates: whether a successful call can change the environment state (edits).
    """

    name: str
    min_args: int
    max_args: int
    mutates: bool

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        """Runs the tool on argument words; returns the observation text. Raises ToolError."""
        ...


class ToolRegistry:
    """Tools by name: ``register`` refuses duplicates, ``get`` returns ``None`` if unknown."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        """Adds ``tool``. Raises ValueError if its name is empty or already registered."""
        if not tool.name or tool.name in self._tools:
            raise ValueError(f"tool name {tool.name!r} must be non-empty and unique")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)


@dataclasses.dataclass(frozen=True)
class ToolCallResult:
    """Outcome of ``call_tool``: observation text and whether it was an error."""

    name: str
    args: tuple[str, ...]
    output: str
    error: bool
    timed_out: bool = False


def call_tool(
    registry: ToolRegistry, words: Sequence[str], state: Any, time_limit_s: float
) -> ToolCallResult:
    """Dispatches one parsed tool call; never raises.

    Args:
      registry: the tools.
      words: ``[tool_name, arg, ...]`` (already stripped of call brackets).
      state: environment state handed to the tool.
      time_limit_s: wall-clock limit for the call.

    Returns:
      A ``ToolCallResult``. Unknown tools, wrong argument counts, ``ToolError``, ``ToolTimeout``
      and any other exception become ``error=True`` results whose output names the problem.
    """
    if not words:
        return ToolCallResult("", (), "error empty call", True)
    name, args = words[0], tuple(words[1:])
    tool = registry.get(name)
    if tool is None:
        known = " ".join(registry.names)
        return ToolCallResult(name, args, f"error unknown tool {name} use {known}", True)
    if len(args) < tool.min_args or (tool.max_args >= 0 and len(args) > tool.max_args):
        want = str(tool.min_args) if tool.min_args == tool.max_args else f"{tool.min_args} +"
        if tool.max_args > tool.min_args:
            want = f"{tool.min_args} to {tool.max_args}"
        return ToolCallResult(name, args, f"error {name} takes {want} args got {len(args)}", True)
    ctx = ToolContext(state=state, deadline=time.monotonic() + time_limit_s)
    try:
        return ToolCallResult(name, args, tool(ctx, list(args)), False)
    except ToolTimeout as e:
        return ToolCallResult(name, args, f"error timeout {e}".strip(), True, timed_out=True)
    except ToolError as e:
        return ToolCallResult(name, args, f"error {e}", True)
    except Exception as e:  # noqa: BLE001 - a tool bug must not end the episode
        logger.warning("tool %s raised %r", name, e)
        return ToolCallResult(name, args, f"error tool {name} failed", True)


PolicyFn = Callable[[list[int]], list[int]]
"""A policy maps the token stream so far to the tokens of its next turn."""
