"""The pipeline's pure functions as `grain` transformations.

Use them on any grain dataset of specs or rollout groups, e.g.::

    tasks = task_dataset(...).map(MakeTask(factory))
    groups = grain.MapDataset.source(groups).filter(InformativeGroup())

They are stateless (their decisions depend only on the element and constructor arguments), so
grain may run them in any thread or read ahead without changing the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grain

from agentrl_jax.data.difficulty import (
    SuccessTracker,
    accept_probability,
    bucket_key,
    hash_uniform,
    is_informative,
)


class MakeTask(grain.transforms.Map):
    """spec -> ``{**spec, "task": factory(spec)}``."""

    def __init__(self, factory: Callable[[Mapping[str, Any]], Any]):
        self.factory = factory

    def map(self, element: Mapping[str, Any]) -> dict[str, Any]:
        return {**element, "task": self.factory(element)}


class AttachBucket(grain.transforms.Map):
    """spec -> ``{**spec, "bucket": bucket_key(spec, track_by)}``."""

    def __init__(self, track_by: str = "bucket"):
        bucket_key({"difficulty": 0, "bug_types": (), "split": "", "seed": 0}, track_by)
        self.track_by = track_by

    def map(self, element: Mapping[str, Any]) -> dict[str, Any]:
        return {**element, "bucket": bucket_key(element, self.track_by)}


class InformativeGroup(grain.transforms.Filter):
    """Keeps rollout groups whose ``"rewards"`` are not all equal (dynamic sampling)."""

    def __init__(self, atol: float = 0.0):
        if atol < 0:
            raise ValueError(f"atol={atol} must be >= 0")
        self.atol = atol

    def filter(self, element: Mapping[str, Any]) -> bool:
        return is_informative(element["rewards"], self.atol)


class InBand(grain.transforms.Filter):
    """Keeps specs accepted against a *frozen* tracker snapshot (band + out-of-band floor).

    The random draw is ``hash_uniform(seed, spec seed * 1009 + difficulty)``, a function of the
    spec alone, so the filter is a pure function of (tracker snapshot, spec). `TaskPipeline` does
    the same test outside grain because its tracker changes between batches.
    """

    def __init__(
        self,
        tracker: SuccessTracker,
        *,
        low: float = 0.2,
        high: float = 0.8,
        out_of_band_prob: float = 0.05,
        track_by: str = "bucket",
        seed: int = 0,
    ):
        accept_probability(tracker, "", low=low, high=high, out_of_band_prob=out_of_band_prob)
        bucket_key({"difficulty": 0, "bug_types": (), "split": "", "seed": 0}, track_by)
        self.tracker, self.low, self.high = tracker, low, high
        self.out_of_band_prob, self.track_by, self.seed = out_of_band_prob, track_by, seed

    def filter(self, element: Mapping[str, Any]) -> bool:
        p = accept_probability(
            self.tracker,
            bucket_key(element, self.track_by),
            low=self.low,
            high=self.high,
            out_of_band_prob=self.out_of_band_prob,
        )
        u = hash_uniform(self.seed, int(element["seed"]) * 1009 + int(element["difficulty"]))
        return u < p
