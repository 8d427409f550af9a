"""The scripted expert solves every task, through the tools, in the model's token format."""

import numpy as np
import pytest

from agentrl_jax.envs.coderepair.bugs import bound_names
from agentrl_jax.envs.coderepair.config import HELDOUT_SEED_START
from agentrl_jax.envs.coderepair.env import CodeRepairEnv
from agentrl_jax.envs.coderepair.expert import (
    _GUESSES,
    ExpertPolicy,
    expert_plan,
    expert_plan_detours,
)
from agentrl_jax.envs.coderepair.language import VARIABLES
from agentrl_jax.envs.coderepair.task import make_task
from agentrl_jax.envs.episode import play_episode

SEEDS = {0: 100, 1: 100, 2: 60, 3: 25, 4: 8}


@pytest.mark.parametrize("difficulty", sorted(SEEDS))
def test_expert_solves_every_task(difficulty):
    env = CodeRepairEnv()
    for k in range(SEEDS[difficulty]):
        seed = k if k % 2 == 0 else HELDOUT_SEED_START + k
        task = make_task(seed, difficulty)
        detour = 0.5 if k % 3 == 0 else 0.0
        ep = play_episode(env, task, ExpertPolicy(task, env.tokenizer, detour_prob=detour, seed=k))
        assert ep.success and ep.goal_adhered and ep.outcome_reward == 1.0, (seed, difficulty)
        assert ep.n_turns <= task.config.max_turns
        assert env.tokenizer.unk_id not in ep.tokens


def test_detours_are_failed_edits_or_rejected_calls_then_fixes():
    env = CodeRepairEnv()
    kinds = {"wrong_edit": 0, "slip": 0, "guess": 0, "variable_guess": 0}
    for seed in range(64):
        task = make_task(seed, 1)
        plan, detours, guesses = expert_plan_detours(task, detour_prob=1.0, seed=seed)
        assert plan == expert_plan(task, detour_prob=1.0, seed=seed)
        policy = ExpertPolicy(task, detour_prob=1.0, seed=seed)
        assert policy.detour_turns == {k + 1 for k in detours}
        assert policy.guess_turns == {k + 1 for k in guesses} and guesses <= detours
        ep = play_episode(env, task, policy)
        assert ep.success
        tools = [log["tool"] for log in ep.logs]
        assert tools == [p[0] for p in plan]
        assert len(detours) == 1
        (k,) = detours
        if ep.logs[k]["error"]:
            kinds["slip"] += 1
            assert not guesses  # a sub of a word the line does not hold, then the fix
            assert tools[k] == "sub" and "has no" in ep.logs[k]["output"]
            assert tools[k + 1] in ("sub", "edit") and not ep.logs[k + 1]["error"]
        else:
            # the run after the wrong edit still fails
            assert "fail" in ep.logs[k + 1]["output"] or "error" in ep.logs[k + 1]["output"]
            (bug,) = task.bugs
            guessed = _line_after(task, plan[: k + 1], bug.line)
            changed = [p for p, (a, b) in enumerate(zip(guessed, bug.original)) if a != b]
            same_kind = len(guessed) == len(bug.original) and len(changed) == 1
            if same_kind:
                good, wrong = bug.original[changed[0]], guessed[changed[0]]
                same_kind = any(good in g and wrong in g for g in _GUESSES)
            if same_kind and guessed != bug.mutated:
                # a wrong guess: the bug's word replaced by another of its kind, then replaced
                kinds["guess"] += 1
                # (a wrong edit can look like one: only real guesses are listed)
                assert guesses <= {k}, (seed, guesses)
                if wrong in VARIABLES:  # a name the line could use, not a random one
                    kinds["variable_guess"] += 1
                    assert wrong in bound_names(task.original, bug.line), (seed, wrong)
                assert tools[k] in ("sub", "edit") and tools[k + 2] in ("sub", "edit")
                assert tools[k + 1] == "run"
            else:
                kinds["wrong_edit"] += 1
                assert not guesses
                assert tools[k : k + 3] == ["edit", "run", "edit"]
    assert min(kinds.values()) >= 2, kinds
    with pytest.raises(ValueError, match="detour_prob"):
        expert_plan(make_task(0, 0), detour_prob=1.5)


def test_several_wrong_guesses_in_a_row_then_the_fix():
    env = CodeRepairEnv()
    runs = {1: 0, 2: 0, 3: 0}
    for seed in range(64):
        task = make_task(seed, 1)
        one = expert_plan_detours(task, detour_prob=1.0, seed=seed)
        assert expert_plan_detours(task, detour_prob=1.0, seed=seed, max_guesses=1) == one
        plan, detours, guesses = expert_plan_detours(
            task, detour_prob=1.0, seed=seed, max_guesses=3
        )
        policy = ExpertPolicy(task, detour_prob=1.0, seed=seed, max_guesses=3)
        assert policy.plan == plan and policy.detour_turns == {k + 1 for k in detours}
        assert guesses <= detours and (len(detours) == 1 or guesses == detours)
        ep = play_episode(env, task, policy)
        assert ep.success and ep.n_turns <= task.config.max_turns, seed
        ks = sorted(detours)
        runs[len(ks)] += 1
        if len(ks) == 1:
            continue
        # guesses alternate with runs that still fail; each guess is a new line, and the fix
        # follows the last run
        (bug,) = task.bugs
        tools = [log["tool"] for log in ep.logs]
        assert ks == list(range(ks[0], ks[0] + 2 * len(ks), 2)), (seed, ks)
        seen = {tuple(bug.mutated), tuple(bug.original)}
        for k in ks:
            assert tools[k] in ("sub", "edit") and tools[k + 1] == "run"
            assert "fail" in ep.logs[k + 1]["output"] or "error" in ep.logs[k + 1]["output"]
            guessed = tuple(_line_after(task, plan[: k + 1], bug.line))
            assert guessed not in seen, (seed, k, guessed)
            seen.add(guessed)
        assert tools[ks[-1] + 2] in ("sub", "edit") and ks[-1] + 2 not in detours
    assert runs[2] >= 2 and runs[3] >= 2, runs
    with pytest.raises(ValueError, match="max_guesses"):
        expert_plan(make_task(0, 1), detour_prob=0.5, max_guesses=0)


def _line_after(task, calls, line):
    """Line ``line`` of ``task``'s program after the tool calls ``calls``."""
    from agentrl_jax.envs.base import call_tool
    from agentrl_jax.envs.coderepair.tools import RepairState, default_registry

    state = RepairState(task=task, lines=list(task.lines))
    for call in calls:
        call_tool(default_registry(), list(call), state, task.config.time_limit_s)
    return state.lines[line]


def test_demonstrations_are_deterministic_token_streams():
    env = CodeRepairEnv()
    task = make_task(7, 2)
    a = play_episode(env, task, ExpertPolicy(task, detour_prob=0.5, seed=1))
    b = play_episode(env, task, ExpertPolicy(task, detour_prob=0.5, seed=1))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.action_mask, b.action_mask)
    # The model's tokens are exactly the planned calls.
    tok = env.tokenizer
    plan = expert_plan(task, detour_prob=0.5, seed=1)
    for k, words in enumerate(plan, start=1):
        ids = a.tokens[(a.turn_ids == k) & a.action_mask].tolist()
        assert ids == tok.encode_words(["<call>", *words, "</call>"])
