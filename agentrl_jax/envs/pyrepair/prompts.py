"""The text a model reads at the start of an episode: the system prompt (goal, constraints,
tools, limits) and the first user message (the task, the files, the program when shown).

The functions take a ``task.Task`` (not imported here: ``task`` imports this module)."""

from __future__ import annotations

from typing import Any

from agentrl_jax.envs.pyrepair.problems import SOLUTION_FILE, TEST_FILE

CALL_FORMAT = '<call>{"name": TOOL, "arguments": {...}}</call>'


def numbered(text: str, start: int = 1, end: int | None = None) -> str:
    """Lines ``start..end`` (1-based, inclusive) of ``text``, each as ``"  12  code"``."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    end = len(lines) if end is None else min(end, len(lines))
    return "\n".join(f"{k:>4}  {lines[k - 1]}" for k in range(start, end + 1))


def n_lines(text: str) -> int:
    """Number of lines of a file's text (a final newline does not start a line)."""
    return len(text.split("\n")) - (1 if text.endswith("\n") else 0)


def system_prompt(task: Any) -> str:
    """Goal, constraints, tools and limits of a ``task.Task``, stated once at the start."""
    cfg = task.config
    return "\n".join(
        [
            "You repair a small Python repository with tools, one tool call per turn.",
            f"Goal: make every test of `{task.entry_point}` pass: the visible tests in "
            f"{TEST_FILE} and {task.n_hidden} hidden tests of the same function.",
            f"Constraints: do not edit {TEST_FILE}; keep the signature of "
            f"`{task.entry_point}` as it is (`{task.signature}`). An answer that breaks a "
            "constraint fails even if every test passes.",
            "Tools:",
            "  view(path, start?, end?): show a file with line numbers "
            f"(at most {cfg.max_view_lines} lines).",
            "  run_tests(): run the visible tests; pytest-style output, cut to "
            f"{cfg.max_output_chars} characters.",
            "  edit(path, start, end, new): replace lines start..end (1-based, inclusive) "
            "with the text new; or edit(path, old, new): replace the one occurrence of old.",
            "  submit(): run every test, hidden ones included, and end the episode.",
            f"Call a tool as {CALL_FORMAT}. You have {cfg.max_turns} turns.",
        ]
    )


def user_prompt(task: Any) -> str:
    """The request: which function fails, the files, and the program when the level shows it."""
    lines = [
        f"Task {task.problem}: the tests of `{task.entry_point}` fail. Fix {SOLUTION_FILE}.",
        f"Files: {SOLUTION_FILE} ({n_lines(task.solution)} lines), {TEST_FILE} "
        f"({task.n_visible} tests).",
    ]
    if task.config.show_program:
        lines += [f"{SOLUTION_FILE}:", numbered(task.solution)]
    return "\n".join(lines)
