"""Task generation: determinism, splits, labelled bugs, constraints."""

import pytest

from agentrl_jax.envs.coderepair.config import (
    BUG_TYPES,
    HELDOUT_SEED_START,
    EnvConfig,
    difficulty_config,
    is_heldout_combo,
    seed_range,
    split_of,
)
from agentrl_jax.envs.coderepair.evaluation import evaluate
from agentrl_jax.envs.coderepair.language import function_spans, parse_program
from agentrl_jax.envs.coderepair.task import make_task


def test_make_task_is_deterministic():
    a, b = make_task(17, 2), make_task(17, 2)
    assert a == b
    assert make_task(18, 2).lines != a.lines


def test_splits_and_heldout_combination():
    assert split_of(0) == "train" and split_of(HELDOUT_SEED_START) == "heldout"
    assert seed_range("train").stop == seed_range("heldout").start
    with pytest.raises(ValueError, match="seed"):
        split_of(-1)
    with pytest.raises(ValueError, match="split"):
        seed_range("dev")
    train = [make_task(s, 3).bug_types for s in range(40)]
    assert not any(is_heldout_combo(t) for t in train)
    held = [make_task(HELDOUT_SEED_START + s, 3).bug_types for s in range(60)]
    assert any(is_heldout_combo(t) for t in held)


@pytest.mark.parametrize("difficulty", range(5))
def test_bugs_are_labelled_observable_and_fixable(difficulty):
    for seed in range(4):
        t = make_task(seed, difficulty)
        cfg = t.config
        assert len(t.bugs) == cfg.n_bugs and set(t.bug_types) <= set(BUG_TYPES)
        assert len({b.line for b in t.bugs}) == len(t.bugs)
        assert evaluate(t.original, t.tests, cfg.step_budget).all_pass
        assert not evaluate(t.lines, t.visible_tests, cfg.step_budget).all_pass
        assert sum(not x.hidden for x in t.tests) == cfg.n_functions * cfg.n_visible_tests
        assert sum(x.hidden for x in t.tests) == cfg.n_functions * cfg.n_hidden_tests
        spans = function_spans(t.original)
        kind, fn = t.constraint
        for b in t.bugs:
            assert t.lines[b.line] == b.mutated and t.original[b.line] == b.original
            assert t.lines[b.line][0] != "def"
            assert not any(spans[d][0] <= b.line <= spans[d][1] for d in t.distractors)
            if kind == "no_modify":
                assert not spans[fn][0] <= b.line <= spans[fn][1]
            one = list(t.original)
            one[b.line] = b.mutated
            assert not evaluate(one, t.visible_tests, cfg.step_budget).all_pass
        assert len(parse_program(t.original)) == cfg.n_functions + cfg.n_distractors


@pytest.mark.parametrize("bug_type", BUG_TYPES)
def test_forced_bug_types(bug_type):
    t = make_task(5, 1, bug_types=(bug_type,))
    assert t.bug_types == (bug_type,)
    if bug_type == "syntax":
        assert not evaluate(t.lines, t.visible_tests, 5000).parses
    else:
        assert evaluate(t.lines, t.visible_tests, 5000).parses


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="difficulty"):
        make_task(0, 9)
    with pytest.raises(ValueError, match="n_bugs"):
        make_task(0, 1, bug_types=("syntax", "logic"))
    with pytest.raises(ValueError, match="bug_types"):
        make_task(0, 1, bug_types=("typo",))
    with pytest.raises(ValueError, match="n_bugs"):
        EnvConfig(n_functions=1, n_bugs=2)
    with pytest.raises(ValueError, match="max_turns"):
        EnvConfig(max_turns=1)
    assert difficulty_config(1).n_bugs == 1
