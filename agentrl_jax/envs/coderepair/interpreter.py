"""Interpreter of the repair language, with an instruction budget and a wall-clock deadline.

Model-written code never runs as Python: it is walked here, one statement (or call) per
instruction. Faults are ``Fault(line, kind, msg)`` with ``kind`` one of ``FAULT_KINDS``; the
process rewards use the kind as the "error class". The first frame (the function a test calls)
records a per-line value trace: assignments and returns record their value, ``if`` its
condition (1/0), ``for`` its iteration count (last execution of each line wins).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agentrl_jax.envs.coderepair.language import TYPO_TO_NAME, Function

FAULT_KINDS = ("undefined", "arity", "division", "timeout", "overflow", "recursion", "unbound")
VALUE_LIMIT = 10**9
MAX_DEPTH = 32


class Fault(Exception):
    """A runtime error at ``line`` of class ``kind``; ``msg`` is made of vocabulary words."""

    def __init__(self, line: int, kind: str, msg: str):
        super().__init__(f"L{line} {msg}")
        self.line = line
        self.kind = kind
        self.msg = msg


class _Return(Exception):
    def __init__(self, value: int):
        self.value = value


def _did_you_mean(name: str, funcs: dict[str, Function]) -> str:
    base = TYPO_TO_NAME.get(name)
    if base in funcs:
        return f" did you mean {base}"
    close = [f for f in funcs if f.startswith(name[:2])]
    return f" did you mean {close[0]}" if close else ""


class Machine:
    """Runs calls against a parsed program.

    Args:
      funcs: functions in definition order.
      budget: instructions allowed per ``call`` (statements plus calls).
      deadline: ``time.monotonic()`` value after which the run is a ``timeout`` fault.
    """

    def __init__(self, funcs: Sequence[Function], budget: int, deadline: float = float("inf")):
        self.funcs = {f.name: f for f in funcs}
        self.budget = budget
        self.deadline = deadline
        self.steps = 0
        self.trace: dict[int, int] = {}

    def call(self, name: str, args: Sequence[int]) -> int:
        """Calls ``name(*args)`` from the top level; resets the budget and the trace.

        Raises:
          Fault: on any runtime error (including ``timeout``).
        """
        self.steps = 0
        self.trace = {}
        return self._call(name, list(args), 0, -1)

    def _tick(self, line: int) -> None:
        self.steps += 1
        if self.steps > self.budget:
            raise Fault(line, "timeout", "timeout")
        if self.steps & 255 == 0 and time.monotonic() > self.deadline:
            raise Fault(line, "timeout", "timeout")

    def _call(self, name: str, args: list[int], depth: int, line: int) -> int:
        self._tick(line)
        fn = self.funcs.get(name)
        if fn is None:
            raise Fault(
                line, "undefined", f"undefined function {name}{_did_you_mean(name, self.funcs)}"
            )
        if len(args) != len(fn.params):
            raise Fault(
                line, "arity", f"function {name} takes {len(fn.params)} args got {len(args)}"
            )
        if depth >= MAX_DEPTH:
            raise Fault(line, "recursion", "recursion too deep")
        env = dict(zip(fn.params, args))
        try:
            self._block(fn.body, env, depth + 1)
        except _Return as r:
            return r.value
        return 0

    def _record(self, depth: int, line: int, value: int) -> None:
        if depth == 1:
            self.trace[line] = value

    def _block(self, body: tuple, env: dict[str, int], depth: int) -> None:
        for st in body:
            kind, line = st[0], st[1]
            self._tick(line)
            if kind == "set":
                v = self._eval(st[3], env, depth, line)
                env[st[2]] = v
                self._record(depth, line, v)
            elif kind == "ret":
                v = self._eval(st[2], env, depth, line)
                self._record(depth, line, v)
                raise _Return(v)
            elif kind == "if":
                c = self._eval(st[2], env, depth, line)
                self._record(depth, line, int(c != 0))
                self._block(st[3] if c != 0 else st[4], env, depth)
            elif kind == "for":
                lo = self._eval(st[3], env, depth, line)
                hi = self._eval(st[4], env, depth, line)
                self._record(depth, line, max(hi - lo, 0))
                for i in range(lo, hi):
                    env[st[2]] = i
                    self._block(st[5], env, depth)
                    self._tick(line)

    def _eval(self, e: tuple, env: dict[str, int], depth: int, line: int) -> int:
        tag = e[0]
        if tag == "n":
            return e[1]
        if tag == "v":
            try:
                return env[e[1]]
            except KeyError:
                raise Fault(line, "unbound", f"undefined variable {e[1]}") from None
        if tag == "c":
            args = [self._eval(a, env, depth, line) for a in e[2]]
            return self._call(e[1], args, depth, line)
        if tag == "u":
            v = self._eval(e[2], env, depth, line)
            return -v if e[1] == "-" else int(v == 0)
        op = e[1]
        a = self._eval(e[2], env, depth, line)
        if op == "and":
            return int(a != 0 and self._eval(e[3], env, depth, line) != 0)
        if op == "or":
            return int(a != 0 or self._eval(e[3], env, depth, line) != 0)
        b = self._eval(e[3], env, depth, line)
        if op == "+":
            v = a + b
        elif op == "-":
            v = a - b
        elif op == "*":
            v = a * b
        elif op in ("//", "%"):
            if b == 0:
                raise Fault(line, "division", "division by zero")
            v = a // b if op == "//" else a % b
        elif op == "<":
            v = int(a < b)
        elif op == "<=":
            v = int(a <= b)
        elif op == ">":
            v = int(a > b)
        elif op == ">=":
            v = int(a >= b)
        elif op == "==":
            v = int(a == b)
        else:
            v = int(a != b)
        if abs(v) > VALUE_LIMIT:
            raise Fault(line, "overflow", "value too large")
        return v
