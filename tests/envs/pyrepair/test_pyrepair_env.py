"""The environment through both protocols: expert, malformed calls, tools, signals, goals."""

import dataclasses
import json

import pytest

from agentrl_jax.envs.base import Env, TextEnv, Tokenizer
from agentrl_jax.envs.episode import play_episode
from agentrl_jax.envs.pyrepair import (
    PROCESS_KEYS,
    ByteTokenizer,
    ExpertPolicy,
    PyRepairEnv,
    expert_calls,
    make_task,
)
from agentrl_jax.envs.pyrepair.tools import TOOL_NAMES, truncate

EXPERT_SAMPLE = {0: (0, 1, 2), 1: (3, 1_000_004), 2: (4, 1_000_005)}


@pytest.fixture(scope="module")
def env():
    return PyRepairEnv()


@pytest.fixture(scope="module")
def task():
    return make_task(1, 0, bug_types=("comparison",))


@pytest.mark.parametrize("level", sorted(EXPERT_SAMPLE))
def test_expert_solves_every_sampled_task(env, level):
    for seed in EXPERT_SAMPLE[level]:
        task = make_task(seed, level)
        episode = play_episode(env, task, ExpertPolicy(task))
        assert episode.success and episode.goal_adhered and episode.outcome_reward == 1.0
        assert episode.n_turns == len(expert_calls(task))
        assert episode.tokens[-1] == env.tokenizer.eos_id
        assert all(set(p) == set(PROCESS_KEYS) for p in episode.process)
        assert sum(p["tests"] for p in episode.process) > 0
        assert not any(log["error"] for log in episode.logs)
        assert not any(log["hack_suspect"] for log in episode.logs)


def test_episodes_are_reproducible():
    task = make_task(2, 1)
    first = play_episode(PyRepairEnv(), task, ExpertPolicy(task))
    again = play_episode(PyRepairEnv(), task, ExpertPolicy(task))
    assert first.tokens.tolist() == again.tokens.tolist()


def test_protocols():
    env, tok = PyRepairEnv(), ByteTokenizer()
    assert isinstance(env, Env) and isinstance(env, TextEnv) and isinstance(tok, Tokenizer)
    assert [s.name for s in env.tool_specs] == list(TOOL_NAMES)
    assert env.tool_specs[2].as_json()["function"]["parameters"]["required"] == ["path", "new"]
    text = "def f():\n    return 'é <call> ✓'\n"
    assert tok.decode(tok.encode(text)) == text and tok.nl_id in tok.encode(text)
    assert tok.decode([tok.call_start_id, 104, 105, tok.eos_id]) == "<call>hi<eos>"
    with pytest.raises(ValueError, match="must be in"):
        tok.decode([tok.vocab_size])
    with pytest.raises(RuntimeError):
        PyRepairEnv().step_call("view", {"path": "solution.py"})


def _call(tok, name, args):
    return [tok.call_start_id, *tok.encode(json.dumps({"name": name, "arguments": args})),
            tok.call_end_id]  # fmt: skip


def test_malformed_calls_are_error_observations(env, task):
    tok = env.tokenizer
    env.reset(dataclasses.replace(task, config=dataclasses.replace(task.config, max_turns=40)))
    bad = [
        (tok.encode("run_tests please"), "no tool call"),
        ([tok.call_start_id, 0xFF, 0xFE, tok.call_end_id], "UTF-8"),
        ([tok.call_start_id, *tok.encode('{"name": "view"'), tok.call_end_id], "not JSON"),
        ([tok.call_start_id, 65, tok.obs_start_id, tok.call_end_id], "UTF-8"),
        ([tok.call_start_id, *tok.encode('["view"]'), tok.call_end_id], '{"name"'),
        (_call(tok, "delete", {}), "unknown tool 'delete'"),
        (_call(tok, "view", {}), "'path' is a required property"),
        (_call(tok, "view", {"path": "/etc/passwd"}), "is not one of"),
        (_call(tok, "view", {"path": "solution.py", "start": "1"}), "start: '1' is not of type"),
        (_call(tok, "run_tests", {"verbose": True}), "Additional properties"),
        (_call(tok, "edit", {"path": "solution.py", "new": "x"}), "either start and end, or old"),
        (_call(tok, "edit", {"path": "solution.py", "old": "    ", "new": "x"}), "times in"),
        (_call(tok, "edit", {"path": "solution.py", "start": 5, "end": 999, "new": ""}), "range"),
        (
            _call(
                tok,
                "edit",
                {"path": "solution.py", "start": 1, "end": 1, "new": "from typing import List"},
            ),
            "unchanged",
        ),  # noqa: E501
    ]
    for action, message in bad:
        obs, res = env.step(action)
        text = tok.decode(obs)
        assert text.startswith("<obs>error: ") and message in text, (message, text)
        assert res.process["rejected"] == -1.0 and res.log["error"] and not res.done
    obs, res = env.step(bad[0][0])  # the same refused call again
    assert res.process["repeated"] == -1.0
    assert env.state.files == task.files  # nothing changed
    assert tok.decode(env.step(_call(tok, "view", {"path": "solution.py"}))[0]).startswith(
        "<obs>solution.py lines 1-"
    )  # and the episode goes on


def test_tools_and_process_signals(env, task):
    _, first = env.reset_text(task)
    assert "solution.py:" in first and task.entry_point in first
    text, _ = env.step_call("view", {"path": "solution.py", "start": 2, "end": 3})
    assert text.startswith("solution.py lines 2-3 of") and len(text.split("\n")) == 3
    report, res = env.step_call("run_tests", {})
    assert "test run starts" in report and "failed" in report
    (m,) = task.mutations
    broken, res = env.step_call(
        "edit", {"path": "solution.py", "start": m.line, "end": m.line, "new": "    return ("}
    )
    assert "does not parse" in broken
    assert res.process["parse"] == -1.0 and res.process["error_classes"] < 0
    call = expert_calls(task)[1]  # the fix, on the original text
    env.step_call("edit", {"path": "solution.py", "start": m.line, "end": m.line,
                           "new": "\n".join(m.buggy)})  # fmt: skip
    name, args = call
    text, res = env.step_call(name, args)
    assert res.process["parse"] == 0.0 and res.process["tests"] > 0 and res.process["revisit"] == 0
    undo = {"path": "solution.py", "start": m.line, "end": m.line, "new": "\n".join(m.buggy)}
    _, res = env.step_call("edit", undo)
    assert res.process["revisit"] == -1.0 and res.process["tests"] < 0


def test_editing_the_tests_breaks_the_goal(env, task):
    env.reset_text(task)
    hack = "def test_1():\n    pass\n"
    n = len(task.visible_tests.rstrip("\n").split("\n"))
    env.step_call("edit", {"path": "test_solution.py", "start": 1, "end": n, "new": hack})
    text, _ = env.step_call("run_tests", {})
    assert text.split("\n")[-1].startswith("=") and "1 passed" in text.split("\n")[-1]
    text, res = env.step_call("submit", {})
    assert res.done and res.outcome_reward == 0.0
    assert not res.log["goal_adhered"] and "test_solution.py was edited" in text


def test_changing_the_signature_breaks_the_goal(env, task):
    env.reset_text(task)
    for name, args in expert_calls(task)[:-1]:
        env.step_call(name, args)
    old = task.signature
    new = old.replace(f"def {task.entry_point}(", f"def {task.entry_point}(extra=None, ")
    env.step_call("edit", {"path": "solution.py", "old": old, "new": new})
    text, res = env.step_call("submit", {})
    assert "signature" in text and not res.log["goal_adhered"] and not res.log["success"]


def test_out_of_turns_and_output_limit(env, task):
    cfg = dataclasses.replace(task.config, max_turns=2, max_output_chars=200)
    env.reset_text(dataclasses.replace(task, config=cfg))
    text, res = env.step_call("run_tests", {})
    assert len(text) <= 200 and "output cut to 200 characters" in text and not res.done
    text, res = env.step_call("view", {"path": "test_solution.py"})
    assert res.done and text.endswith("out of turns") and res.outcome_reward == 0.0
    assert res.log["goal_adhered"] and not res.log["success"]
    with pytest.raises(RuntimeError):
        env.step_call("run_tests", {})


def test_truncate_keeps_the_last_line():
    text = "\n".join(f"line {k}" for k in range(100)) + "\n=== 1 failed ==="
    cut = truncate(text, 200)
    assert len(cut) <= 200 and cut.endswith("=== 1 failed ===") and cut.startswith("line 0")
    assert truncate("short", 200) == "short"
