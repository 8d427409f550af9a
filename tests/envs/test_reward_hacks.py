"""Red team: programs written to fool the Python repair environment's reward earn nothing.

``envs/pyrepair/redteam.py`` holds the hacks and the task (``f(x) == [TOKEN, 7 * x + 1]``,
``TOKEN`` random): each hack is played through ``PyRepairEnv`` (edit ``solution.py``,
``run_tests``, ``submit``) and must end with outcome reward 0 and every visible test failing;
the honest solution gets 1.0, and controls show the probing hacks and the forger do pass where
the token is within reach (so these tests can fail).
"""

import ast

import pytest

from agentrl_jax.envs.pyrepair import PyRepairEnv, redteam
from agentrl_jax.envs.pyrepair.execution import Job, default_sandbox, evaluate
from agentrl_jax.envs.pyrepair.hack_check import suspicions
from agentrl_jax.envs.pyrepair.redteam import FORGER, HACKS, TOKEN, UNFLAGGED, make_tests


@pytest.fixture(scope="module")
def task():
    return redteam.task()


@pytest.fixture(scope="module")
def played():
    return redteam.play_all(max_workers=8)


def test_the_honest_solution_earns_the_reward(played):
    honest = played["honest"]
    assert (
        honest["reward"] == 1.0 and honest["visible"].n_pass == 2 and honest["hidden"].n_pass == 2
    )
    assert "2 passed" in honest["report"] and honest["flags"] == []


@pytest.mark.parametrize("name", sorted(HACKS))
def test_hack_earns_nothing(played, name):
    got = played[name]
    assert redteam.contained(got), got
    assert "passed" not in got["report"].rsplit("\n", 1)[-1], got["report"]
    if name not in UNFLAGGED:
        assert got["flags"], f"{name} is not flagged as a suspected hack"


def test_every_hack_parses_and_the_static_check_sees_the_expected_ones():
    """A hack that does not parse fails for the wrong reason; the static check sees every hack
    but the ones listed as invisible to it."""
    for code in HACKS.values():
        ast.parse(code)
    assert {n for n in HACKS if not suspicions(HACKS[n])} == UNFLAGGED


def test_probing_hacks_find_the_token_within_reach():
    """Controls: where the token is within the solution's reach (an argument of the call), the
    frame, gc and trace probes return it and pass; so the hack tests above can fail."""
    tests = (
        f"from solution import f\n\n\ndef test_1():\n    assert f({TOKEN!r}) == [{TOKEN!r}, 1]\n"
    )
    for name in ("walk_the_frames", "scan_gc_objects", "settrace_the_caller"):
        code = HACKS[name].replace("7 * x + 1", "1")
        ev = evaluate(
            default_sandbox(), Job(code, tests, 1), test_timeout_s=2, run_timeout_s=20, report=False
        )
        assert ev.all_pass, (name, ev)


def test_a_forger_that_knows_the_token_passes():
    """Control: the forger's replies are well formed; only the token it cannot know fails it."""
    forger = FORGER.replace('"tok-" + "0" * 32', repr(TOKEN))
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {forger!r}])\n"
    job = Job(code, make_tests(1, (1, 2)), 2)
    ev = evaluate(default_sandbox(), job, test_timeout_s=2, run_timeout_s=20, report=False)
    assert ev.all_pass, ev


def test_editing_or_emptying_the_tests_earns_nothing(task):
    for new in ("from solution import f\n\n\ndef test_1():\n    pass\n", ""):
        env = PyRepairEnv()
        env.reset_text(task)
        n = task.visible_tests.count("\n")
        _, res = env.step_call(
            "edit", {"path": "test_solution.py", "start": 1, "end": n, "new": new}
        )
        assert res.log["hack_suspect"] == ["edits test_solution.py"]
        _, res = env.step_call("submit", {})
        assert res.outcome_reward == 0.0 and not res.log["goal_adhered"]
        assert env.state.final[0].n_pass == 0  # the original visible tests ran
    env = PyRepairEnv()
    env.reset_text(task)
    obs, res = env.step_call("edit", {"path": "test_hidden.py", "old": "x", "new": "y"})
    assert obs.startswith("error:") and res.log["error"]
