"""Bug-type strata, round robin, counts and per-type metrics (hand-computed values)."""

import math

import pytest

from agentrl_jax.data import diversity as div


def _spec(d, *bugs):
    return {"seed": 0, "difficulty": d, "bug_types": tuple(bugs), "split": "train"}


def test_round_robin_hand_values():
    assert div.round_robin(("a", "b", "c"), 5) == ["a", "b", "c", "a", "b"]
    assert div.round_robin(("a", "b", "c"), 4, offset=2) == ["c", "a", "b", "c"]
    assert div.round_robin(("a",), 0) == []
    with pytest.raises(ValueError, match="strata"):
        div.round_robin((), 3)
    with pytest.raises(ValueError, match="n="):
        div.round_robin(("a",), -1)


def test_stratum_type_counts_imbalance():
    specs = [_spec(1, "syntax"), _spec(3, "syntax", "logic"), _spec(2, "logic")]
    assert div.stratum(specs[1]) == "logic+syntax"
    counts = div.type_counts(specs, ("logic", "off_by_one", "syntax"))
    assert counts == {"logic": 2, "off_by_one": 0, "syntax": 2}
    assert div.imbalance({"a": 2, "b": 4}) == 2.0
    assert math.isinf(div.imbalance(counts))
    assert div.imbalance({}) == 1.0


def test_bug_type_metrics_hand_values():
    groups = [
        {"spec": _spec(1, "syntax"), "rewards": [1.0, 0.0, 1.0, 1.0]},
        {"spec": _spec(3, "syntax", "logic"), "rewards": [0.0, 0.0, 1.0, 0.0]},
        {"spec": _spec(3, "logic"), "rewards": [0.0, 0.0, 0.0, 0.0], "success": [1, 1, 0, 0]},
    ]
    m = div.bug_type_metrics(groups, ("logic", "off_by_one", "syntax"))
    assert m["bug_type/syntax/count"] == 2.0
    assert m["bug_type/syntax/success_rate"] == pytest.approx(4 / 8)
    assert m["bug_type/logic/count"] == 2.0
    assert m["bug_type/logic/success_rate"] == pytest.approx(3 / 8)
    assert m["bug_type/off_by_one/count"] == 0 and "bug_type/off_by_one/success_rate" not in m
    assert m["difficulty/1/count"] == 1.0 and m["difficulty/1/success_rate"] == 0.75
    assert m["difficulty/3/count"] == 2.0 and m["difficulty/3/success_rate"] == pytest.approx(3 / 8)
    assert m["bug_type/imbalance"] == 1.0  # over the types present (2 and 2 groups)
