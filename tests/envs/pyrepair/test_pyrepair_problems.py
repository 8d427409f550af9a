"""HumanEval problems as repair material, and sandboxed test runs."""

import pytest

from agentrl_jax.envs.pyrepair.config import problem_split
from agentrl_jax.envs.pyrepair.execution import Job, default_sandbox, evaluate, evaluate_batch
from agentrl_jax.envs.pyrepair.problems import (
    load_problems,
    problems_of_split,
    render_tests,
    split_check,
)

TESTS = """
METADATA = {}


def check(candidate):
    import math
    assert candidate(1) == 2
    assert True, "always"
    x = 3
    assert candidate(x) == helper(x)
    for k in range(2):
        assert candidate(k) > 0
"""


def test_split_check_makes_one_test_per_case_with_its_setup():
    cases, imports = split_check(TESTS, "inc", "def helper(x):\n    return x + 1\n")
    assert cases == [
        "    import math\n    assert inc(1) == 2",
        "    import math\n    x = 3\n    assert inc(x) == helper(x)",
        "    import math\n    x = 3\n    for k in range(2):\n        assert inc(k) > 0",
    ]
    assert imports == ["inc", "helper"]
    with pytest.raises(ValueError, match="check"):
        split_check("x = 1", "inc", "")


def test_problems_and_fixed_split():
    problems = load_problems()
    assert len(problems) == 160  # 4 of 164 have a single (randomised) check
    assert all(len(p.cases) >= 2 for p in problems)
    held = problems_of_split("heldout")
    assert {p.index % 5 for p in held} == {4} and len(held) == 31
    assert not {p.task_id for p in held} & {p.task_id for p in problems_of_split("train")}
    assert problem_split(9) == "heldout" and problem_split(10) == "train"
    with pytest.raises(ValueError, match="split"):
        problems_of_split("test")


def test_render_tests():
    p = load_problems()[0]
    assert render_tests(p, [0], first_number=4) == (
        "from solution import has_close_elements\n\n\n"
        "def test_4():\n"
        "    assert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
    )
    assert p.n_visible(3) == 3 and p.n_visible(10) == len(p.cases) // 2


SOLUTION = "def inc(x):\n    return x + 1\n"
TEST_FILE = "from solution import inc\n\n\ndef test_1():\n    assert inc(1) == 2\n\n\ndef test_2():\n    assert inc(2) == 3\n"  # noqa: E501


def _eval(solution, report=True, **kw):
    job = Job(solution, TEST_FILE, 2, **kw)
    return evaluate(default_sandbox(), job, test_timeout_s=0.5, run_timeout_s=10, report=report)


def test_passing_failing_and_crashing_solutions():
    ok = _eval(SOLUTION)
    assert ok.all_pass and ok.outcomes == ("passed", "passed") and "2 passed" in ok.report
    wrong = _eval(SOLUTION.replace("+ 1", "+ 2"))
    assert wrong.outcomes == ("failed", "failed") and wrong.error_classes == frozenset()
    assert "E   AssertionError: assert 3 == 2" in wrong.report
    assert "test_solution.py:5: in test_1" in wrong.report
    crash = _eval("def inc(x):\n    return [][x]\n")
    assert crash.error_classes == {"IndexError"} and "solution.py:2: in inc" in crash.report
    broken = _eval("def inc(x:\n    return x\n")
    assert not broken.parses and broken.collect_error == "SyntaxError"
    assert broken.error_classes == {"SyntaxError"} and "ERROR collecting" in broken.report


def test_hanging_test_times_out_and_later_tests_still_run():
    ev = _eval("def inc(x):\n    while x == 1:\n        pass\n    return x + 1\n")
    assert ev.outcomes == ("error", "passed") and ev.errors[0] == "TestTimeout"


def test_a_solution_cannot_fake_its_results():
    forged = 'import os\nprint("\\nabc [{}]")\nos._exit(0)\n'
    ev = _eval(forged)
    assert not ev.all_pass and ev.collect_error == "SolutionExited" and ev.n_pass == 0
    bad_exit = _eval("import sys\nsys.exit(0)\n")
    assert not bad_exit.all_pass


def test_batch_runs_each_job_separately_and_stops_early():
    jobs = [
        Job(SOLUTION, TEST_FILE, 2),
        Job(SOLUTION.replace("+ 1", "+ 0"), TEST_FILE, 2, stop_at_first_failure=True),
    ]
    good, bad = evaluate_batch(default_sandbox(), jobs, test_timeout_s=0.5, run_timeout_s=10)
    assert good.all_pass and bad.outcomes == ("failed",) and bad.report == ""
    with pytest.raises(ValueError, match="jobs"):
        evaluate_batch(default_sandbox(), jobs, test_timeout_s=1, run_timeout_s=5, report=True)
