"""Success-rate tracker, band, acceptance, hashing and dynamic-sampling predicates."""

import json

import numpy as np
import pytest

from agentrl_jax.data import difficulty as dif


def _reference_rate(samples, k):
    """Mean of the first k samples, then EMA with weight 1/k (independent formulation)."""
    samples = [float(x) for x in samples]
    head = samples[:k]
    rate = sum(head) / len(head)
    for x in samples[k:]:
        rate = (1.0 - 1.0 / k) * rate + x / k
    return rate


def test_update_hand_value():
    t = dif.update_tracker(dif.SuccessTracker(k=2), "b", [1, 0, 1])
    assert t.counts["b"] == 3
    assert t.rates["b"] == pytest.approx(0.75)  # mean(1, 0) = 0.5, then 0.5 + (1 - 0.5) / 2


@pytest.mark.parametrize("k", [1, 3, 8])
def test_update_matches_reference_and_is_grouping_invariant(k):
    rng = np.random.default_rng(k)
    samples = (rng.random(37) < 0.4).astype(float)
    t = dif.SuccessTracker(k=k)
    cuts = np.sort(rng.choice(np.arange(1, 37), size=5, replace=False))
    for chunk in np.split(samples, cuts):
        t = dif.update_tracker(t, "key", chunk)
    assert t.counts["key"] == 37
    assert t.rates["key"] == pytest.approx(_reference_rate(samples, k), abs=1e-12)
    for n in range(1, k + 1):  # exact mean while unestimated
        t_n = dif.update_tracker(dif.SuccessTracker(k=k), "key", samples[:n])
        assert t_n.rates["key"] == pytest.approx(samples[:n].mean(), abs=1e-12)


def test_update_is_pure_and_validates():
    t0 = dif.SuccessTracker(k=4)
    t1 = dif.update_tracker(t0, "a", [1.0, 1.0])
    assert t0.counts == {} and t0.rates == {}
    assert dif.estimate(t1, "a") is None and not dif.is_estimated(t1, "a")
    t2 = dif.update_tracker(t1, "a", [0.0, 0.0])
    assert dif.estimate(t2, "a") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="successes"):
        dif.update_tracker(t0, "a", [1.5])
    with pytest.raises(ValueError, match="successes"):
        dif.update_tracker(t0, "a", [np.nan])
    with pytest.raises(ValueError, match="k="):
        dif.SuccessTracker(k=0)


def test_tracker_follows_a_changing_policy():
    """A bucket that left the band (rate 0) comes back once the policy solves half its tasks."""
    rng = np.random.default_rng(0)
    t = dif.update_tracker(dif.SuccessTracker(k=8), "b", np.zeros(16))
    assert not dif.in_band(dif.estimate(t, "b"))
    for _ in range(6):
        t = dif.update_tracker(t, "b", (rng.random(8) < 0.5).astype(float))
    assert dif.in_band(dif.estimate(t, "b"))


def test_tracker_dict_round_trip_through_json():
    t = dif.update_tracker(dif.SuccessTracker(k=3), "d1/logic", [1, 0, 0, 1])
    t = dif.update_tracker(t, "d2/syntax", [0.0])
    back = dif.SuccessTracker.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    bad = t.to_dict()
    bad["rates"].pop("d2/syntax")
    with pytest.raises(ValueError, match="same keys"):
        dif.SuccessTracker.from_dict(bad)


def test_in_band_edges_and_validation():
    assert dif.in_band(0.2) and dif.in_band(0.8) and dif.in_band(0.5)
    assert not dif.in_band(0.19) and not dif.in_band(0.81)
    assert dif.in_band(0.95, low=0.9, high=1.0)
    with pytest.raises(ValueError, match="low"):
        dif.in_band(0.5, low=0.9, high=0.1)


def test_accept_probability_cases():
    t = dif.update_tracker(dif.SuccessTracker(k=4), "hard", np.zeros(4))
    t = dif.update_tracker(t, "mid", [1, 0, 1, 0])
    t = dif.update_tracker(t, "new", [1, 1])
    kw = dict(low=0.2, high=0.8, out_of_band_prob=0.1)
    assert dif.accept_probability(t, "hard", **kw) == 0.1
    assert dif.accept_probability(t, "mid", **kw) == 1.0
    assert dif.accept_probability(t, "new", **kw) == 1.0  # unestimated: explored
    assert dif.accept_probability(t, "unseen", **kw) == 1.0
    with pytest.raises(ValueError, match="out_of_band_prob"):
        dif.accept_probability(t, "mid", out_of_band_prob=2.0)


def test_bucket_key_forms():
    spec = {"seed": 12, "difficulty": 3, "bug_types": ("syntax", "logic"), "split": "train"}
    assert dif.bucket_key(spec) == "d3/logic+syntax"
    assert dif.bucket_key(spec, "task") == "train/s12/d3/logic+syntax"
    with pytest.raises(ValueError, match="track_by"):
        dif.bucket_key(spec, "seed")


def test_hash_uniform_deterministic_and_uniform():
    u = np.array([dif.hash_uniform(5, i) for i in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 2000) < 200)  # ~4.7 sigma
    assert dif.hash_uniform(5, 17) == u[17]
    v = np.array([dif.hash_uniform(6, i) for i in range(2000)])
    assert abs(np.corrcoef(u[:2000], v)[0, 1]) < 0.1
    w = np.array([dif.hash_uniform(s, 0) for s in range(2000)])  # across seeds too
    assert abs(w.mean() - 0.5) < 0.03


def test_is_informative_and_split():
    assert not dif.is_informative([1.0, 1.0, 1.0])
    assert not dif.is_informative([0.0])
    assert dif.is_informative([0.0, 1.0, 1.0])
    assert not dif.is_informative([0.5, 0.52], atol=0.05)
    assert dif.is_informative([0.5, 0.6], atol=0.05)
    with pytest.raises(ValueError, match="non-empty"):
        dif.is_informative([])
    with pytest.raises(ValueError, match="atol"):
        dif.is_informative([0.0, 1.0], atol=-1)
    groups = [{"rewards": [1, 1]}, {"rewards": [0, 1]}, {"rewards": [0, 0]}]
    kept, dropped = dif.split_informative(groups)
    assert kept == [groups[1]] and dropped == [groups[0], groups[2]]


def test_update_from_groups_uses_success_or_threshold():
    spec = {"seed": 0, "difficulty": 1, "bug_types": ("logic",), "split": "train"}
    groups = [
        {"spec": spec, "rewards": [0.9, 0.2, 0.7, 0.1]},  # threshold 0.5 -> 1, 0, 1, 0
        {"spec": spec, "rewards": [0.9, 0.9], "success": [0, 0]},  # explicit success wins
    ]
    t = dif.update_from_groups(dif.SuccessTracker(k=6), groups)
    assert t.counts["d1/logic"] == 6
    assert t.rates["d1/logic"] == pytest.approx(2 / 6)
