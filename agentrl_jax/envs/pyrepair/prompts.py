"""The text a model reads at the start of an episode: the system prompt (goal, constraints,
tools, limits) and the first user message (the task, the files, the program when shown).

The functions take a ``task.Task`` (not imported here: ``task`` imports this module)."""

from __future__ import annotations

from typing import Any

from agentrl_jax.envs.pyrepair.problems import SOLUTION_FILE, TEST_FILE

CALL_FORMAT = '<call>{"name": TOOL, "arguments": {...}}</call>'
CODE_REPLY = "Reply with the whole corrected function in one ```python code block."


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


def failure_excerpt(report: str) -> str:
    """The first failure of a pytest-style report (``report.render``): its traceback lines up to
    the next test's header; the report's last line when it shows no failure."""
    lines = report.split("\n")
    heads = [i for i, line in enumerate(lines) if line.startswith("_") and line.endswith("_")]
    if not heads:
        return lines[-1].strip("= ") if lines else ""
    block = []
    for line in lines[heads[0] + 1 :]:
        if (line.startswith("_") and line.endswith("_")) or line.startswith("="):
            break
        block.append(line)
    return "\n".join(block).strip("\n")


def system_prompt(task: Any) -> str:
    """Goal, constraints, tools and limits of a ``task.Task``, stated once at the start."""
    cfg = task.config
    if cfg.code_action:
        return (
            f"You fix bugs in Python functions. Goal: make every test of `{task.entry_point}` "
            f"pass, the visible tests and {task.n_hidden} hidden tests. Keep its name and "
            f"parameters (`{task.signature}`). Your code block replaces {SOLUTION_FILE} and the "
            f"tests run. You have {cfg.max_turns} tries."
        )
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
    """The request: which function fails, the files, and the program when the level shows it
    (at a ``code_action`` level: the function, its failing test and the reply's form)."""
    if task.config.code_action:
        return (
            f"The function `{task.entry_point}` has a bug.\n```python\n{task.solution}```\n"
            f"A failing test:\n```\n{failure_excerpt(task.failure)}\n```\n{CODE_REPLY}"
        )
    lines = [
        f"Task {task.problem}: the tests of `{task.entry_point}` fail. Fix {SOLUTION_FILE}.",
        f"Files: {SOLUTION_FILE} ({n_lines(task.solution)} lines), {TEST_FILE} "
        f"({task.n_visible} tests).",
    ]
    if task.config.show_program:
        lines += [f"{SOLUTION_FILE}:", numbered(task.solution)]
    return "\n".join(lines)
