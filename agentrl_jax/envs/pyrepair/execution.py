"""Running a solution's tests in the sandbox and reading the results back.

Every execution of a solution (the agent's ``run_tests`` and ``submit``, the visible-test
evaluation behind the process signals, and the validation of generated tasks) goes through
``evaluate`` or ``evaluate_batch``, which run ``judge.py`` in a ``Sandbox``: the jobs (hidden
tests included) reach the judge on its stdin, a memory file, and the results come back on the
sandbox's private channel, which the solution's process never holds (see ``judge``); what the
run prints is never read for results. A run that a limit stopped (time, memory, output) or whose
judge did not answer comes back as an ``Evaluation`` whose tests all failed and whose report
says why.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import marshal
import pathlib
import sys
import threading
from collections.abc import Sequence

from agentrl_jax.envs.pyrepair.report import render
from agentrl_jax.envs.sandbox import Limits, Result, Sandbox

JUDGE = (pathlib.Path(__file__).parent / "judge.py").read_text()
PLAIN = (pathlib.Path(__file__).parent / "plain.py").read_text()
# An interpreter of the trainer's Python version runs the judge compiled here (marshal's code
# format is fixed within a version): compiling it in every run costs more than the run's tests.
_COMPILED = marshal.dumps(compile(JUDGE, "judge.py", "exec")).hex()
_BOOT = "import marshal, sys; exec(marshal.loads(bytes.fromhex(sys.argv[1])))"
SANDBOX_LIMITS = Limits(cpu_s=30, address_space_bytes=1 << 30, n_procs=32, output_bytes=4 << 20)

_default: Sandbox | None = None
_default_lock = threading.Lock()


def default_sandbox() -> Sandbox:
    """The process-wide sandbox the environment uses unless given one (created on first use).

    Raises:
      SandboxUnavailable: the host cannot isolate a run.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = Sandbox(SANDBOX_LIMITS)
        return _default


def parses(source: str) -> bool:
    """Whether ``source`` is valid Python (checked on the host, nothing is executed)."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The results of one test module run against one solution.

    Attributes:
      n_expected: tests the module defines (what "all pass" needs).
      names, outcomes, errors: per test run: ``test_k``, ``passed``/``failed``/``error`` and the
        exception class name (None when passed).
      collect_error: exception class that stopped the import of solution or tests, or None.
      parses: the solution is valid Python.
      stopped: the sandbox limit that ended the run (``Result.killed_by``), or None.
      report: the pytest-style text (empty for batch runs).
      sandbox_s: wall-clock seconds of the sandboxed run.
    """

    n_expected: int
    names: tuple[str, ...] = ()
    outcomes: tuple[str, ...] = ()
    errors: tuple[str | None, ...] = ()
    collect_error: str | None = None
    parses: bool = True
    stopped: str | None = None
    report: str = ""
    sandbox_s: float = 0.0

    @property
    def n_pass(self) -> int:
        return sum(o == "passed" for o in self.outcomes)

    @property
    def all_pass(self) -> bool:
        return (
            self.collect_error is None
            and self.stopped is None
            and (self.n_pass == self.n_expected == len(self.outcomes))
        )

    @property
    def any_fail(self) -> bool:
        return not self.all_pass

    @property
    def error_classes(self) -> frozenset[str]:
        """Exception classes present (wrong answers, ``AssertionError``, are not errors)."""
        if not self.parses:
            return frozenset({"SyntaxError"})
        found = {e for e in self.errors if e not in (None, "AssertionError")}
        if self.collect_error:
            found.add(self.collect_error)
        if self.stopped:
            found.add(f"limit:{self.stopped}")
        return frozenset(found)


@dataclasses.dataclass(frozen=True)
class Job:
    """One solution and one test module to run (``test_file`` names the module in reports;
    ``timeout_s``, when set, replaces the batch's per-test limit for this job)."""

    solution: str
    tests: str
    n_expected: int
    test_file: str = "test_solution.py"
    stop_at_first_failure: bool = False
    timeout_s: float | None = None


def evaluate_batch(
    sandbox: Sandbox,
    jobs: Sequence[Job],
    *,
    test_timeout_s: float,
    run_timeout_s: float,
    report: bool = False,
) -> list[Evaluation]:
    """Runs ``jobs`` in one sandboxed process; one ``Evaluation`` per job.

    With ``report`` (one job only) the job's files are written to the work directory and the
    evaluation carries the pytest-style report.

    Raises:
      ValueError: ``report`` with more than one job, or no jobs.
      SandboxUnavailable: the sandbox cannot run.
    """
    if not jobs or (report and len(jobs) != 1):
        raise ValueError(f"jobs must be non-empty (exactly one with report), got {len(jobs)}")
    request = {
        "jobs": [
            {
                "solution": j.solution,
                "tests": j.tests,
                "test_file": j.test_file,
                "stop_at_first_failure": j.stop_at_first_failure,
                "timeout_s": j.timeout_s,
            }
            for j in jobs
        ],
        "test_timeout_s": test_timeout_s,
        "report": report,
    }
    compiled = sandbox.layout.version == sys.version_info[:2]
    argv = ["python", "-I", "-S", "-c", *((_BOOT, _COMPILED) if compiled else (JUDGE,)), PLAIN]
    stdin = json.dumps(request).encode()
    res = sandbox.run({}, argv, run_timeout_s, stdin=stdin, channel=True)
    return _read(res, jobs, report)


def _results(res: Result, n_jobs: int) -> list[dict] | None:
    """The judge's job results from the channel, or None (a limit stopped the run, or the
    channel does not hold one well-formed result per job)."""
    if res.killed_by is not None:
        return None
    try:
        results = json.loads(res.channel)
    except (ValueError, RecursionError):
        return None
    if not isinstance(results, list) or len(results) != n_jobs:
        return None
    try:
        if all(len(r["names"]) == len(r["outcomes"]) == len(r["errors"]) for r in results):
            return results
    except (KeyError, TypeError):
        pass
    return None


def _read(res: Result, jobs: Sequence[Job], report: bool) -> list[Evaluation]:
    results = _results(res, len(jobs))
    if results is None:
        text = _stopped_text(res)
        return [
            Evaluation(
                n_expected=j.n_expected,
                parses=parses(j.solution),
                stopped=res.killed_by or "crash",
                report=text if report else "",
                sandbox_s=res.wall_s,
            )
            for j in jobs
        ]
    return [
        Evaluation(
            n_expected=j.n_expected,
            names=tuple(r["names"]),
            outcomes=tuple(r["outcomes"]),
            errors=tuple(r["errors"]),
            collect_error=r["collect_error"],
            parses=parses(j.solution),
            report=render(j.test_file, r) if report else "",
            sandbox_s=res.wall_s,
        )
        for j, r in zip(jobs, results)
    ]


def _stopped_text(res: Result) -> str:
    if res.killed_by == "timeout":
        why = "the run took longer than its time limit"
    elif res.killed_by is not None:
        why = f"the run hit its {res.killed_by} limit"
    else:
        why = f"the judge gave no results (exit status {res.returncode})"
    lines = [f"tests stopped: {why}"]
    err = res.stderr.strip()
    if err:
        lines += ["stderr (last lines):", *err.split("\n")[-10:]]
    return "\n".join(lines)


def evaluate(
    sandbox: Sandbox, job: Job, *, test_timeout_s: float, run_timeout_s: float, report: bool
) -> Evaluation:
    """``evaluate_batch`` of one job."""
    return evaluate_batch(
        sandbox, [job], test_timeout_s=test_timeout_s, run_timeout_s=run_timeout_s, report=report
    )[0]
