"""The code-repair tools and the text of their observations.

Calls (words after ``<call>``) and what they answer:
  * ``run``: ``pass P of N``, then per failing visible test (at most ``max_failures_shown``)
    ``fail Tk fn ( args ) want W got G`` or ``error Tk fn ( args ) Lj <message>``, then for the
    first failing test its value trace, one line per executed line of the called function:
    ``Lj <code> => value`` (assignment/return value, ``if`` condition 1/0, ``for`` iteration count;
    ``=> error`` marks the faulting line). With ``golden_trace`` on (``EnvConfig``), the first
    traced line whose value differs from the reference solution's on the same test gets
    ``want V`` appended (a test with intermediate assertions). A program that does not parse
    answers ``syntax error Lj <message>`` and the offending line.
    The answer ends with ``cursor Lj`` when it points at a line (the syntax error's line, the
    faulting line, else the first line marked ``want``): ``run`` moves the cursor there.
  * ``view``: the function listing; ``view NAME``: that function; ``view La Lb``: lines a..b.
  * ``edit La <words>``: replace line a; ``edit La Lb <line> <nl> <line> ...``: replace lines
    a..b by any number of lines (later line ids shift). ``edit <words>`` (no line id) replaces
    the cursor line. Answers ``ok`` and the new lines.
  * ``sub La OLD NEW ...``: replace the single occurrence of word OLD in line a by the word(s)
    NEW (``sub L4 b + b`` inserts a ``+`` before ``b``); ``sub OLD NEW ...`` does it on the
    cursor line.
  * ``submit``: run every test (hidden ones too) and check the rule; ends the episode.
An ``edit`` or ``sub`` that would leave the program as it is (the lines already there, a word
replaced by itself) is refused with ``error same Lk``, as an editor reports "no replacement
performed": the agent sees it made no progress, and the call counts as rejected.

The cursor spares a small model from copying line ids, which a sub-million-parameter model
trained for minutes on a CPU does not learn (docs/results.md); every tool still takes explicit
line ids.
"""

from __future__ import annotations

import dataclasses
import re

from agentrl_jax.envs.base import ToolContext, ToolError, ToolRegistry
from agentrl_jax.envs.coderepair.config import MAX_LINES
from agentrl_jax.envs.coderepair.evaluation import Evaluation, evaluate
from agentrl_jax.envs.coderepair.language import function_spans
from agentrl_jax.envs.coderepair.task import Task, render_lines, render_listing

_LINE_ID = re.compile(r"L(\d+)")
MAX_VIEW_LINES = 32


@dataclasses.dataclass
class RepairState:
    """Mutable episode state the tools act on."""

    task: Task
    lines: list[tuple[str, ...]]
    submitted: bool = False
    final: Evaluation | None = None
    goal_adhered: bool = True
    cursor: int = -1  # line that `run` last pointed at (-1: none)


def is_special(word: str) -> bool:
    """Whether ``word`` is a special token such as ``<nl>`` (operators like ``<=`` are not)."""
    return len(word) > 2 and word[0] == "<" and word[-1] == ">"


def line_arg(word: str, n_lines: int) -> int:
    """Parses a line id ``Lk`` in ``[0, n_lines)``. Raises ToolError."""
    m = _LINE_ID.fullmatch(word)
    if m is None:
        raise ToolError(f"bad line {word}")
    k = int(m.group(1))
    if not 0 <= k < n_lines:
        raise ToolError(f"line {word} out of range L0 L{n_lines - 1}")
    return k


def _code_words(words: list[str]) -> tuple[str, ...]:
    """Tool arguments as code words: digits glued into numbers. Raises ToolError on specials."""
    out: list[str] = []
    for w in words:
        if is_special(w):
            raise ToolError(f"unexpected {w}")
        if w.isdigit() and out and out[-1].isdigit():
            out[-1] += w  # code is read with digits glued into numbers
        else:
            out.append(w)
    return tuple(out)


def cursor_line(st: RepairState) -> int:
    """The cursor line of ``st``. Raises ToolError when ``run`` has not pointed at one."""
    if not 0 <= st.cursor < len(st.lines):
        raise ToolError("no cursor line give a line")
    return st.cursor


def _call_text(t) -> str:
    return f"{t.fn} ( " + " , ".join(str(a) for a in t.args) + " )"


def _line_text(lines, k: int) -> str:
    return render_lines(lines, k, k)[0] if 0 <= k < len(lines) else ""


def first_wrong_line(trace, golden) -> tuple[int, int] | None:
    """``(line, wanted value)`` of the first traced line whose value differs from ``golden``."""
    want = dict(golden)
    for k, v in sorted(trace):
        if k in want and want[k] != v:
            return k, want[k]
    return None


def format_run(
    ev: Evaluation, lines, max_failures: int, max_trace: int, golden: Evaluation | None = None
) -> tuple[str, int]:
    """Observation text of ``run`` for an evaluation of the visible tests, and the cursor line.

    Args:
      ev: the evaluation of the current program.
      lines: the current program.
      max_failures: failing tests listed.
      max_trace: trace lines shown for the first failing test.
      golden: the reference solution's evaluation on the same tests (``want`` markers), or None.

    Returns:
      ``(text, cursor)`` with ``cursor`` the line the answer points at, or -1.
    """
    if ev.syntax_error is not None:
        e = ev.syntax_error
        text = [f"syntax error L{e.line} {e.msg}", _line_text(lines, e.line)]
        cursor = e.line if 0 <= e.line < len(lines) else -1
        if cursor >= 0:
            text.append(f"cursor L{cursor}")
        return "\n".join(x for x in text if x), cursor
    out = [f"pass {ev.n_pass} of {len(ev.results)}"]
    failing = [r for r in ev.results if not r.passed]
    for r in failing[:max_failures]:
        tid = f"T{r.test.tid} {_call_text(r.test)}"
        if r.fault is None:
            out.append(f"fail {tid} want {r.test.want} got {r.got}")
        else:
            where = f"L{r.fault.line} " if r.fault.line >= 0 else ""
            out.append(f"error {tid} {where}{r.fault.msg}")
    cursor = -1
    if failing:
        first = failing[0]
        wrong = None
        if golden is not None and first.fault is None:
            ref = golden.results[ev.results.index(first)]
            wrong = first_wrong_line(first.trace, ref.trace)
        for k, v in sorted(first.trace)[:max_trace]:
            mark = f" want {wrong[1]}" if wrong is not None and k == wrong[0] else ""
            out.append(f"{_line_text(lines, k)} => {v}{mark}")
        if first.fault is not None and 0 <= first.fault.line < len(lines):
            out.append(f"{_line_text(lines, first.fault.line)} => error")
            cursor = first.fault.line
        elif wrong is not None:
            cursor = wrong[0]
    if cursor >= 0:
        out.append(f"cursor L{cursor}")
    return "\n".join(out), cursor


def constraint_kept(task: Task, lines) -> bool:
    """Whether ``lines`` honour the task's rule (see ``task`` module)."""
    kind, fn = task.constraint
    now, before = function_spans(lines), function_spans(task.original)
    if fn not in now:
        return False
    (s, e), (s0, e0) = now[fn], before[fn]
    if kind == "keep_signature":
        return tuple(lines[s]) == tuple(task.original[s0])
    return [tuple(x) for x in lines[s : e + 1]] == [tuple(x) for x in task.original[s0 : e0 + 1]]


@dataclasses.dataclass(frozen=True)
class RunTool:
    name: str = "run"
    min_args: int = 0
    max_args: int = 0
    mutates: bool = False

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        st: RepairState = ctx.state
        cfg = st.task.config
        ev = evaluate(st.lines, st.task.visible_tests, cfg.step_budget, ctx.deadline)
        golden = None
        if cfg.golden_trace and len(st.lines) == len(st.task.original) and ev.parses:
            golden = evaluate(
                st.task.original, st.task.visible_tests, cfg.step_budget, ctx.deadline
            )
        text, cursor = format_run(ev, st.lines, cfg.max_failures_shown, cfg.max_trace_lines, golden)
        if cursor >= 0:
            st.cursor = cursor
        return text


@dataclasses.dataclass(frozen=True)
class ViewTool:
    name: str = "view"
    min_args: int = 0
    max_args: int = 2
    mutates: bool = False

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        lines = ctx.state.lines
        if not args:
            return "\n".join(["functions :", *render_listing(lines)])
        if len(args) == 1 and not _LINE_ID.fullmatch(args[0]):
            spans = function_spans(lines)
            if args[0] not in spans:
                raise ToolError(f"no function {args[0]}")
            lo, hi = spans[args[0]]
        else:
            lo = line_arg(args[0], len(lines))
            hi = line_arg(args[-1], len(lines))
            if hi < lo:
                raise ToolError("bad range")
        hi = min(hi, lo + MAX_VIEW_LINES - 1)
        return "\n".join(render_lines(lines, lo, hi))


@dataclasses.dataclass(frozen=True)
class EditTool:
    name: str = "edit"
    min_args: int = 1
    max_args: int = -1
    mutates: bool = True

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        st: RepairState = ctx.state
        if not _LINE_ID.fullmatch(args[0]):
            args = [f"L{cursor_line(st)}", *args]
        lo = line_arg(args[0], len(st.lines))
        if len(args) >= 2 and _LINE_ID.fullmatch(args[1]):
            hi = line_arg(args[1], len(st.lines))
            if hi < lo:
                raise ToolError("bad range")
            body = args[2:]
        else:
            hi, body = lo, args[1:]
        new: list[tuple[str, ...]] = []
        cur: list[str] = []
        for w in [*body, "<nl>"]:
            if w == "<nl>":
                if cur:
                    new.append(_code_words(cur))
                cur = []
            else:
                cur.append(w)
        if hi == lo and not new:
            raise ToolError("edit needs a new line")
        if len(new) > st.task.config.max_edit_lines:
            raise ToolError(f"edit takes at most {st.task.config.max_edit_lines} lines")
        n_after = len(st.lines) - (hi - lo + 1) + len(new)
        if not 0 < n_after <= MAX_LINES:
            raise ToolError(f"program must have 1 to {MAX_LINES} lines")
        if st.lines[lo : hi + 1] == new:
            raise ToolError(f"same L{lo}")
        st.lines[lo : hi + 1] = new
        st.cursor = lo if new else -1
        shown = render_lines(st.lines, lo, lo + len(new) - 1) if new else []
        head = "ok" if len(new) == hi - lo + 1 else f"ok lines {len(st.lines)}"
        return "\n".join([head, *shown])


@dataclasses.dataclass(frozen=True)
class SubTool:
    name: str = "sub"
    min_args: int = 2
    max_args: int = -1
    mutates: bool = True

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        st: RepairState = ctx.state
        if not _LINE_ID.fullmatch(args[0]):
            args = [f"L{cursor_line(st)}", *args]
        k = line_arg(args[0], len(st.lines))
        if len(args) < 3:
            raise ToolError("sub needs OLD and NEW")
        old, new = args[1], _code_words(args[2:])
        words = st.lines[k]
        n = words.count(old)
        if n == 0:
            raise ToolError(f"L{k} has no {old}")
        if n > 1:
            raise ToolError(f"{old} occurs {n} times in L{k} use edit")
        pos = words.index(old)
        if new == (old,):
            raise ToolError(f"same L{k}")
        st.lines[k] = words[:pos] + new + words[pos + 1 :]
        return "ok " + _line_text(st.lines, k)


@dataclasses.dataclass(frozen=True)
class SubmitTool:
    name: str = "submit"
    min_args: int = 0
    max_args: int = 0
    mutates: bool = False

    def __call__(self, ctx: ToolContext, args: list[str]) -> str:
        st: RepairState = ctx.state
        ev = evaluate(st.lines, st.task.tests, st.task.config.step_budget, ctx.deadline)
        st.submitted = True
        st.final = ev
        st.goal_adhered = constraint_kept(st.task, st.lines)
        parts = ["submitted"]
        parts.append("pass" if ev.all_pass and st.goal_adhered else "fail")
        if not ev.all_pass:
            parts.append(
                f"tests {ev.n_pass} of {len(st.task.tests)}" if ev.parses else "syntax error"
            )
        if not st.goal_adhered:
            parts.append("rule broken")
        return " ".join(parts)


def default_registry() -> ToolRegistry:
    """The five code-repair tools."""
    return ToolRegistry([RunTool(), ViewTool(), EditTool(), SubTool(), SubmitTool()])
