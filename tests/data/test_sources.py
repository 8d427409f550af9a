"""Task sources: grid enumeration, splits, grain shuffling/sharding, iterator state round trip."""

import itertools
import json

import grain
import pytest

from agentrl_jax.data import sources
from agentrl_jax.data.transforms import MakeTask

BUGS = ("syntax", "logic", "off_by_one", "missing_dependency")


def _key(spec):
    return (spec["seed"], spec["difficulty"], tuple(spec["bug_types"]), spec["split"])


def test_bug_combos_multisets_and_heldout():
    held = ("off_by_one", "missing_dependency")
    one = sources.bug_combos(BUGS, 1, heldout_combo=held, split="train")
    assert one == (("logic",), ("missing_dependency",), ("off_by_one",), ("syntax",))
    assert sources.bug_combos(BUGS, 1, heldout_combo=held, split="heldout_combo") == ()
    two = sources.bug_combos(BUGS, 2, heldout_combo=held, split="train")
    assert len(two) == 10 - 1  # C(4 + 1, 2) multisets, one held out
    assert ("logic", "logic") in two and ("missing_dependency", "off_by_one") not in two
    assert sources.bug_combos(BUGS, 2, heldout_combo=held, split="heldout") == two
    three_held = sources.bug_combos(BUGS, 3, heldout_combo=held, split="heldout_combo")
    assert len(three_held) == 4 and all(set(held) <= set(c) for c in three_held)
    assert len(sources.bug_combos(BUGS, 3, heldout_combo=held, split="train")) == 20 - 4
    sets = sources.bug_combos(BUGS, 2, heldout_combo=None, split="train", repeat=False)
    assert len(sets) == 6 and all(len(set(c)) == 2 for c in sets)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(split="val"), "split"),
        (dict(bug_types=("a", "a")), "bug_types"),
        (dict(heldout_combo=("zzz",)), "heldout_combo"),
        (dict(n_bugs=0), "n_bugs"),
        (dict(n_bugs=5, repeat=False), "n_bugs"),
    ],
)
def test_bug_combos_rejects_bad_input(kwargs, match):
    args = dict(bug_types=BUGS, n_bugs=1, split="train", heldout_combo=None)
    args.update(kwargs)
    bug_types, n_bugs = args.pop("bug_types"), args.pop("n_bugs")
    with pytest.raises(ValueError, match=match):
        sources.bug_combos(bug_types, n_bugs, **args)


def test_source_hand_values_and_full_coverage():
    cells = [(1, ("a",)), (1, ("b",)), (2, ("a",)), (2, ("b",))]
    src = sources.TaskSpecSource("train", cells, (10, 13))
    assert len(src) == 12
    # difficulty alternates, cell within difficulty next, then the seed
    assert _key(src[0]) == (10, 1, ("a",), "train")
    assert _key(src[1]) == (10, 2, ("a",), "train")
    assert _key(src[2]) == (10, 1, ("b",), "train")
    assert _key(src[5]) == (11, 2, ("a",), "train")
    got = sorted(_key(src[i]) for i in range(len(src)))
    want = sorted((s, d, b, "train") for s, (d, b) in itertools.product(range(10, 13), cells))
    assert got == want
    with pytest.raises(IndexError):
        src[12]


def test_source_equal_weight_per_difficulty():
    cells = [(1, ("a",)), (3, ("a",)), (3, ("b",)), (3, ("c",))]
    src = sources.TaskSpecSource("train", cells, (0, 5))
    specs = [src[i] for i in range(len(src))]
    assert len(src) == 2 * 3 * 5
    assert sum(s["difficulty"] == 1 for s in specs) == sum(s["difficulty"] == 3 for s in specs)
    assert len({_key(s) for s in specs if s["difficulty"] == 3}) == 15


@pytest.mark.parametrize(
    "args, match",
    [
        (("dev", [(1, ("a",))], (0, 5)), "split"),
        (("train", [], (0, 5)), "cells"),
        (("train", [(1, ("a",))], (5, 5)), "seed_range"),
    ],
)
def test_source_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        sources.TaskSpecSource(*args)


def _take(it, n):
    return [_key(next(it)) for _ in range(n)]


def test_task_dataset_deterministic_shuffled_epochs():
    cells = [(1, ("a",)), (2, ("b",))]
    ds = sources.task_dataset("train", cells, (0, 10), shuffle_seed=3)
    a = _take(sources.task_iterator(ds), 40)
    b = _take(sources.task_iterator(sources.task_dataset("train", cells, (0, 10), 3)), 40)
    c = _take(sources.task_iterator(sources.task_dataset("train", cells, (0, 10), 4)), 40)
    assert a == b and a != c
    grid = sorted((s, d, bt, "train") for s in range(10) for d, bt in cells)
    assert sorted(a[:20]) == grid and sorted(a[20:]) == grid  # each epoch is a permutation
    assert a[:20] != a[20:]  # reshuffled every epoch
    assert a[:20] != grid


def test_task_dataset_shards_are_disjoint_and_cover():
    cells = [(1, ("a",)), (2, ("b",))]
    full = _take(sources.task_iterator(sources.task_dataset("train", cells, (0, 6), 1)), 12)
    shards = [
        _take(
            sources.task_iterator(
                sources.task_dataset("train", cells, (0, 6), 1, shard_index=s, shard_count=3)
            ),
            4,
        )
        for s in range(3)
    ]
    assert sorted(sum(shards, [])) == sorted(full)
    assert shards[1] == full[1::3]
    with pytest.raises(ValueError, match="shard_index"):
        sources.task_dataset("train", cells, (0, 6), 1, shard_index=3, shard_count=3)


def test_iterator_state_json_round_trip():
    ds = sources.task_dataset("heldout", [(2, ("a", "b")), (2, ("c",))], (100, 200), 7)
    it = sources.task_iterator(ds)
    _take(it, 13)
    state = json.loads(json.dumps(it.get_state()))
    after = _take(it, 10)
    it2 = sources.task_iterator(ds)
    it2.set_state(state)
    assert _take(it2, 10) == after


def test_split_cells():
    kw = dict(bugs_per_difficulty=(1, 2), heldout_combo=("logic", "syntax"))
    train = sources.split_cells("train", (1, 0), BUGS, **kw)
    held = sources.split_cells("heldout_combo", (0, 1), BUGS, **kw)
    assert held == ((1, ("logic", "syntax")),)
    assert [d for d, _ in train] == [0] * 4 + [1] * 9
    assert all(c != ("logic", "syntax") for _, c in train)
    with pytest.raises(ValueError, match="difficulties"):
        sources.split_cells("train", (), BUGS, bugs_per_difficulty=(1,))
    with pytest.raises(ValueError, match="difficulty=2"):
        sources.split_cells("train", (2,), BUGS, bugs_per_difficulty=(1, 1))


def test_make_task_as_grain_map_and_factory_adapter():
    calls = []

    def fake_make_task(seed, difficulty, *, bug_types=None):
        calls.append((seed, difficulty, bug_types))
        return ("task", seed, difficulty, bug_types)

    factory = sources.make_task_factory(fake_make_task)
    ds = sources.task_dataset("train", [(1, ("logic",))], (0, 4), None).map(MakeTask(factory))
    items = [ds[i] for i in range(3)]
    assert [it["task"] for it in items] == [("task", s, 1, ("logic",)) for s in range(3)]
    assert sources.spec_only(items[0]) == {
        "seed": 0,
        "difficulty": 1,
        "bug_types": ("logic",),
        "split": "train",
    }
    assert isinstance(ds, grain.MapDataset) and len(calls) == 3
