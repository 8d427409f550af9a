"""Bug injection: labelled single-line mutations of a generated program.

Bug types (``config.BUG_TYPES``) and their subtypes:
  * ``syntax``: ``eq`` (assignment ``=`` written ``==``), ``drop_paren`` (a ``)`` deleted),
    ``drop_op`` (a binary operator deleted);
  * ``logic``: ``operator`` (``+ - *`` swapped, or a comparison flipped), ``constant`` (a digit
    changed by at least 2), ``variable`` (a variable use replaced by another bound name);
  * ``off_by_one``: ``loop_start`` (``0 to`` -> ``1 to``), ``loop_end`` (``to E`` -> ``to E + 1``
    or ``E - 1``), ``compare`` (``<`` <-> ``<=``, ``>`` <-> ``>=``);
  * ``missing_dependency``: ``typo`` (a call to a misspelled, undefined function name).

Each bug keeps its own fix as a tool call: ``sub Lk BAD GOOD`` when the mutation replaced one
word that is unique in its line (four tokens), ``sub Lk W OP W`` / ``sub Lk W W )`` when it
dropped a word next to a word W unique in its line, else ``edit Lk <original line>``. Bugs never
touch ``def`` lines, distractor functions or the function named by a "do not modify" constraint, and
each bug alone makes at least one visible test fail.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from agentrl_jax.envs.coderepair.config import BUG_TYPES
from agentrl_jax.envs.coderepair.evaluation import evaluate
from agentrl_jax.envs.coderepair.generator import Test
from agentrl_jax.envs.coderepair.language import (
    PARAMS,
    TYPOS,
    LangSyntaxError,
    function_spans,
    is_name,
    parse_line,
)

_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "!=", "!=": "=="}
_OBO = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}


@dataclasses.dataclass(frozen=True)
class Bug:
    """One injected bug.

    Attributes:
      type: one of ``BUG_TYPES``.
      subtype: see the module docstring.
      line: line index.
      original: the line before injection (words).
      mutated: the line after injection (words).
      fix: the expert's tool call that repairs it, as words (``("sub", "L7", "-", "+")``).
    """

    type: str
    subtype: str
    line: int
    original: tuple[str, ...]
    mutated: tuple[str, ...]
    fix: tuple[str, ...]


def _sub(words: tuple[str, ...], pos: int, new: str) -> tuple[str, ...]:
    return words[:pos] + (new,) + words[pos + 1 :]


def _bound_before(lines: Sequence[tuple[str, ...]], start: int, line: int) -> list[str]:
    names = list(PARAMS[: sum(1 for w in lines[start] if w in PARAMS)])
    for k in range(start + 1, line):
        w = lines[k]
        if len(w) >= 2 and w[1] == "=" and w[0] not in names:
            names.append(w[0])
        if w and w[0] == "for" and w[1] not in names:
            names.append(w[1])
    return names


def bound_names(lines: Sequence[tuple[str, ...]], line: int) -> list[str]:
    """Variables bound before ``line`` in its function: parameters, then locals in order."""
    start = max(s for s, e in function_spans(lines).values() if s <= line <= e)
    return _bound_before(lines, start, line)


def _candidates(
    kind: str, lines: Sequence[tuple[str, ...]], k: int, start: int, rng: random.Random
) -> list[tuple[str, tuple[str, ...]]]:
    """(subtype, mutated line) candidates of bug type ``kind`` at line ``k``."""
    w = lines[k]
    out: list[tuple[str, tuple[str, ...]]] = []
    head = w[0]
    if kind == "syntax":
        if len(w) >= 3 and w[1] == "=":
            out.append(("eq", _sub(w, 1, "==")))
        if ")" in w:
            pos = len(w) - 1 - w[::-1].index(")")
            out.append(("drop_paren", w[:pos] + w[pos + 1 :]))
        for pos in range(2, len(w) - 1):
            if w[pos] in ("+", "-", "*", "%") and w[pos - 1] not in ("=", "(", ",", "to", "in"):
                out.append(("drop_op", w[:pos] + w[pos + 1 :]))
    elif kind == "logic":
        rhs0 = 2 if head not in ("return", "if", "for") else 1
        for pos in range(rhs0, len(w)):
            tok = w[pos]
            if tok in ("+", "-", "*") and w[pos - 1] not in ("=", "(", ",", "to", "in"):
                out.append(("operator", _sub(w, pos, rng.choice([o for o in "+-*" if o != tok]))))
            elif tok in _FLIP:
                out.append(("operator", _sub(w, pos, _FLIP[tok])))
            elif tok.isdigit() and head != "for":
                new = rng.choice([d for d in range(1, 10) if abs(d - int(tok)) >= 2])
                out.append(("constant", _sub(w, pos, str(new))))
            elif is_name(tok) and (pos + 1 >= len(w) or w[pos + 1] != "(") and head != "for":
                others = [n for n in _bound_before(lines, start, k) if n != tok]
                if others:
                    out.append(("variable", _sub(w, pos, rng.choice(others))))
    elif kind == "off_by_one":
        if head == "for" and len(w) >= 6:
            if w[3] == "0":
                out.append(("loop_start", _sub(w, 3, "1")))
            out.append(("loop_end", w + (rng.choice(("+", "-")), "1")))
        for pos, tok in enumerate(w):
            if tok in _OBO:
                out.append(("compare", _sub(w, pos, _OBO[tok])))
    elif kind == "missing_dependency":
        for pos in range(1, len(w) - 1):
            if w[pos] in TYPOS and w[pos + 1] == "(":
                out.append(("typo", _sub(w, pos, TYPOS[w[pos]])))
    return out


def repair_call(line: int, original: tuple[str, ...], mutated: tuple[str, ...]) -> tuple[str, ...]:
    """The shortest call that turns line ``mutated`` into ``original``: a one-word ``sub``, an
    inserting ``sub`` (a dropped word put back beside a neighbour that is unique in the line),
    else ``edit`` of the whole line."""
    if len(original) == len(mutated):
        diff = [p for p in range(len(original)) if original[p] != mutated[p]]
        if len(diff) == 1:
            bad, good = mutated[diff[0]], original[diff[0]]
            if mutated.count(bad) == 1:
                return ("sub", f"L{line}", bad, good)
    if len(original) == len(mutated) + 1:
        pos = next((p for p in range(len(mutated)) if original[p] != mutated[p]), len(mutated))
        if original[:pos] + original[pos + 1 :] == mutated:
            dropped = original[pos]
            if pos < len(mutated) and mutated.count(mutated[pos]) == 1:
                return ("sub", f"L{line}", mutated[pos], dropped, mutated[pos])
            if pos > 0 and mutated.count(mutated[pos - 1]) == 1:
                return ("sub", f"L{line}", mutated[pos - 1], mutated[pos - 1], dropped)
    return ("edit", f"L{line}", *original)


def _parses(words: tuple[str, ...], k: int) -> bool:
    try:
        parse_line(words, k)
        return True
    except LangSyntaxError:
        return False


def inject_bugs(
    rng: random.Random,
    lines: tuple[tuple[str, ...], ...],
    tests: Sequence[Test],
    eligible: Sequence[str],
    bug_types: Sequence[str],
    step_budget: int,
) -> tuple[tuple[tuple[str, ...], ...], tuple[Bug, ...]] | None:
    """Injects one bug per entry of ``bug_types`` into the functions named in ``eligible``.

    Args:
      rng: randomness (deterministic per task).
      lines: the correct program.
      tests: its tests (visible ones are used to check that each bug is observable).
      eligible: functions that may receive bugs.
      bug_types: one type per bug, each in ``BUG_TYPES``.
      step_budget: interpreter budget for the checks.

    Returns:
      ``(buggy lines, bugs)`` or ``None`` if this program cannot host these bugs.

    Raises:
      ValueError: for an unknown bug type.
    """
    for t in bug_types:
        if t not in BUG_TYPES:
            raise ValueError(f"bug type {t!r} must be one of {BUG_TYPES}")
    spans = function_spans(lines)
    visible = [t for t in tests if not t.hidden]
    body_lines = [(k, spans[f][0]) for f in eligible for k in range(spans[f][0] + 1, spans[f][1])]
    used: set[int] = set()
    bugs: list[Bug] = []
    out = list(lines)
    for kind in bug_types:
        options = [
            (sub, k, start, mut)
            for k, start in body_lines
            if k not in used
            for sub, mut in _candidates(kind, lines, k, start, rng)
        ]
        rng.shuffle(options)
        for sub, k, _, mut in options:
            if (kind == "syntax") == _parses(mut, k):
                continue  # syntax bugs must break the parse, the others must not
            trial = list(lines)
            trial[k] = mut
            if evaluate(trial, visible, step_budget).all_pass:
                continue  # invisible to the visible tests
            out[k] = mut
            used.add(k)
            bugs.append(Bug(kind, sub, k, lines[k], mut, repair_call(k, lines[k], mut)))
            break
        else:
            return None
    buggy = tuple(out)
    if evaluate(buggy, visible, step_budget).all_pass:
        return None  # pragma: no cover - each bug alone already fails a test
    return buggy, tuple(sorted(bugs, key=lambda b: b.line))
