"""The pytest-style report of one test run, rendered on the host from the judge's results.

The judge (``judge.py``, in the sandbox) sends structured results: test names, outcomes and,
for a report run, each failure's ``[title, traceback lines, captured output]``. The text the
agent reads is made here, so nothing the solution prints is laid out as a result line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

CAPTURE_CHARS = 1000
WIDTH = 80


def render(test_file: str, result: Mapping) -> str:
    """The report of one job's ``result`` (``judge.run_job``'s dict), pytest ``--tb=short``
    style, without timings (observations are reproducible)."""
    out: list[str] = [" test run starts ".center(WIDTH, "=")]
    outcomes: Sequence[str] = result["outcomes"]
    n = len(result["names"])
    if result["collect_error"]:
        out.append("collected 0 items / 1 error\n")
    else:
        marks = "".join("." if o == "passed" else "F" for o in outcomes)
        out += [f"collected {n} items\n", f"{test_file} {marks}"]
    failures = result.get("failures") or []
    if failures:
        title = " ERRORS " if result["collect_error"] else " FAILURES "
        out.append("\n" + title.center(WIDTH, "="))
        for name, lines, captured in failures:
            out.append(f" {name} ".center(WIDTH, "_"))
            out.append("\n".join(lines))
            if captured:
                out.append(" Captured stdout call ".center(WIDTH, "-"))
                out.append(captured[:CAPTURE_CHARS])
    counts = []
    n_fail = sum(o != "passed" for o in outcomes)
    if n_fail:
        counts.append(f"{n_fail} failed")
    if n - n_fail:
        counts.append(f"{n - n_fail} passed")
    if result["collect_error"]:
        counts.append("1 error")
    out.append("\n" + f" {', '.join(counts) or 'no tests ran'} ".center(WIDTH, "="))
    return "\n".join(out)
