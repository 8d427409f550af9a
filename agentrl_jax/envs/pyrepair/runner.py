"""The test runner that executes inside the sandbox; run as a script, never imported there.

``execution`` passes this file's source with ``python -c`` and arguments
``MODE NONCE JOBS TIMEOUT_S``:
``JOBS`` is a JSON file in the work directory holding a list of jobs
``{"solution": src, "tests": src, "test_file": name, "stop_at_first_failure": bool,
"timeout_s": float | null}`` (null: the run's ``TIMEOUT_S`` argument). Each job's
solution is executed as module ``solution`` and its tests as the test module; every
``test_*`` function runs in source order under a per-test time limit (``SIGALRM``), with its
stdout captured.

``MODE`` is ``report`` (one job: print a pytest-style report, ``--tb=short`` tracebacks limited to
the solution and test files) or ``batch`` (no report). Either way the last line of stdout is
``NONCE`` followed by the JSON list of job results ``{"outcomes": [...], "errors": [...],
"names": [...], "collect_error": str | null}``, outcome ``passed``/``failed``/``error`` and
error the exception's class name. The nonce marks the line as the runner's, not the program's;
code that inspects the runner's own memory could still forge it (the reward is checked against
mistakes, not against an adversarial program).
"""

import contextlib
import io
import json
import linecache
import os
import signal
import sys
import traceback
import types

CAPTURE_CHARS = 1000
WIDTH = 80


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout("test took longer than its time limit")


def _load(name, source, filename):
    # tracebacks read source lines through linecache, whatever the files on disk say
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def _short_tb(exc, files):
    """pytest ``--tb=short`` style: frames in ``files`` only, then ``E   Class: message``."""
    out = []
    for frame in traceback.extract_tb(exc.__traceback__):
        name = os.path.basename(frame.filename)
        if name in files:
            out.append(f"{name}:{frame.lineno}: in {frame.name}")
            if frame.line:
                out.append(f"    {frame.line}")
    lines = "".join(traceback.format_exception_only(exc)).rstrip().split("\n")
    if isinstance(exc, AssertionError) and not str(exc):
        lines = ["AssertionError: assert " + _assert_detail(exc)]
    out += [f"E   {line}" for line in lines if line.strip()]
    return out


def _assert_detail(exc):
    """``assert <left> <op> <right>`` with the values of a failed comparison, when simple."""
    import ast

    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame, line = tb.tb_frame, traceback.extract_tb(tb)[-1].line or ""
    try:
        node = ast.parse(line.strip()).body[0]
    except SyntaxError:
        return line.strip().removeprefix("assert ")
    if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)):
        return line.strip().removeprefix("assert ")
    test = node.test
    if len(test.ops) != 1:
        return ast.unparse(test)
    try:
        env = {**frame.f_globals, **frame.f_locals}
        left = eval(compile(ast.Expression(test.left), "<assert>", "eval"), env)
        right = eval(compile(ast.Expression(test.comparators[0]), "<assert>", "eval"), env)
    except Exception:  # noqa: BLE001 - re-evaluation is only for the message
        return ast.unparse(test)
    op = ast.unparse(ast.Compare(ast.Name("L"), test.ops, [ast.Name("R")])).split()[1:-1]
    return f"{_short_repr(left)} {' '.join(op)} {_short_repr(right)}"


def _short_repr(value):
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def run_job(job, timeout_s, report):
    files = ("solution.py", job["test_file"])
    result = {"names": [], "outcomes": [], "errors": [], "collect_error": None}
    failures = []
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        sys.modules.pop("solution", None)
        _load("solution", job["solution"], "solution.py")
        tests = _load("test_module", job["tests"], job["test_file"])
    except BaseException as e:  # noqa: BLE001 - any failure at import is a collection error
        signal.setitimer(signal.ITIMER_REAL, 0)
        result["collect_error"] = type(e).__name__
        if report:
            failures.append(("ERROR collecting " + job["test_file"], _short_tb(e, files), ""))
        return result, failures
    signal.setitimer(signal.ITIMER_REAL, 0)
    funcs = [
        f
        for name, f in vars(tests).items()
        if name.startswith("test_") and isinstance(f, types.FunctionType)
    ]
    funcs.sort(key=lambda f: f.__code__.co_firstlineno)
    for f in funcs:
        captured = io.StringIO()
        outcome, error = "passed", None
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            with contextlib.redirect_stdout(captured):
                f()
        except BaseException as e:  # noqa: BLE001 - a test's failure of any kind is its result
            outcome = "failed" if isinstance(e, AssertionError) else "error"
            error = type(e).__name__
            if report:
                failures.append((f.__name__, _short_tb(e, files), captured.getvalue()))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["names"].append(f.__name__)
        result["outcomes"].append(outcome)
        result["errors"].append(error)
        if outcome != "passed" and job.get("stop_at_first_failure"):
            break
    return result, failures


def print_report(job, result, failures, out):
    w = out.write
    w(" test run starts ".center(WIDTH, "=") + "\n")
    n = len(result["names"])
    if result["collect_error"]:
        w("collected 0 items / 1 error\n\n")
    else:
        marks = "".join("." if o == "passed" else "F" for o in result["outcomes"])
        w(f"collected {n} items\n\n{job['test_file']} {marks}\n")
    if failures:
        title = " ERRORS " if result["collect_error"] else " FAILURES "
        w("\n" + title.center(WIDTH, "=") + "\n")
        for name, lines, captured in failures:
            w(f" {name} ".center(WIDTH, "_") + "\n")
            w("\n".join(lines) + "\n")
            if captured:
                w(" Captured stdout call ".center(WIDTH, "-") + "\n")
                w(captured[:CAPTURE_CHARS] + "\n")
    counts = []
    n_fail = sum(o != "passed" for o in result["outcomes"])
    if n_fail:
        counts.append(f"{n_fail} failed")
    if n - n_fail:
        counts.append(f"{n - n_fail} passed")
    if result["collect_error"]:
        counts.append("1 error")
    summary = f" {', '.join(counts) or 'no tests ran'} "  # no time: observations are reproducible
    w("\n" + summary.center(WIDTH, "=") + "\n")


def main():
    mode, nonce, jobs_file, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    with open(jobs_file) as f:
        jobs = json.load(f)
    os.remove(jobs_file)
    sys.path.insert(0, os.getcwd())
    stdout = sys.stdout
    results = []
    for job in jobs:
        limit = job.get("timeout_s") or timeout_s
        result, failures = run_job(job, limit, mode == "report")
        if mode == "report":
            print_report(job, result, failures, stdout)
        results.append(result)
    stdout.write("\n" + nonce + " " + json.dumps(results) + "\n")
    stdout.flush()


if __name__ == "__main__":
    main()
