"""Procedural programs: functions built from a few idioms, some calling earlier ones, plus tests.

Idioms (``TEMPLATES``): ``arith`` (a chain of arithmetic), ``sum`` (accumulate over a range),
``count`` (count matching indices), ``branch`` (two returns behind a comparison), ``clamp``
(cap a value), ``call`` (combine calls of earlier functions) and ``loopcall`` (sum a call over a
range). Constants are single digits, test arguments are in ``[0, 6]`` (the first in ``[1, 6]``)
and every expected value is within ``[-999, 999]`` (visible ones pairwise distinct), so
observations stay short. The recurring idioms are what a model can learn as a prior over
"normal" code, against which an injected bug stands out.
"""

from __future__ import annotations

import dataclasses
import random

from agentrl_jax.envs.coderepair.interpreter import Fault, Machine
from agentrl_jax.envs.coderepair.language import FUNCTION_NAMES, parse_program

TEMPLATES = ("arith", "sum", "count", "branch", "clamp", "call", "loopcall")
CALL_TEMPLATES = ("call", "loopcall")
ARG_MAX = 6
VALUE_MAX = 999


@dataclasses.dataclass(frozen=True)
class Test:
    """One unit test: ``fn(*args) == want``; ``tid`` is its index in the task's test list."""

    tid: int
    fn: str
    args: tuple[int, ...]
    want: int
    hidden: bool


def _k(rng: random.Random, lo: int = 1, hi: int = 9) -> str:
    return str(rng.randint(lo, hi))


def _call_words(rng: random.Random, callee: tuple[str, int], pool: list[str]) -> list[str]:
    name, arity = callee
    words = [name, "("]
    for j in range(arity):
        if j:
            words.append(",")
        words.append(rng.choice(pool))
    return words + [")"]


_OPS = ("+", "-", "*")


def _arith(rng, params, other, arity, callees):
    x, y = rng.sample(["x", "y", "z", "t", "u"], 2)
    return [
        [x, "=", "a", rng.choice(_OPS), _k(rng)],
        [y, "=", x, rng.choice(_OPS), other if arity == 2 else _k(rng)],
        ["return", y, rng.choice(("+", "-")), _k(rng)],
    ]


def _sum(rng, params, other, arity, callees):
    s, i = rng.choice(("s", "t", "r")), rng.choice(("i", "j", "k"))
    term = [i, rng.choice(("+", "*")), other if arity == 2 and rng.random() < 0.5 else _k(rng)]
    return [[s, "=", "0"], ["for", i, "in", "0", "to", "a"], [s, "=", s, "+", *term], ["end"],
            ["return", s]]  # fmt: skip


def _count(rng, params, other, arity, callees):
    c, i = rng.choice(("c", "n", "m")), rng.choice(("i", "j", "k"))
    cond = (
        [i, "%", _k(rng, 2, 4), "==", "0"]
        if rng.random() < 0.5
        else [i, rng.choice(("<", ">", "<=", ">=")), "b"]
    )
    return [[c, "=", "0"], ["for", i, "in", "0", "to", "a"], ["if", *cond],
            [c, "=", c, "+", "1"], ["end"], ["end"], ["return", c]]  # fmt: skip


def _branch(rng, params, other, arity, callees):
    return [
        ["if", "a", rng.choice(("<", ">", "<=", ">=")), "b"],
        ["return", "a", rng.choice(_OPS), "b", "+", _k(rng)],
        ["end"],
        ["return", "b", rng.choice(_OPS), _k(rng)],
    ]


def _clamp(rng, params, other, arity, callees):
    x = rng.choice(("x", "v", "w"))
    cap = _k(rng, 3, 9)
    return [[x, "=", "a", rng.choice(_OPS), other if arity == 2 else _k(rng)],
            ["if", x, ">", cap], [x, "=", cap], ["end"], ["return", x]]  # fmt: skip


def _call(rng, params, other, arity, callees):
    x, y = rng.sample(["x", "y", "p", "q"], 2)
    g = rng.choice(callees)
    h = rng.choice(callees)
    return [
        [x, "=", *_call_words(rng, g, [*params, _k(rng)])],
        [y, "=", x, rng.choice(("+", "-")), *_call_words(rng, h, [*params, x])],
        ["return", y, rng.choice(_OPS), _k(rng, 1, 3)],
    ]


def _loopcall(rng, params, other, arity, callees):
    s, i = rng.choice(("s", "t", "r")), rng.choice(("i", "j", "k"))
    g = rng.choice(callees)
    call = _call_words(rng, g, [i, "b"] if g[1] == 2 else [i])
    return [[s, "=", "0"], ["for", i, "in", "0", "to", "a"], [s, "=", s, "+", *call], ["end"],
            ["return", s]]  # fmt: skip


# idiom -> body builder ``(rng, params, other, arity, callees) -> lines``
_BODIES = {
    "arith": _arith,
    "sum": _sum,
    "count": _count,
    "branch": _branch,
    "clamp": _clamp,
    "call": _call,
    "loopcall": _loopcall,
}


def make_function(
    rng: random.Random, name: str, kind: str, callees: list[tuple[str, int]]
) -> tuple[list[list[str]], int]:
    """Lines (word lists) of one function of idiom ``kind`` and its arity.

    Raises:
      ValueError: for an unknown ``kind`` or a call idiom without callees.
    """
    if kind not in TEMPLATES:
        raise ValueError(f"kind={kind!r} must be one of {TEMPLATES}")
    if kind in CALL_TEMPLATES and not callees:
        raise ValueError(f"kind={kind!r} needs at least one callee")
    arity = rng.choice((1, 2)) if kind in ("arith", "sum", "clamp", "call") else 2
    params = ["a", "b"][:arity]
    body = _BODIES[kind](rng, params, params[-1], arity, callees)
    header = ["def", name, "("] + [
        w for j, p in enumerate(params) for w in ([","] if j else []) + [p]
    ]
    return [header + [")"], *body, ["end"]], arity


@dataclasses.dataclass(frozen=True)
class Repo:
    """A generated program before bug injection.

    Attributes:
      lines: the program, one word tuple per line.
      tested: names of the tested functions, in definition order.
      distractors: names of untested, uncalled functions.
      arity: ``name -> number of parameters``.
      tests: visible tests first, then hidden ones.
    """

    lines: tuple[tuple[str, ...], ...]
    tested: tuple[str, ...]
    distractors: tuple[str, ...]
    arity: dict[str, int]
    tests: tuple[Test, ...]


def _tests_for(
    rng: random.Random, machine: Machine, name: str, arity: int, n: int, n_visible: int
) -> list[tuple[tuple[int, ...], int]] | None:
    seen, out = set(), []
    for _ in range(8 * n + 8):
        args = tuple(rng.randint(1 if j == 0 else 0, ARG_MAX) for j in range(arity))
        if args in seen:
            continue
        seen.add(args)
        try:
            want = machine.call(name, args)
        except Fault:
            return None
        if abs(want) > VALUE_MAX:
            return None
        out.append((args, want))
        if len(out) == n:
            break
    if len(out) < n or (n_visible > 1 and len({w for _, w in out[:n_visible]}) < n_visible):
        return None  # equal visible outputs make bugs hard to see
    return out


def make_repo(
    rng: random.Random, n_functions: int, n_distractors: int, n_visible: int, n_hidden: int
) -> Repo:
    """Generates a program with tests; regenerates a function until its tests are well formed.

    Function ``k > 0`` calls earlier tested functions with probability 1/2 (the last one always,
    so every program with two or more functions has a call). Distractors are placed at random.
    """
    names = rng.sample(FUNCTION_NAMES, n_functions + n_distractors)
    tested, distractors = names[:n_functions], names[n_functions:]
    blocks: list[list[list[str]]] = []
    arity: dict[str, int] = {}
    cases_of: dict[str, list[tuple[tuple[int, ...], int]]] = {}
    for k, name in enumerate(tested):
        callees = [(f, arity[f]) for f in tested[:k]]
        must_call = k == n_functions - 1 and k > 0
        for _ in range(200):  # regenerate this function until its tests are well formed
            if callees and (must_call or rng.random() < 0.5):
                kind = rng.choice(CALL_TEMPLATES)
            else:
                kind = rng.choice(TEMPLATES[:5])
            lines, n_args = make_function(rng, name, kind, callees)
            flat = [tuple(w) for b in [*blocks, lines] for w in b]
            machine = Machine(parse_program(flat), budget=5000)
            cases = _tests_for(rng, machine, name, n_args, n_visible + n_hidden, n_visible)
            if cases is not None:
                break
        else:
            raise RuntimeError(f"could not generate function {name}")  # pragma: no cover
        blocks.append(lines)
        arity[name] = n_args
        cases_of[name] = cases
    for name in distractors:
        lines, arity[name] = make_function(rng, name, rng.choice(TEMPLATES[:5]), [])
        blocks.insert(rng.randint(0, len(blocks)), lines)
    tests: list[Test] = []
    for name in tested:
        for args, want in cases_of[name][:n_visible]:
            tests.append(Test(len(tests), name, args, want, False))
    for name in tested:
        for args, want in cases_of[name][n_visible:]:
            tests.append(Test(len(tests), name, args, want, True))
    flat = tuple(tuple(w) for b in blocks for w in b)
    return Repo(flat, tuple(tested), tuple(distractors), arity, tuple(tests))
