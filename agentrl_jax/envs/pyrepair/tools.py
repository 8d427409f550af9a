"""The four tools of the Python repair environment, their schemas and their observations.

  * ``view(path, start?, end?)``: the file with line numbers, at most ``max_view_lines`` lines;
  * ``run_tests()``: the visible tests of the work tree (as the agent left ``test_solution.py``),
    pytest-style report cut to ``max_output_chars`` characters (the summary line is kept);
  * ``edit(path, start, end, new)``: lines ``start..end`` (1-based, inclusive) replaced by the
    text ``new`` (``""`` deletes them); ``edit(path, old, new)``: the one occurrence of ``old``
    replaced. An edit that changes nothing is refused. A ``solution.py`` that no longer parses
    is reported with the edit;
  * ``submit()``: every test (the original visible ones and the hidden ones) against
    ``solution.py``, and the constraints (``test_solution.py`` unchanged, signature kept);
    ends the episode.

A ``code_action`` level (``config.EnvConfig``) has one tool instead (``specs_for``):
  * ``write_code(code)``: ``code`` replaces ``solution.py`` and the visible tests run; when they
    all pass the program is submitted as by ``submit``, else the first failure is shown.

Arguments are checked against the tool's JSON schema (``jsonschema``); a bad call raises
``ToolError`` with a message naming the problem, which the environment turns into an error
observation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema

from agentrl_jax.envs.base import ToolError, ToolSpec
from agentrl_jax.envs.pyrepair.execution import Evaluation, Job, parses
from agentrl_jax.envs.pyrepair.problems import HIDDEN_TEST_FILE, SOLUTION_FILE, TEST_FILE
from agentrl_jax.envs.pyrepair.prompts import CODE_REPLY, failure_excerpt, n_lines, numbered
from agentrl_jax.envs.pyrepair.task import Task, signature_of

FILES = (SOLUTION_FILE, TEST_FILE)
_PATH = {"type": "string", "enum": list(FILES), "description": "file to act on"}
_LINE = {"type": "integer", "minimum": 1}
TOOL_SPECS = (
    ToolSpec(
        "view",
        "Show a file with line numbers, optionally only lines start..end.",
        {
            "type": "object",
            "properties": {"path": _PATH, "start": _LINE, "end": _LINE},
            "required": ["path"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "run_tests",
        "Run the visible tests (test_solution.py) and show the pytest-style report.",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
    ToolSpec(
        "edit",
        "Replace lines start..end (1-based, inclusive) of a file with new, or replace the one "
        "occurrence of the exact text old with new.",
        {
            "type": "object",
            "properties": {
                "path": _PATH,
                "start": _LINE,
                "end": _LINE,
                "old": {"type": "string", "minLength": 1},
                "new": {"type": "string"},
            },
            "required": ["path", "new"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "submit",
        "Run every test, hidden ones included, check the constraints, and end the episode.",
        {"type": "object", "properties": {}, "additionalProperties": False},
    ),
)
CODE_TOOL_SPECS = (
    ToolSpec(
        "write_code",
        "Replace solution.py with code and run the visible tests; submit once they all pass.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 1}},
            "required": ["code"],
            "additionalProperties": False,
        },
    ),
)
TOOL_NAMES = tuple(s.name for s in TOOL_SPECS)
_VALIDATORS = {
    s.name: jsonschema.Draft202012Validator(dict(s.parameters))
    for s in (*TOOL_SPECS, *CODE_TOOL_SPECS)
}


def specs_for(config) -> tuple[ToolSpec, ...]:
    """The tools of a level (``config.EnvConfig``): ``write_code`` alone at a code-action level."""
    return CODE_TOOL_SPECS if config.code_action else TOOL_SPECS


@dataclasses.dataclass
class RepairState:
    """Mutable episode state the tools act on."""

    task: Task
    files: dict[str, str]
    submitted: bool = False
    final: tuple[Evaluation, ...] = ()
    goal_adhered: bool = True

    @property
    def solved(self) -> bool:
        return self.submitted and all(e.all_pass for e in self.final) and self.goal_adhered


Runner = Callable[[list[Job], bool], list[Evaluation]]
"""Runs jobs in the sandbox: ``(jobs, report) -> evaluations``."""


def check_arguments(name: str, arguments: Mapping[str, Any]) -> None:
    """Raises ToolError naming the first schema violation of ``arguments``."""
    error = jsonschema.exceptions.best_match(_VALIDATORS[name].iter_errors(dict(arguments)))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path)
        raise ToolError(f"bad arguments for {name}: {where + ': ' if where else ''}{error.message}")


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, keeping its last line and saying it was cut."""
    if len(text) <= limit:
        return text
    last = text.rstrip("\n").rsplit("\n", 1)[-1][: limit // 4]
    note = f"\n[... output cut to {limit} characters ...]\n"
    return text[: max(limit - len(note) - len(last), 0)] + note + last


def constraints_kept(task: Task, files: Mapping[str, str]) -> tuple[bool, list[str]]:
    """Whether the work tree honours the constraints, and the broken ones in words."""
    broken = []
    if files[TEST_FILE] != task.visible_tests:
        broken.append(f"{TEST_FILE} was edited")
    if signature_of(files[SOLUTION_FILE], task.entry_point) != task.signature:
        broken.append(f"the signature of {task.entry_point} changed")
    return not broken, broken


def view(state: RepairState, args: Mapping[str, Any]) -> str:
    text = state.files[args["path"]]
    total = n_lines(text)
    start = args.get("start", 1)
    end = args.get("end", total)
    if start > max(total, 1) or end < start:
        raise ToolError(f"bad line range {start}-{end}: {args['path']} has {total} lines")
    limit = state.task.config.max_view_lines
    shown_end = min(end, total, start + limit - 1)
    out = [
        f"{args['path']} lines {start}-{shown_end} of {total}:",
        numbered(text, start, shown_end),
    ]
    if shown_end < min(end, total):
        out.append(f"[{min(end, total) - shown_end} more lines: view with start={shown_end + 1}]")
    return "\n".join(out)


def edit(state: RepairState, args: Mapping[str, Any]) -> str:
    path, new = args["path"], args["new"]
    text = state.files[path]
    has_range, has_old = "start" in args or "end" in args, "old" in args
    if has_range == has_old:
        raise ToolError("edit takes either start and end, or old (not both, not neither)")
    lines = text.split("\n")
    if lines[-1] == "":
        lines = lines[:-1]
    if has_old:
        count = text.count(args["old"])
        if count != 1:
            raise ToolError(f"old text occurs {count} times in {path}; it must occur once")
        at = text.index(args["old"])
        start = text.count("\n", 0, at) + 1
        updated = text.replace(args["old"], new, 1)
        end = start + n_lines(new) - 1 if new else start - 1
    else:
        if "start" not in args or "end" not in args:
            raise ToolError("edit by lines needs both start and end")
        start, end = args["start"], args["end"]
        if not start <= end <= len(lines):
            raise ToolError(f"bad line range {start}-{end}: {path} has {len(lines)} lines")
        body = new.split("\n") if new else []
        if body and body[-1] == "":
            body = body[:-1]
        updated = "\n".join(lines[: start - 1] + body + lines[end:]) + "\n"
        end = start + len(body) - 1
    if updated == text:
        raise ToolError(f"the edit leaves {path} unchanged")
    limit = state.task.config.max_file_chars
    if len(updated) > limit:
        raise ToolError(f"{path} would have {len(updated)} characters; at most {limit}")
    state.files[path] = updated
    out = [f"edited {path} ({n_lines(updated)} lines now)"]
    if end >= start:
        out.append(numbered(updated, start, end))
    if path == SOLUTION_FILE and not parses(updated):
        out.append(f"warning: {SOLUTION_FILE} does not parse")
    return "\n".join(out)


def run_tests(state: RepairState, args: Mapping[str, Any], runner: Runner) -> str:
    n_expected = state.task.n_visible
    job = Job(state.files[SOLUTION_FILE], state.files[TEST_FILE], n_expected)
    report = runner([job], True)[0].report
    return truncate(report, state.task.config.max_output_chars)


def submit(state: RepairState, args: Mapping[str, Any], runner: Runner) -> str:
    task, solution = state.task, state.files[SOLUTION_FILE]
    jobs = [
        Job(solution, task.visible_tests, task.n_visible),
        Job(solution, task.hidden_tests, task.n_hidden, test_file=HIDDEN_TEST_FILE),
    ]
    state.final = tuple(runner(jobs, False))
    state.submitted = True
    state.goal_adhered, broken = constraints_kept(task, state.files)
    n_pass = sum(e.n_pass for e in state.final)
    n_all = task.n_visible + task.n_hidden
    verdict = "passed" if state.solved else "failed"
    out = [f"submitted: {verdict}; {n_pass} of {n_all} tests pass (hidden tests included)"]
    if broken:
        out.append("constraint broken: " + "; ".join(broken))
    return "\n".join(out)


def write_code(state: RepairState, args: Mapping[str, Any], runner: Runner) -> str:
    task, code = state.task, args["code"]
    if len(code) > task.config.max_file_chars:
        raise ToolError(f"code has {len(code)} characters; at most {task.config.max_file_chars}")
    state.files[SOLUTION_FILE] = code if code.endswith("\n") else code + "\n"
    job = Job(state.files[SOLUTION_FILE], state.files[TEST_FILE], task.n_visible)
    visible = runner([job], True)[0]
    if visible.all_pass:
        return "The visible tests pass. " + submit(state, {}, runner)
    excerpt = truncate(failure_excerpt(visible.report), task.config.max_output_chars)
    return f"The tests still fail:\n```\n{excerpt}\n```\n{CODE_REPLY}"


MUTATING = frozenset({"edit", "write_code"})
