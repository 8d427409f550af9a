"""Scripted expert: repairs a task from its recorded mutations, through the tools.

The expert reads ``Task.mutations`` (hunks of ``solution.py`` and their fixes) but acts only
through tool calls in the model's own format, so its demonstrations are turns a model could have
produced:

    [view solution.py] -> run_tests -> fix the last bug -> run_tests -> ... -> submit

At a code-action level it writes the repaired program at once (``write_code``).

``view`` comes first when the first message does not show the program. Bugs are fixed from the
bottom of the file up, so the line numbers of the ones above stay valid. A fix replaces the
buggy text by exact string (``edit(path, old, new)``) when that text occurs once in the file,
else by line range; a dropped statement is put back by replacing the line before it with that
line plus the missing lines.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl_jax.envs.pyrepair.problems import SOLUTION_FILE
from agentrl_jax.envs.pyrepair.task import Mutation, Task
from agentrl_jax.envs.pyrepair.tokenizer import ByteTokenizer

Call = tuple[str, dict[str, Any]]


def fix_call(solution: str, m: Mutation) -> Call:
    """The ``edit`` call that repairs mutation ``m`` in the current ``solution`` text."""
    lines = solution.split("\n")
    new = "\n".join(m.fixed)
    if not m.buggy:
        prev = lines[m.line - 2]
        args = {"path": SOLUTION_FILE, "start": m.line - 1, "end": m.line - 1}
        return "edit", {**args, "new": "\n".join([prev, *m.fixed])}
    old = "\n".join(m.buggy)
    if solution.count(old) == 1:
        return "edit", {"path": SOLUTION_FILE, "old": old, "new": new}
    end = m.line + len(m.buggy) - 1
    return "edit", {"path": SOLUTION_FILE, "start": m.line, "end": end, "new": new}


def expert_calls(task: Task) -> list[Call]:
    """The expert's tool calls ``(name, arguments)`` for ``task``, in order."""
    if task.config.code_action:  # the whole repaired program in one write
        return [("write_code", {"code": task.reference})]
    calls: list[Call] = []
    if not task.config.show_program:
        calls.append(("view", {"path": SOLUTION_FILE}))
    calls.append(("run_tests", {}))
    solution = task.solution
    for m in sorted(task.mutations, key=lambda m: m.line, reverse=True):
        call = fix_call(solution, m)
        solution = _apply(solution, call[1])
        calls += [call, ("run_tests", {})]
    calls.append(("submit", {}))
    return calls


def _apply(solution: str, args: dict[str, Any]) -> str:
    if "old" in args:
        return solution.replace(args["old"], args["new"], 1)
    lines = solution.split("\n")
    return "\n".join(lines[: args["start"] - 1] + args["new"].split("\n") + lines[args["end"] :])


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """The JSON body of a call in the token format."""
    return json.dumps({"name": name, "arguments": arguments})


class ExpertPolicy:
    """A policy callable (``stream -> action ids``) that replays ``expert_calls`` turn by turn.

    ``detour_turns`` and ``guess_turns`` are empty (no detours), as the demonstration builder
    of the mini-language environment reads them.

    Args:
      task: the task to solve.
      tokenizer: the environment's tokenizer (default ``ByteTokenizer()``).
    """

    def __init__(self, task: Task, tokenizer: ByteTokenizer | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.plan = expert_calls(task)
        self.turn = 0
        # the mini-language expert's detour bookkeeping: this expert makes no detours
        self.detour_turns: frozenset[int] = frozenset()
        self.guess_turns: frozenset[int] = frozenset()

    def action_ids(self, call: Call) -> list[int]:
        """``<call> {json} </call>`` as ids."""
        tok = self.tokenizer
        return [tok.call_start_id, *tok.encode(call_text(*call)), tok.call_end_id]

    def __call__(self, stream: list[int]) -> list[int]:
        call = self.plan[min(self.turn, len(self.plan) - 1)]
        self.turn += 1
        return self.action_ids(call)
