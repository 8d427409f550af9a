"""The judge's plain values: exact types only, rebuilt from builtins, strict on what it reads."""

import json
import math

import pytest

from agentrl_jax.envs.pyrepair.plain import decode, encode


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**40),
        1.5,
        -0.0,
        float("inf"),
        1 + 2j,
        "é\n",
        b"\x00\xff",
        [1, [2.0, "x"]],
        (1, (None,)),
        {1, "a"},
        frozenset({(1, 2)}),
        {"a": [1], (1, 2): {3: None}},
    ],
)
def test_plain_values_round_trip_with_their_exact_types(value):
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and type(back) is type(value)
    if isinstance(value, float) and value == 0:
        assert math.copysign(1, back) == -1.0  # -0.0 stays -0.0


def test_nan_round_trips():
    assert math.isnan(decode(encode(float("nan"))))


class Always:
    def __eq__(self, other):
        return True


class TrueInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class TrueStr(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class TrueList(list):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize(
    "value",
    [Always(), TrueInt(3), TrueStr("x"), TrueList(), [1, Always()], {"k": TrueInt(1)}, len],
)
def test_objects_that_are_not_plain_are_refused(value):
    with pytest.raises(TypeError, match="not a plain value"):
        encode(value)


def test_nesting_is_bounded():
    deep: list = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        encode(deep)


@pytest.mark.parametrize(
    "node",
    [
        "x",
        [],
        ["i", "3"],
        ["i", True],
        ["b", 1],
        ["s", 3],
        ["f", 1.5],
        ["f", "not a float"],
        ["l", "abc"],
        ["d", [["s", "a"]]],
        ["Q", 1],
        ["N", 1],
    ],
)
def test_decode_reads_only_what_encode_writes(node):
    with pytest.raises(ValueError):
        decode(node)


def test_unhashable_members_are_refused():
    with pytest.raises(TypeError):
        decode(["S", [["l", []]]])
