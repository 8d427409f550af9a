"""The basic corpus: loading, splits, the cases against the references and their mutants."""

import ast
import textwrap

import pytest

from agentrl_jax.envs.pyrepair import basics
from agentrl_jax.envs.pyrepair.basics import (
    MIN_INPUTS,
    basic_entries,
    basic_problems,
    basic_problems_of_split,
    to_problem,
)
from agentrl_jax.envs.pyrepair.basics_entry import Basic, inputs
from agentrl_jax.envs.pyrepair.config import problem_split
from agentrl_jax.envs.pyrepair.mutations import apply_sites, find_sites

# Functions every one of whose single mutants fails a case (none loops forever).
FULLY_TESTED = ("middle", "count_increases", "is_sorted", "caesar_shift", "word_counts")


def _failing_cases(program: str, cases: tuple[str, ...]) -> int:
    """How many of ``cases`` (test function bodies) fail against ``program``, in-process."""
    namespace: dict = {}
    try:
        exec(program, namespace)
    except Exception:
        return len(cases)
    failed = 0
    for case in cases:
        try:
            exec(textwrap.dedent(case), dict(namespace))
        except Exception:
            failed += 1
    return failed


def _problem(name: str):
    return next(p for p in basic_problems() if p.entry_point == name)


def test_the_corpus_loads_with_unique_names_in_index_order():
    problems = basic_problems()
    assert len(problems) >= 140
    names = [p.entry_point for p in problems]
    assert len(set(names)) == len(names)
    assert [p.index for p in problems] == list(range(len(problems)))
    assert [p.task_id for p in problems] == [f"Basic/{i}" for i in range(len(problems))]
    assert names == [e.name for e in basic_entries()]


def test_splits_follow_the_humaneval_rule():
    problems = basic_problems()
    assert all(p.split == problem_split(p.index) for p in problems)
    train, heldout = basic_problems_of_split("train"), basic_problems_of_split("heldout")
    assert train and heldout
    assert len(train) + len(heldout) == len(problems)
    assert all(p.index % 5 == 4 for p in heldout)
    with pytest.raises(ValueError, match="split"):
        basic_problems_of_split("test")


def test_problems_look_like_humaneval_ones():
    for p in basic_problems():
        assert p.program == ast.unparse(ast.parse(p.program)) + "\n"
        assert p.imports == (p.entry_point,)
        assert len(p.cases) >= MIN_INPUTS
        for case in p.cases:
            assert case.startswith(f"    assert {p.entry_point}(")
            assert "\n" not in case


def test_every_reference_passes_its_own_cases():
    for p in basic_problems():
        assert _failing_cases(p.program, p.cases) == 0, p.entry_point


def test_expected_values_are_computed_by_the_reference():
    assert "    assert count_vowels('hello') == 2" in _problem("count_vowels").cases
    assert "    assert split_seconds(125) == (2, 5)" in _problem("split_seconds").cases


@pytest.mark.parametrize("name", FULLY_TESTED)
def test_every_single_mutant_fails_a_case(name):
    p = _problem(name)
    tree = ast.parse(p.program)
    sites = [s for group in find_sites(tree, [name]).values() for s in group]
    assert len({s.bug_type for s in sites}) >= 6
    for site in sites:
        mutant = ast.unparse(apply_sites(tree, [site]))
        assert _failing_cases(mutant, p.cases) > 0, site.description


def test_inputs_decorator_wraps_single_arguments_and_drops_itself():
    @inputs(1, 2)
    def twice(n):
        """Return 2 * n."""
        return 2 * n

    @inputs((1, 2), (3, 4))
    def add(a, b):
        """Return a + b."""
        return a + b

    source = 'def twice(n):\n    """Return 2 * n."""\n    return 2 * n'
    assert twice == Basic("twice", source, ((1,), (2,)))
    assert add.inputs == ((1, 2), (3, 4))


GOOD = 'def f(n):\n    """Return n + 1."""\n    return n + 1'
INFINITE = 'def f(n):\n    """Return n * inf."""\n    return n * 1e999'
LONG_BODY = 'def f(n):\n    """Return n + 7."""\n' + "    n += 1\n" * 7 + "    return n"


@pytest.mark.parametrize(
    "source, calls, match",
    [
        ("def f(n):\n    return n + 1", range(6), "docstring"),
        ('def f(n):\n    """Return n\n    plus 1."""\n    return n + 1', range(6), "docstring"),
        (LONG_BODY, range(6), "body has 8 lines"),
        (GOOD.replace("def f", "def g"), range(6), "exactly the function f"),
        (GOOD + "\n" + GOOD, range(6), "exactly the function f"),
        ('def f(n):\n    """Return n."""\n    import math\n    return n', range(6), "import"),
        ('def f(n):\n    """Return n + k."""\n    return n + k', range(6), r"\['k'\]"),
        ('def f(n):\n    """Return n."""\n    len = n\n    return len', range(6), "shadow"),
        ("def f(n:\n", range(6), "parse"),
        (GOOD, range(5), "5 inputs"),
        (GOOD, [0, 1, 2, 3, 4, 4], "distinct"),
        (GOOD, [0, 1, 2, 3, 4, "x"], "raised TypeError"),
        (GOOD, [0, 1, 2, 3, 4, {1}], r"input \(\{1\},\) must be a plain literal"),
        ('def f(n):\n    """Return {n}."""\n    return {n}', range(6), "output for input"),
        (INFINITE, range(6), "output for input"),
    ],
)
def test_bad_entries_raise_naming_the_entry(source, calls, match):
    entry = Basic("f", source, tuple((c,) for c in calls))
    with pytest.raises(ValueError, match="basic 'f'") as error:
        to_problem(entry, 0)
    assert error.match(match)


def test_a_name_used_twice_is_refused(monkeypatch):
    entry = Basic("f", GOOD, tuple((c,) for c in range(6)))
    monkeypatch.setattr(basics, "basic_entries", lambda: (entry, entry))
    with pytest.raises(ValueError, match=r"\['f'\] must be unique"):
        basics.basic_problems.__wrapped__()
