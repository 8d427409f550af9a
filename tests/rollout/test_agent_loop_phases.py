"""AgentLoop driven a round at a time: options, parameter swaps, environment executors."""

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
from rollout_setup import N_SLOTS, SAMPLING, ScriptedEnv
from test_agent_loop import TASKS, play
from test_agent_loop_pinned import SCENARIOS

from agentrl_jax.rollout.agent_loop import AgentLoop, run_episodes
from agentrl_jax.rollout.loop_state import LoopOptions


@pytest.fixture(scope="module")
def played(fp32_model, tokenizer):
    return play(*fp32_model, tokenizer)


def _same(a, b, logs=True):
    for name in ("tokens", "rollout_logprobs", "action_mask", "routes", "turn_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.logs == b.logs or not logs


def _loop(model, params, tokenizer, options, **kw):
    return AgentLoop(
        model, params, TASKS, lambda: ScriptedEnv(tokenizer), tokenizer, SAMPLING,
        jax.random.key(7), options, **kw,
    )  # fmt: skip


def test_options_object_equals_keywords(played, fp32_model, tokenizer):
    """``run_episodes(options=...)`` plays what the same keywords play; keywords override."""
    model, params = fp32_model
    ref, _, _ = played
    opts = LoopOptions(n_slots=N_SLOTS, continuous=False)
    traj = run_episodes(
        model, params, TASKS, lambda: ScriptedEnv(tokenizer), tokenizer, SAMPLING,
        jax.random.key(7), opts, continuous=True,
    )  # fmt: skip
    _same(traj, ref)
    with pytest.raises(TypeError):
        run_episodes(
            model, params, TASKS, lambda: ScriptedEnv(tokenizer), tokenizer, SAMPLING,
            jax.random.key(7), no_such_option=1,
        )  # fmt: skip


def test_round_by_round_with_param_swaps_and_an_executor(played, fp32_model, tokenizer):
    """Stepping by hand, swapping in equal parameters between rounds and stepping the
    environments on a thread pool change nothing; other parameters change the tokens."""
    model, params = fp32_model
    ref, _, _ = played
    with ThreadPoolExecutor(2) as pool:
        loop = _loop(model, params, tokenizer, LoopOptions(n_slots=N_SLOTS), env_executor=pool)
        rounds = 0
        while not loop.done():
            loop.step()
            rounds += 1
            loop.set_params(jax.tree.map(lambda x: x.copy(), params))
        _same(loop.trajectory(), ref)
    assert rounds > len(TASKS)  # continuous batching: a round ends when one turn does
    loop = _loop(model, params, tokenizer, LoopOptions(n_slots=N_SLOTS))
    loop.step()
    loop.set_params(jax.tree.map(lambda x: x * 1.5, params))
    while not loop.done():
        loop.step()
    assert not np.array_equal(loop.trajectory().tokens, ref.tokens)


def test_disaggregated_param_swap(played, fp32_model, tokenizer):
    model, params = fp32_model
    ref, _, _ = played
    split = SCENARIOS["disaggregated_pool"]["disaggregate"]
    loop = _loop(model, params, tokenizer, LoopOptions(n_slots=N_SLOTS, disaggregate=split))
    while not loop.done():
        loop.step()
        loop.set_params(params)
    _same(loop.trajectory(), ref, logs=False)  # the logs count the KV moved between meshes


def test_option_validation():
    for bad, match in (
        (dict(n_slots=0), "n_slots"),
        (dict(max_turns=0), "max_turns"),
        (dict(goal_every=-1), "goal_every"),
    ):
        with pytest.raises(ValueError, match=match):
            LoopOptions(**bad)
    assert LoopOptions(process_weights={"b": 2.0, "a": 1.0}).process_weights == (
        ("a", 1.0),
        ("b", 2.0),
    )
    hash(LoopOptions(process_weights={"a": 1.0}))
