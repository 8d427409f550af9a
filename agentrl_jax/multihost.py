"""Host-side helpers of a multi-process run (one JAX process per host or per GPU).

Every process runs the same program. Device arrays are shared through ``jit`` over the global
mesh; host objects that one process makes and the others need (the run directory's path, the
episodes a process played) go through :func:`allgather_objects`, which rides on JAX's own
``multihost_utils.process_allgather``. With one process every function here is a no-op or the
identity, so single-process runs do not touch a collective.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np


def is_primary() -> bool:
    """Whether this is process 0 (the one that writes logs, summaries and the run's files)."""
    return jax.process_index() == 0


def shard_range(n: int, index: int | None = None, count: int | None = None) -> tuple[int, int]:
    """``(lo, hi)``: the contiguous block of ``range(n)`` process ``index`` of ``count`` owns.

    The blocks of processes 0..count-1 are disjoint, in order and cover ``range(n)``; their sizes
    differ by at most one (the first ``n % count`` processes take one more).

    Raises:
      ValueError: ``n`` < 0, ``count`` < 1 or ``index`` outside ``[0, count)``.
    """
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if n < 0 or count < 1 or not 0 <= index < count:
        raise ValueError(f"shard_range: n={n} must be >= 0 and index={index} in [0, {count})")
    base, extra = divmod(n, count)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order; ``[obj]`` with one process.

    All processes must call it together (it is a collective).
    """
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
    width = int(sizes.max())
    padded = np.zeros((width,), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(rows[i, : int(n)].tobytes()) for i, n in enumerate(sizes.reshape(-1))]


def broadcast_object(obj: Any) -> Any:
    """Process 0's ``obj`` on every process (a collective; ``obj`` itself with one process)."""
    return allgather_objects(obj)[0]


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier ``name`` (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
