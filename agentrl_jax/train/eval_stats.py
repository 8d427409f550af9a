"""Statistics of evaluation results: paired gains on the same tasks, unbiased pass@j."""

from __future__ import annotations

from typing import Any

import numpy as np


def paired_gain(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Success of ``after`` minus ``before`` on the same tasks, with its paired standard error.

    With per-task differences d_i = a_i - b_i in {-1, 0, 1} over n tasks, ``fixed`` = #(d_i = 1)
    (solved only after), ``broken`` = #(d_i = -1):

      delta = (fixed - broken) / n
      stderr = sqrt(s^2 / n),  s^2 = (fixed + broken - (fixed - broken)^2 / n) / (n - 1)

    (the sample variance of d, never negative; 0 when n = 1). Pairing removes the variance of
    task difficulty that two independent binomial errors would count twice.

    Args:
      before, after: result dicts of ``evaluate`` (need ``episode_success``) on the same tasks.

    Returns:
      ``{"delta", "stderr", "fixed", "broken", "n"}``.

    Raises:
      ValueError: a result without ``episode_success``, or different episode counts.
    """
    for name, res in (("before", before), ("after", after)):
        if "episode_success" not in res:
            raise ValueError(f"{name} has no episode_success (a result of an older evaluate?)")
    b = np.asarray(before["episode_success"], int)
    a = np.asarray(after["episode_success"], int)
    if b.shape != a.shape or b.ndim != 1 or not len(b):
        raise ValueError(f"before and after must cover the same tasks: {len(b)} vs {len(a)}")
    n = len(b)
    fixed, broken = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    delta = (fixed - broken) / n
    var = (fixed + broken - (fixed - broken) ** 2 / n) / (n - 1) if n > 1 else 0.0
    return {
        "delta": delta,
        "stderr": float(np.sqrt(var / n)),
        "fixed": fixed,
        "broken": broken,
        "n": n,
    }


def pass_at_estimates(successes: np.ndarray, j: int) -> np.ndarray:
    """Unbiased pass@j per task from ``n`` samples of which ``c`` succeeded (Chen et al. 2021):

      pass@j = 1 - C(n - c, j) / C(n, j)

    the chance that ``j`` of the ``n`` samples, drawn without replacement, hold a success.

    Args:
      successes: bool/int [n, T], sample x task.
      j: 1 <= j <= n.

    Returns:
      f64 [T].
    """
    s = np.asarray(successes, bool)
    n = s.shape[0]
    if not 1 <= j <= n:
        raise ValueError(f"j={j} must be in [1, {n}] (the samples per task)")
    fails = n - s.sum(axis=0)
    # C(f, j) / C(n, j) = prod_{i<j} (f - i) / (n - i), 0 once i reaches f
    ratio = np.prod([np.clip(fails - i, 0, None) / (n - i) for i in range(j)], axis=0)
    return 1.0 - ratio
