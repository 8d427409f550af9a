"""Task generation: determinism, splits, recorded mutations, validation in the sandbox."""

import dataclasses

import pytest

from agentrl_jax.envs.pyrepair import (
    BUG_TYPES,
    BUGS_PER_DIFFICULTY,
    DIFFICULTIES,
    HELDOUT_SEED_START,
    difficulty_config,
    make_task,
)
from agentrl_jax.envs.pyrepair.execution import Job, default_sandbox, evaluate_batch
from agentrl_jax.envs.pyrepair.expert import _apply, fix_call
from agentrl_jax.envs.pyrepair.problems import load_problems
from agentrl_jax.envs.pyrepair.task import _build, signature_of

SAMPLE = [(3, 0, None), (5, 1, None), (8, 2, None), (HELDOUT_SEED_START + 2, 0, ("constant",))]


@pytest.fixture(scope="module")
def tasks():
    return [make_task(seed, level, bug_types=types) for seed, level, types in SAMPLE]


def test_deterministic_and_split(tasks):
    _build.cache_clear()  # rebuild from scratch, not from the in-memory cache
    for task, (seed, level, types) in zip(tasks, SAMPLE):
        assert make_task(seed, level, bug_types=types) == task
        split = "heldout" if seed >= HELDOUT_SEED_START else "train"
        problem = next(p for p in load_problems() if p.task_id == task.problem)
        assert task.split == problem.split == split
        assert len(task.mutations) == DIFFICULTIES[level].n_bugs == BUGS_PER_DIFFICULTY[level]
    assert tasks[3].bug_types == ("constant",)


def test_mutations_are_recorded_hunks_that_repair(tasks):
    for task in tasks:
        assert task.solution != task.reference
        assert set(task.bug_types) <= set(BUG_TYPES)
        lines = [m.line for m in task.mutations]
        assert lines == sorted(lines) and len(set(lines)) == len(lines)
        fixed = task.solution
        for m in sorted(task.mutations, key=lambda m: -m.line):
            fixed = _apply(fixed, fix_call(fixed, m)[1])
        assert fixed == task.reference
        assert signature_of(task.solution, task.entry_point) == task.signature != ""


def test_level_two_hides_the_bug_in_a_helper(tasks):
    task = tasks[2]
    assert task.helpers and all(m.function in task.helpers for m in task.mutations)
    assert "solution.py:" not in task.prompt  # the program is not shown
    assert task.entry_point in task.prompt


def test_reference_passes_and_buggy_fails_a_visible_test(tasks):
    jobs = []
    for t in tasks:
        jobs += [
            Job(t.reference, t.visible_tests, t.n_visible),
            Job(t.reference, t.hidden_tests, t.n_hidden, test_file="test_hidden.py"),
            Job(t.solution, t.visible_tests, t.n_visible),
        ]
    results = evaluate_batch(default_sandbox(), jobs, test_timeout_s=2, run_timeout_s=60)
    for k in range(len(tasks)):
        ref_vis, ref_hid, buggy = results[3 * k : 3 * k + 3]
        assert ref_vis.all_pass and ref_hid.all_pass and not buggy.all_pass


@pytest.mark.parametrize(
    "seed, level, types, field",
    [
        (-1, 0, None, "seed"),
        (2_000_000, 0, None, "seed"),
        (0, 4, None, "difficulty"),
        (0, 0, ("nonsense",), "bug_types"),
        (0, 1, ("constant",), "len"),
    ],
)
def test_bad_arguments(seed, level, types, field):
    with pytest.raises(ValueError, match=field):
        make_task(seed, level, bug_types=types)


def test_config_validation():
    with pytest.raises(ValueError, match="n_bugs"):
        dataclasses.replace(difficulty_config(0), n_bugs=0)
    with pytest.raises(ValueError, match="n_helpers"):
        dataclasses.replace(difficulty_config(0), bug_in_helper=True)
    with pytest.raises(ValueError, match="max_output_chars"):
        dataclasses.replace(difficulty_config(0), max_output_chars=10)
