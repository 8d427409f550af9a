"""Difficulty-stratified sampling: success-rate estimates, the band, dynamic sampling.

Success rates are tracked per *bucket* — ``(difficulty, bug_types)``, the default — or per task
(``(split, seed, difficulty, bug_types)``, useful only when a small task pool is revisited).
The estimate of a key after its ``n``-th sample ``x_n`` (1 = solved, 0 = not) is

    rate_n = rate_{n-1} + alpha_n * (x_n - rate_{n-1}),   alpha_n = max(1 / n, 1 / k)

i.e. the exact mean of the first ``k`` samples, then an exponential moving average with an
effective window of ``k`` samples, so estimates follow the policy as it trains. A key is
*estimated* once it has ``k`` samples; before that it is explored (always accepted). Estimated
keys inside the band ``[low, high]`` are accepted, the others only with a small probability, so a
bucket that left the band is re-measured now and then and can come back.

Every function here is pure: `SuccessTracker` is a frozen dataclass, updates return a new one, and
random decisions use `hash_uniform(seed, counter)` so they replay exactly on resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

TRACK_BY = ("bucket", "task")
_MASK64 = (1 << 64) - 1


def bucket_key(spec: Mapping[str, Any], track_by: str = "bucket") -> str:
    """Tracker key of a task spec: ``"d<difficulty>/<combo>"`` or ``"<split>/s<seed>/d../.."``.

    Raises:
      ValueError: ``track_by`` not in ``("bucket", "task")``.
    """
    if track_by not in TRACK_BY:
        raise ValueError(f"track_by={track_by!r} must be one of {TRACK_BY}")
    key = f"d{int(spec['difficulty'])}/{'+'.join(sorted(spec['bug_types']))}"
    if track_by == "task":
        key = f"{spec['split']}/s{int(spec['seed'])}/{key}"
    return key


def in_band(rate: float, low: float = 0.2, high: float = 0.8) -> bool:
    """Whether a success rate lies in the closed band ``[low, high]``.

    Raises:
      ValueError: unless ``0 <= low <= high <= 1``.
    """
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"band low={low}, high={high} must satisfy 0 <= low <= high <= 1")
    return low <= rate <= high


@dataclasses.dataclass(frozen=True)
class SuccessTracker:
    """Per-key sample counts and success-rate estimates (immutable; see module docstring).

    Attributes:
      k: samples before a key counts as estimated; also the EMA window afterwards.
      counts: key -> number of samples seen.
      rates: key -> current success-rate estimate in [0, 1].
    """

    k: int = 8
    counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rates: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"k={self.k} must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable copy (str keys, ints and floats only)."""
        return {
            "k": int(self.k),
            "counts": {key: int(v) for key, v in self.counts.items()},
            "rates": {key: float(v) for key, v in self.rates.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SuccessTracker:
        """Inverse of `to_dict`.

        Raises:
          ValueError: counts and rates name different keys, or k < 1.
        """
        counts = {str(key): int(v) for key, v in d["counts"].items()}
        rates = {str(key): float(v) for key, v in d["rates"].items()}
        if counts.keys() != rates.keys():
            raise ValueError("tracker state: counts and rates must have the same keys")
        return cls(k=int(d["k"]), counts=counts, rates=rates)


def update_tracker(
    tracker: SuccessTracker, key: str, successes: Sequence[float] | np.ndarray
) -> SuccessTracker:
    """Folds one group's outcomes into the estimate of ``key`` (module-docstring recurrence).

    Args:
      tracker: current state.
      key: tracker key (see `bucket_key`).
      successes: [G] outcomes in [0, 1] (bools or floats), in rollout order.

    Returns:
      A new tracker; ``tracker`` is unchanged.

    Raises:
      ValueError: an outcome outside [0, 1] or not finite.
    """
    x = np.asarray(successes, dtype=np.float64).reshape(-1)
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0):
        raise ValueError(f"successes for {key!r} must be finite and in [0, 1], got {x.tolist()}")
    n = tracker.counts.get(key, 0)
    rate = tracker.rates.get(key, 0.0)
    for xi in x:
        n += 1
        rate += max(1.0 / n, 1.0 / tracker.k) * (float(xi) - rate)
    counts = {**tracker.counts, key: n}
    rates = {**tracker.rates, key: rate}
    return dataclasses.replace(tracker, counts=counts, rates=rates)


def is_estimated(tracker: SuccessTracker, key: str) -> bool:
    """Whether ``key`` has at least ``k`` samples."""
    return tracker.counts.get(key, 0) >= tracker.k


def estimate(tracker: SuccessTracker, key: str) -> float | None:
    """Success-rate estimate of ``key``, or None while it has fewer than ``k`` samples."""
    return tracker.rates[key] if is_estimated(tracker, key) else None


def accept_probability(
    tracker: SuccessTracker,
    key: str,
    *,
    low: float = 0.2,
    high: float = 0.8,
    out_of_band_prob: float = 0.05,
) -> float:
    """Probability of training on a task of ``key``: 1 if unestimated or in band, else the floor.

    Raises:
      ValueError: a bad band (see `in_band`) or ``out_of_band_prob`` outside [0, 1].
    """
    if not 0.0 <= out_of_band_prob <= 1.0:
        raise ValueError(f"out_of_band_prob={out_of_band_prob} must be in [0, 1]")
    rate = estimate(tracker, key)
    if rate is None or in_band(rate, low, high):
        return 1.0
    return out_of_band_prob


def hash_uniform(seed: int, counter: int) -> float:
    """Deterministic uniform in [0, 1) from ``(seed, counter)`` (splitmix64, stateless)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(counter) + 1) & _MASK64
    for _ in range(2):  # two rounds decorrelate neighbouring seeds as well as counters
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def is_informative(rewards: Sequence[float] | np.ndarray, atol: float = 0.0) -> bool:
    """Whether a group's rewards differ (max - min > atol): all-equal groups have zero advantage.

    Args:
      rewards: [G] rewards of one rollout group.
      atol: spread at or below which rewards count as equal (>= 0).

    Raises:
      ValueError: empty group, negative atol or non-finite rewards.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size == 0:
        raise ValueError("rewards of a group must be non-empty")
    if atol < 0:
        raise ValueError(f"atol={atol} must be >= 0")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return bool(r.max() - r.min() > atol)


def group_successes(group: Mapping[str, Any], success_threshold: float = 0.5) -> np.ndarray:
    """[G] float64 outcomes of a group: its ``"success"`` if given, else ``rewards > threshold``."""
    if group.get("success") is not None:
        return np.asarray(group["success"], dtype=np.float64).reshape(-1)
    return (np.asarray(group["rewards"], dtype=np.float64).reshape(-1) > success_threshold).astype(
        np.float64
    )


def update_from_groups(
    tracker: SuccessTracker,
    groups: Iterable[Mapping[str, Any]],
    *,
    track_by: str = "bucket",
    success_threshold: float = 0.5,
) -> SuccessTracker:
    """Folds every group (``{"spec": spec, "rewards": [G], "success"?: [G]}``) into the tracker.

    Degenerate (all-equal) groups are included: they are what shows a bucket left the band.
    """
    for group in groups:
        key = bucket_key(group["spec"], track_by)
        tracker = update_tracker(tracker, key, group_successes(group, success_threshold))
    return tracker


def split_informative(
    groups: Sequence[Mapping[str, Any]], atol: float = 0.0
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    """Dynamic sampling: ``(kept, dropped)`` where dropped groups have all-equal rewards."""
    kept, dropped = [], []
    for group in groups:
        (kept if is_informative(group["rewards"], atol) else dropped).append(group)
    return kept, dropped
