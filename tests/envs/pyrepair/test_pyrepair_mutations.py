"""Bug injection and helper extraction on small hand-written programs (no sandbox)."""

import ast
import random

import pytest

from agentrl_jax.envs.pyrepair.config import BUG_TYPES
from agentrl_jax.envs.pyrepair.mutations import apply_sites, find_sites
from agentrl_jax.envs.pyrepair.refactor import extract_helpers

PROGRAM = '''\
from typing import List

def f(xs: List[int], k: int) -> int:
    """Sum of xs[i] * k for i < len(xs), and 1 if any x == k."""
    total = 0
    for i in range(len(xs)):
        total += xs[i] * k
    found = k in xs and total > 0
    total = max(total, 0)
    if found:
        return total + 1
    return total
'''


def _mutants(bug_type: str) -> set[str]:
    """Every line that some site of ``bug_type`` changes, as it reads after the change."""
    tree = ast.parse(PROGRAM)
    before = ast.unparse(tree).split("\n")
    out = set()
    for site in find_sites(tree, ["f"])[bug_type]:
        after = ast.unparse(apply_sites(tree, [site])).split("\n")
        out |= {line.strip() for line in after if line not in before}
        if bug_type == "dropped_statement":
            out.add("dropped " + site.description)
    return out


@pytest.mark.parametrize(
    "bug_type, expected",
    [
        ("operator", "total -= xs[i] * k"),
        ("operator", "total += xs[i] + k"),
        ("operator", "found = k in xs or total > 0"),
        ("comparison", "found = k not in xs and total > 0"),
        ("comparison", "found = k in xs and total >= 0"),
        ("off_by_one", "for i in range(len(xs) + 1):"),
        ("off_by_one", "total += xs[i - 1] * k"),
        ("wrong_variable", "total += xs[i] * i"),
        ("constant", "total = 1"),
        ("constant", "found = k in xs and total > 1"),
        ("dropped_statement", "dropped dropped `total = max(total, 0)`"),
        ("swapped_arguments", "total = max(0, total)"),
        ("wrong_return", "return k"),
    ],
)
def test_each_bug_type_makes_the_expected_mutant(bug_type, expected):
    assert expected in _mutants(bug_type)


def test_docstring_signature_and_annotations_are_never_mutated():
    tree = ast.parse(PROGRAM)
    def_line = ast.unparse(tree).split("\n").index("def f(xs: List[int], k: int) -> int:")
    for sites in find_sites(tree, ["f"]).values():
        for site in sites:
            after = ast.unparse(apply_sites(tree, [site])).split("\n")
            assert after[: def_line + 2] == ast.unparse(tree).split("\n")[: def_line + 2]


def test_apply_sites_copies_and_checks_compatibility():
    tree = ast.parse(PROGRAM)
    before = ast.dump(tree)
    sites = find_sites(tree, ["f"])
    assert set(sites) == set(BUG_TYPES) and all(sites.values())
    apply_sites(tree, [sites["operator"][0]])
    assert ast.dump(tree) == before
    same_stmt = [s for s in sites["constant"] if s.stmt_index == sites["operator"][0].stmt_index]
    if same_stmt:
        with pytest.raises(ValueError, match="compatible"):
            apply_sites(tree, [sites["operator"][0], same_stmt[0]])
    drop = next(s for s in sites["dropped_statement"] if "for i" in s.description)
    inside = next(s for s in sites["off_by_one"] if drop.stmt_index in s.stmt_ancestors)
    assert not drop.compatible(inside)


def test_unknown_function_is_an_error():
    with pytest.raises(ValueError, match="nope"):
        find_sites(ast.parse(PROGRAM), ["nope"])


@pytest.mark.parametrize("seed", range(4))
def test_extracted_helpers_keep_behaviour(seed):
    tree = ast.parse(PROGRAM)
    new, helpers = extract_helpers(tree, "f", 3, random.Random(seed))
    assert 1 <= len(helpers) <= 3 and "_solve" in helpers
    names = [n.name for n in new.body if isinstance(n, ast.FunctionDef)]
    assert names[-1] == "f" and set(helpers) <= set(names)
    ref, got = {}, {}
    exec(compile(tree, "ref", "exec"), ref)  # trusted, hand-written code
    exec(compile(new, "new", "exec"), got)
    for xs, k in [([], 1), ([1, 2, 3], 2), ([5, -9], 3), ([2, 2], 2)]:
        assert got["f"](xs, k) == ref["f"](xs, k)


def test_extract_helpers_validates_n():
    with pytest.raises(ValueError, match="n=0"):
        extract_helpers(ast.parse(PROGRAM), "f", 0, random.Random(0))
