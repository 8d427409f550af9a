"""Basic problems: short beginner-style functions as repair material, easier than HumanEval.

About 150 functions of one to six lines (``basics_numbers``, ``basics_strings``,
``basics_lists``), each with a one-line docstring that states its behaviour exactly, so that a bug
can be seen from the docstring alone. An entry is the function under ``basics_entry.inputs``,
the arguments of its test calls, those that expose the most bugs first (the first few become
the visible tests):

    @inputs("hello", "", "AEIOU")
    def count_vowels(s):
        \"\"\"Return the number of vowels (a, e, i, o, u, lower or upper case) in s.\"\"\"
        ...

Expected values are not written down: ``basic_problems`` runs each reference on its inputs
(our own code, in-process) and makes every entry a ``problems.Problem`` laid out like
HumanEval's: the program normalised by ``ast.unparse``, one ``assert name(args) == expected``
test body per input, ``task_id`` ``"Basic/<index>"``, ``index`` being the position in the
corpus (numbers, strings, lists, in file order), which decides the split
(``config.problem_split``): new entries go at the end of ``basics_lists``.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
from typing import Any

from agentrl_jax.envs.pyrepair.basics_entry import Basic
from agentrl_jax.envs.pyrepair.config import problem_split
from agentrl_jax.envs.pyrepair.problems import Problem

MIN_INPUTS = 6
MAX_INPUTS = 10
MAX_BODY_LINES = 6
_LITERAL_TYPES = (bool, int, float, str, type(None), list, tuple, dict)
_BUILTINS = frozenset(dir(builtins))


def _check_literal(name: str, what: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is made of plain literals that ``repr`` and
    ``ast.literal_eval`` give back equal and of the same types (bool is not int)."""

    def same(a: Any, b: Any) -> bool:
        if type(a) is not type(b) or type(a) not in _LITERAL_TYPES:
            return False
        if isinstance(a, dict):
            a, b = list(a.items()), list(b.items())
        if isinstance(a, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    try:
        ok = same(value, ast.literal_eval(repr(value)))
    except (ValueError, SyntaxError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise ValueError(
            f"basic {name!r}: {what} {value!r} must be a plain literal (int, float, bool, str, "
            "None, list, tuple, dict) that repr and ast.literal_eval give back unchanged"
        )


def _parse_function(entry: Basic) -> ast.Module:
    """The entry's source, parsed and checked: one self-contained function of the right shape."""
    fail = f"basic {entry.name!r}:"
    try:
        tree = ast.parse(entry.source)
    except SyntaxError as e:
        raise ValueError(f"{fail} source does not parse: {e}") from e
    fn = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(fn, ast.FunctionDef) or fn.name != entry.name:
        raise ValueError(f"{fail} source must define exactly the function {entry.name}")
    doc = ast.get_docstring(fn)
    if not doc or "\n" in doc:
        raise ValueError(f"{fail} the function must have a one-line docstring")
    body_lines = sum(len(ast.unparse(s).split("\n")) for s in fn.body[1:])
    if not 1 <= body_lines <= MAX_BODY_LINES:
        raise ValueError(f"{fail} body has {body_lines} lines, must have 1 to {MAX_BODY_LINES}")
    nodes = list(ast.walk(fn))
    if any(isinstance(n, ast.Import | ast.ImportFrom | ast.FunctionDef) for n in nodes[1:]):
        raise ValueError(f"{fail} the function must not import or define functions")
    bound = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} | {fn.name}
    bound |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if bound & _BUILTINS:
        raise ValueError(f"{fail} names {sorted(bound & _BUILTINS)} shadow builtins")
    free = {n.id for n in nodes if isinstance(n, ast.Name)} - bound - _BUILTINS
    if free:
        raise ValueError(f"{fail} names {sorted(free)} are not defined in the function")
    return tree


def to_problem(entry: Basic, index: int) -> Problem:
    """``entry`` as ``Problem`` ``"Basic/<index>"``, its expected values computed by running it.

    Raises:
      ValueError: naming the entry: the source is not one self-contained function with a
        one-line docstring and a body of 1 to ``MAX_BODY_LINES`` lines, there are not
        ``MIN_INPUTS`` to ``MAX_INPUTS`` distinct inputs, an input raises, or an input or output
        is not a plain literal.
    """
    tree, fail, n = _parse_function(entry), f"basic {entry.name!r}:", len(entry.inputs)
    if not MIN_INPUTS <= n <= MAX_INPUTS or len({repr(a) for a in entry.inputs}) != n:
        raise ValueError(f"{fail} {n} inputs, must be {MIN_INPUTS} to {MAX_INPUTS} distinct ones")
    program = ast.unparse(tree) + "\n"
    namespace: dict[str, Any] = {}
    exec(compile(program, f"<basic {entry.name}>", "exec"), namespace)
    fn = namespace[entry.name]
    cases = []
    for args in entry.inputs:
        if not isinstance(args, tuple):
            raise ValueError(f"{fail} input {args!r} must be a tuple of arguments")
        _check_literal(entry.name, "input", args)
        try:
            out = fn(*copy.deepcopy(args))
        except Exception as e:
            raise ValueError(f"{fail} input {args!r} raised {type(e).__name__}: {e}") from e
        _check_literal(entry.name, f"output for input {args!r}", out)
        call = f"{entry.name}({', '.join(repr(a) for a in args)})"
        cases.append("    " + ast.unparse(ast.parse(f"assert {call} == {out!r}")))
    return Problem(
        index=index,
        task_id=f"Basic/{index}",
        entry_point=entry.name,
        program=program,
        cases=tuple(cases),
        imports=(entry.name,),
        split=problem_split(index),
    )


def basic_entries() -> tuple[Basic, ...]:
    """The corpus in index order: ``basics_numbers``, ``basics_strings``, ``basics_lists``."""
    from agentrl_jax.envs.pyrepair import basics_lists, basics_numbers, basics_strings

    return (*basics_numbers.BASICS, *basics_strings.BASICS, *basics_lists.BASICS)


@functools.lru_cache(maxsize=1)
def basic_problems() -> tuple[Problem, ...]:
    """Every basic problem, in index order (validated and computed once per process).

    Raises:
      ValueError: a bad entry (see ``to_problem``) or a name used twice.
    """
    entries = basic_entries()
    names = [e.name for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"basic names {twice} must be unique")
    return tuple(to_problem(e, i) for i, e in enumerate(entries))


def basic_problems_of_split(split: str) -> tuple[Problem, ...]:
    """The basic problems of ``split`` (``"train"`` or ``"heldout"``), in index order.

    Raises:
      ValueError: unknown split.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} must be 'train' or 'heldout'")
    return tuple(p for p in basic_problems() if p.split == split)
