"""Running a program's tests and summarising the result (used by tools, rewards and bug checks).

``evaluate`` parses the program once and runs each test in the interpreter with a per-test
instruction budget and a shared wall-clock deadline. ``Evaluation.error_classes`` is the set of
error classes present (``syntax`` or the interpreter's fault kinds): process rewards fire when one
disappears.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agentrl_jax.envs.coderepair.generator import Test
from agentrl_jax.envs.coderepair.interpreter import Fault, Machine
from agentrl_jax.envs.coderepair.language import LangSyntaxError, parse_program


@dataclasses.dataclass(frozen=True)
class TestResult:
    """Result of one test: ``passed``; ``got`` (value) or ``fault``; the top frame's trace."""

    test: Test
    passed: bool
    got: int | None
    fault: Fault | None
    trace: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """All test results of one program, or its syntax error."""

    syntax_error: LangSyntaxError | None
    results: tuple[TestResult, ...]

    @property
    def parses(self) -> bool:
        return self.syntax_error is None

    @property
    def n_pass(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def all_pass(self) -> bool:
        return self.parses and all(r.passed for r in self.results)

    @property
    def error_classes(self) -> frozenset[str]:
        if self.syntax_error is not None:
            return frozenset({"syntax"})
        return frozenset(r.fault.kind for r in self.results if r.fault is not None)


def evaluate(
    lines: Sequence[Sequence[str]],
    tests: Sequence[Test],
    step_budget: int,
    deadline: float = float("inf"),
) -> Evaluation:
    """Runs ``tests`` against the program ``lines``.

    Args:
      lines: the program, one word sequence per line.
      tests: the tests to run, in order.
      step_budget: interpreter instructions allowed per test.
      deadline: ``time.monotonic()`` after which remaining work is a ``timeout`` fault.

    Returns:
      An ``Evaluation``; never raises for bad programs.
    """
    try:
        funcs = parse_program(lines)
    except LangSyntaxError as e:
        return Evaluation(e, ())
    machine = Machine(funcs, step_budget, deadline)
    results = []
    for t in tests:
        try:
            got = machine.call(t.fn, t.args)
            results.append(TestResult(t, got == t.want, got, None, tuple(machine.trace.items())))
        except Fault as f:
            results.append(TestResult(t, False, None, f, tuple(machine.trace.items())))
    return Evaluation(None, tuple(results))
