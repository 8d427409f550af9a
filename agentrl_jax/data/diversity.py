"""Diversity: bug-type strata, round-robin batch composition, per-type metrics.

The pipeline's strata are bug types: stratum ``t`` holds every task whose bug combination
contains ``t``. With balancing on, it fills batch slot ``j`` from stratum
``strata[(offset + j) % S]`` (`round_robin`) and advances ``offset`` by the batch size, so over
consecutive batches every bug type gets the same number of slots (within one) whatever the batch
size. `stratum` names a task's combination (``"logic+syntax"``) for reports.

Metrics count a group once for every bug type it contains, so a two-bug task shows up under both
of its types; success rates average over rollouts (not groups).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from agentrl_jax.data.difficulty import group_successes


def stratum(spec: Mapping[str, Any]) -> str:
    """Stratum (bug-type combination name) of a spec, e.g. ``"logic+syntax"``."""
    return "+".join(sorted(spec["bug_types"]))


def round_robin(strata: Sequence[str], n: int, offset: int = 0) -> list[str]:
    """Stratum of each of ``n`` slots: ``strata[(offset + j) % len(strata)]``.

    Raises:
      ValueError: no strata or ``n < 0``.
    """
    if not strata:
        raise ValueError("strata must be non-empty")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    return [strata[(offset + j) % len(strata)] for j in range(n)]


def type_counts(
    specs: Iterable[Mapping[str, Any]], bug_types: Sequence[str] | None = None
) -> dict[str, int]:
    """Number of specs containing each bug type (types in ``bug_types`` appear even at 0)."""
    counts = {t: 0 for t in bug_types or ()}
    for spec in specs:
        for t in set(spec["bug_types"]):
            counts[t] = counts.get(t, 0) + 1
    return dict(sorted(counts.items()))


def imbalance(counts: Mapping[str, int]) -> float:
    """``max / min`` of the counts (1 = perfectly balanced, inf if a type is missing)."""
    values = list(counts.values())
    if not values:
        return 1.0
    lo, hi = min(values), max(values)
    return float(hi) / lo if lo > 0 else float("inf")


def bug_type_metrics(
    groups: Iterable[Mapping[str, Any]],
    bug_types: Sequence[str] | None = None,
    *,
    success_threshold: float = 0.5,
) -> dict[str, float]:
    """Per-bug-type and per-difficulty counts and success rates of rollout groups.

    Args:
      groups: ``{"spec": spec, "rewards": [G], "success"?: [G]}`` records.
      bug_types: types whose count is always reported (0 when absent; an absent type has no
        success rate: a NaN scalar would make every step's TensorBoard write warn).
      success_threshold: reward above which a rollout counts as solved when ``"success"`` is absent.

    Returns:
      ``{"bug_type/<t>/count", "bug_type/<t>/success_rate", "difficulty/<d>/count",
      "difficulty/<d>/success_rate", "bug_type/imbalance"}`` as floats; counts are groups,
      success rates are means over rollouts, the imbalance is over the types present (a type
      the pipeline skips shows as count 0, not as an infinite imbalance).
    """
    solved: dict[str, list[float]] = {t: [] for t in bug_types or ()}
    n_groups: dict[str, int] = {t: 0 for t in bug_types or ()}
    by_difficulty: dict[int, list[float]] = {}
    d_groups: dict[int, int] = {}
    for group in groups:
        x = group_successes(group, success_threshold).tolist()
        spec = group["spec"]
        for t in set(spec["bug_types"]):
            solved.setdefault(t, []).extend(x)
            n_groups[t] = n_groups.get(t, 0) + 1
        d = int(spec["difficulty"])
        by_difficulty.setdefault(d, []).extend(x)
        d_groups[d] = d_groups.get(d, 0) + 1
    metrics: dict[str, float] = {}
    for t in sorted(solved):
        metrics[f"bug_type/{t}/count"] = float(n_groups[t])
        if solved[t]:
            metrics[f"bug_type/{t}/success_rate"] = float(np.mean(solved[t]))
    for d in sorted(by_difficulty):
        metrics[f"difficulty/{d}/count"] = float(d_groups[d])
        metrics[f"difficulty/{d}/success_rate"] = float(np.mean(by_difficulty[d]))
    metrics["bug_type/imbalance"] = imbalance({t: n for t, n in n_groups.items() if n})
    return metrics
