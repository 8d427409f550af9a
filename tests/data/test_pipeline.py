"""TaskPipeline: determinism, balance, band, dynamic sampling, checkpoints, grain wrappers."""

import collections
import dataclasses
import json

import grain
import numpy as np
import pytest

from agentrl_jax.data import DataConfig, TaskPipeline, diversity, transforms
from agentrl_jax.data.difficulty import SuccessTracker, bucket_key, update_tracker

BUGS = ("syntax", "logic", "off_by_one", "missing_dependency")
SMALL = dict(
    batch_size=8,
    group_size=4,
    k_samples=4,
    difficulties=(0, 1, 2),
    train_seeds=(0, 500),
    heldout_seeds=(500, 600),
)
HELD = {"missing_dependency", "off_by_one"}


def _keys(items):
    return [(i["seed"], i["difficulty"], tuple(i["bug_types"]), i["split"]) for i in items]


def fake_rollout(p_success, seed=0):
    """Rollout function: rollout g of task (seed, difficulty) succeeds with p_success[difficulty].

    Deterministic per task so a resumed pipeline sees the same rewards.
    """

    def rollout(items):
        out = []
        for it in items:
            rng = np.random.default_rng([seed, it["seed"], it["difficulty"], len(it["bug_types"])])
            out.append({"rewards": (rng.random(4) < p_success[it["difficulty"]]).astype(float)})
        return out

    return rollout


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(band_low=0.9, band_high=0.1), "low"),
        (dict(k_samples=0), "k_samples"),
        (dict(batch_size=0), "batch_size"),
        (dict(difficulties=()), "difficulties"),
        (dict(track_by="group"), "track_by"),
        (dict(out_of_band_prob=1.5), "out_of_band_prob"),
        (dict(train_seeds=(0, 100), heldout_seeds=(50, 150)), "overlap"),
        (dict(heldout_seeds=(10, 10)), "heldout_seeds"),
        (dict(heldout_combo=("nope",)), "heldout_combo"),
        (dict(max_refill_rounds=-1), "max_refill_rounds"),
        (dict(difficulties=(5,)), "difficulty=5"),
        (dict(bugs_per_difficulty=(1, 0, 2, 3)), "n_bugs"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_config_accepts_lists_and_is_hashable():
    cfg = DataConfig(difficulties=[1, 2], bug_types=["logic", "syntax"], heldout_combo=None)
    assert cfg.difficulties == (1, 2) and cfg.bug_types == ("logic", "syntax")
    assert hash(cfg) == hash(
        DataConfig(difficulties=(1, 2), bug_types=("logic", "syntax"), heldout_combo=None)
    )


def test_deterministic_per_seed_and_split_ranges():
    a = TaskPipeline(DataConfig(**SMALL)).next_batch(24)
    b = TaskPipeline(DataConfig(**SMALL)).next_batch(24)
    c = TaskPipeline(DataConfig(**SMALL, shuffle_seed=1)).next_batch(24)
    assert _keys(a) == _keys(b) and _keys(a) != _keys(c)
    assert all(0 <= s < 500 and sp == "train" for s, _, _, sp in _keys(a))
    held = TaskPipeline(DataConfig(**SMALL), "heldout").next_batch(24)
    assert all(500 <= s < 600 and sp == "heldout" for s, _, _, sp in _keys(held))
    combo = TaskPipeline(DataConfig(**SMALL), "heldout_combo").next_batch(6)
    assert {b for _, _, b, _ in _keys(combo)} == {("missing_dependency", "off_by_one")}
    assert all(not HELD <= set(b) for _, _, b, _ in _keys(a))
    assert {len(b) for _, d, b, _ in _keys(a) if d == 2} == {2}  # bugs_per_difficulty[2] == 2
    with pytest.raises(ValueError, match="split"):
        TaskPipeline(DataConfig(**SMALL), "test")
    # one bug per task at difficulty 1: no task holds both held-out types
    with pytest.raises(ValueError, match="no tasks at difficulties=\\(1,\\) with bug_types="):
        TaskPipeline(DataConfig(difficulties=(1,)), "heldout_combo")


def test_bug_types_balanced_within_batches():
    p = TaskPipeline(DataConfig(**SMALL))
    assert p.strata == tuple(sorted(BUGS))
    for _ in range(3):
        counts = diversity.type_counts(p.next_batch(), BUGS)
        assert min(counts.values()) >= 2  # 8 slots over 4 types; pairs only add
    unbalanced = TaskPipeline(DataConfig(**SMALL, balance_bug_types=False))
    assert unbalanced.strata == ("all",)
    diffs = collections.Counter(i["difficulty"] for i in unbalanced.next_batch(300))
    assert all(80 <= diffs[d] <= 120 for d in (0, 1, 2))  # equal weight per difficulty


def test_band_keeps_training_on_medium_tasks():
    """Difficulty 0 always solved, 2 never, 1 half the time: after warm-up, mostly difficulty 1."""
    cfg = DataConfig(**SMALL, out_of_band_prob=0.05)
    p = TaskPipeline(cfg)
    outcome = {0: [1.0] * 4, 1: [1.0, 0.0, 0.0, 1.0], 2: [0.0] * 4}
    for _ in range(8):
        items = p.next_batch()
        p.update([{"spec": i, "rewards": outcome[i["difficulty"]]} for i in items])
    assert p.stats()["data/buckets_estimated"] == 4 + 4 + 9  # d2: 10 pairs, 1 held out
    assert p.tracker.rates["d0/logic"] == 1.0 and p.tracker.rates["d2/logic+syntax"] == 0.0
    later = p.next_batch(200)
    frac = np.mean([i["difficulty"] == 1 for i in later])
    assert frac > 0.8, frac
    assert frac < 1.0  # out-of-band buckets still get re-estimated now and then
    stats = p.stats()
    assert stats["data/rejected"] > 0 and stats["data/buckets_in_band"] >= 4
    # a non-adaptive (held-out) view ignores the band
    flat = TaskPipeline(cfg, "train", adaptive=False)
    flat.tracker = p.tracker
    assert np.mean([i["difficulty"] == 1 for i in flat.next_batch(120)]) < 0.5


def test_collect_drops_degenerate_groups_and_refills():
    cfg = DataConfig(**SMALL)
    p = TaskPipeline(cfg)
    kept, m = p.collect(fake_rollout({0: 0.95, 1: 0.5, 2: 0.1}))
    assert len(kept) == cfg.batch_size
    assert all(np.ptp(g["rewards"]) > 0 for g in kept)
    seen = int(m["data/groups"])
    assert seen == cfg.batch_size + int(m["data/dropped_groups"])
    assert m["data/dropped_groups"] > 0 and m["data/refill_rounds"] >= 1
    assert m["data/batch_shortfall"] == 0
    assert sum(p.tracker.counts.values()) == seen * cfg.group_size  # every group updates estimates
    assert all(f"bug_type/{t}/success_rate" in m for t in BUGS)


def test_collect_reports_shortfall_when_everything_is_degenerate():
    cfg = DataConfig(**SMALL, max_refill_rounds=2)
    p = TaskPipeline(cfg)
    kept, m = p.collect(lambda items: [{"rewards": [1.0] * 4} for _ in items])
    assert kept == [] and m["data/batch_shortfall"] == cfg.batch_size
    assert m["data/refill_rounds"] == 2 and m["data/groups"] == 3 * cfg.batch_size


def test_update_validates_groups():
    p = TaskPipeline(DataConfig(**SMALL))
    item = p.next_batch(1)[0]
    with pytest.raises(ValueError, match="group_size"):
        p.update([{"spec": item, "rewards": [1.0, 0.0]}])
    with pytest.raises(ValueError, match="spec"):
        p.update([{"rewards": [1.0] * 4}])
    with pytest.raises(ValueError, match="rollout_fn"):
        p.collect(lambda items: [])


def test_state_restore_reproduces_the_future():
    cfg = DataConfig(**SMALL)
    rollout = fake_rollout({0: 0.9, 1: 0.5, 2: 0.15})
    p = TaskPipeline(cfg)
    for _ in range(3):
        p.collect(rollout)
    saved = json.loads(json.dumps(p.state()))
    future = [p.collect(rollout) for _ in range(3)]
    q = TaskPipeline(cfg)
    q.restore(saved)
    replay = [q.collect(rollout) for _ in range(3)]
    for (kg, km), (rg, rm) in zip(future, replay, strict=True):
        assert _keys([g["spec"] for g in kg]) == _keys([g["spec"] for g in rg])
        assert km == rm
    assert q.tracker == p.tracker and q.state() == p.state()
    with pytest.raises(ValueError, match="split"):
        TaskPipeline(cfg, "heldout").restore(saved)
    with pytest.raises(ValueError, match="version"):
        q.restore({**saved, "version": 0})


def test_task_factory_and_shards():
    made = []

    def factory(spec):
        made.append(spec["seed"])
        return f"task-{spec['seed']}-{spec['difficulty']}"

    p = TaskPipeline(DataConfig(**SMALL), task_factory=factory)
    items = p.next_batch(5)
    assert [i["task"] for i in items] == [f"task-{i['seed']}-{i['difficulty']}" for i in items]
    assert len(made) == 5  # only accepted specs are built
    s0 = TaskPipeline(DataConfig(**SMALL), shard_index=0, shard_count=2).next_batch(40)
    s1 = TaskPipeline(DataConfig(**SMALL), shard_index=1, shard_count=2).next_batch(40)
    assert not set(_keys(s0)) & set(_keys(s1))


def test_grain_transforms():
    groups = [
        {"spec": {"seed": 0, "difficulty": 1, "bug_types": ("logic",)}, "rewards": [1, 1]},
        {"spec": {"seed": 1, "difficulty": 1, "bug_types": ("logic",)}, "rewards": [0, 1]},
        {"spec": {"seed": 2, "difficulty": 1, "bug_types": ("logic",)}, "rewards": [0, 0]},
    ]
    ds = grain.MapDataset.source(groups).filter(transforms.InformativeGroup())
    assert [g["spec"]["seed"] for g in ds.to_iter_dataset()] == [1]
    specs = [
        {"seed": s, "difficulty": d, "bug_types": ("logic",), "split": "train"}
        for s in range(200)
        for d in (1, 2)
    ]
    tracker = update_tracker(SuccessTracker(k=2), "d1/logic", [0, 0])  # out of band
    tracker = update_tracker(tracker, "d2/logic", [0, 1])  # in band
    band = transforms.InBand(tracker, out_of_band_prob=0.1, seed=3)
    kept = list(grain.MapDataset.source(specs).filter(band).to_iter_dataset())
    by_d = collections.Counter(s["difficulty"] for s in kept)
    assert by_d[2] == 200 and 5 <= by_d[1] <= 40
    tagged = grain.MapDataset.source(specs[:2]).map(transforms.AttachBucket())
    assert [t["bucket"] for t in tagged] == [bucket_key(s) for s in specs[:2]]
    with pytest.raises(ValueError, match="atol"):
        transforms.InformativeGroup(atol=-1.0)


def test_state_saves_and_restores_with_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    cfg = DataConfig(**SMALL)
    p = TaskPipeline(cfg)
    p.collect(fake_rollout({0: 0.9, 1: 0.5, 2: 0.15}))
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, args=ocp.args.Composite(data=ocp.args.JsonSave(p.state())))
        mngr.wait_until_finished()
        restored = mngr.restore(3, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
    q = TaskPipeline(cfg)
    q.restore(restored["data"])
    assert _keys(q.next_batch(12)) == _keys(p.next_batch(12))
    assert q.tracker == p.tracker


def test_forced_draws_when_nothing_is_in_band_and_per_task_tracking():
    cfg = DataConfig(
        **{**SMALL, "difficulties": (1,)},
        out_of_band_prob=0.0,
        max_draws_per_task=3,
        skip_strata=True,
    )
    p = TaskPipeline(cfg)
    for t in BUGS:
        p.tracker = update_tracker(p.tracker, f"d1/{t}", [0.0] * 4)
    items = p.next_batch(5)
    assert len(items) == 5
    s = p.stats()
    assert s["data/forced"] == 5 and s["data/rejected"] == 15 and s["data/accepted"] == 0
    assert s["data/skipped_strata"] == 5 * len(BUGS)  # each slot tried every stratum first
    # per-task keys: a tiny pool revisits tasks, and a solved task stops being drawn
    small = {**SMALL, "train_seeds": (0, 2), "difficulties": (1,), "out_of_band_prob": 0.0}
    cfg = DataConfig(**small, track_by="task", balance_bug_types=False)
    p = TaskPipeline(cfg)
    pool = p.next_batch(8)
    assert len(set(_keys(pool))) == 8  # 2 seeds x 4 bug types, one epoch
    solved = pool[0]
    p.update([{"spec": solved, "rewards": [1.0] * 4}])
    assert f"train/s{solved['seed']}/d1/" in next(iter(p.tracker.counts))
    assert _keys([solved])[0] not in _keys(p.next_batch(40))


@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_out_of_band_stratum_is_skipped_and_the_rest_stay_balanced(floor):
    # One bug type at one level is one bucket: once it is solved, its round-robin share of every
    # batch would be all-equal groups. It gets a slot only as a re-estimation (prob `floor`).
    cfg = DataConfig(**{**SMALL, "difficulties": (1,)}, out_of_band_prob=floor, skip_strata=True)
    p = TaskPipeline(cfg)
    p.tracker = update_tracker(p.tracker, "d1/missing_dependency", [1.0] * 4)
    p.tracker = update_tracker(p.tracker, "d1/logic", [1.0, 0.0, 0.0, 1.0])
    items = p.next_batch(600)
    counts = collections.Counter(i["bug_types"][0] for i in items)
    md = counts.pop("missing_dependency", 0)
    assert md <= 600 * floor * 1.5 and (md > 0) == (floor > 0)
    assert max(counts.values()) - min(counts.values()) <= 1  # round robin over the others
    s = p.stats()
    assert s["data/skipped_strata"] > 150 and s["data/forced"] == 0
    assert s["data/rejected"] == 0  # a re-estimated stratum's task is taken as drawn
    # not adaptive (held-out), or skipping turned off: every stratum gets its share
    off = TaskPipeline(dataclasses.replace(cfg, skip_strata=False))
    for q in (TaskPipeline(cfg, "heldout"), off):
        q.tracker = p.tracker
        counts = collections.Counter(t for i in q.next_batch(40) for t in i["bug_types"])
        assert counts == dict.fromkeys(BUGS, 10)
