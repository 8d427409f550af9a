"""Task sources: deterministic, lazily enumerated task specs as `grain` datasets.

A *task spec* is a plain dict, cheap to create, JSON-serialisable and independent of the
environment module::

    {"seed": int, "difficulty": int, "bug_types": tuple[str, ...], "split": str}

The environment turns a spec into a task through a callable passed in by the caller (see
`make_task_factory` and `transforms.MakeTask`), so nothing here imports an environment.

Splits:
- ``"train"``: the train seed range, every bug combination except held-out ones.
- ``"heldout"``: the held-out seed range, the same bug combinations as train.
- ``"heldout_combo"``: the held-out seed range, only combinations containing every type of the
  held-out combination (never seen in training).

A source is a grid of *cells* ``(difficulty, bug_types)`` crossed with a seed range, indexed
arithmetically (equal weight per difficulty, then per cell; see `TaskSpecSource`), so every task
is reachable without materialising the grid. `task_dataset` shuffles it with grain (a fresh
permutation every epoch) and repeats it forever; its iterator state is a small JSON dict
(``{"next_index": n}``) that `set_state` restores exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import grain

SPLITS = ("train", "heldout", "heldout_combo")

TaskSpec = dict[str, Any]
Cell = tuple[int, tuple[str, ...]]


def combo_name(bug_types: Sequence[str]) -> str:
    """Canonical name of a bug-type combination, e.g. ``("syntax", "logic") -> "logic+syntax"``."""
    return "+".join(sorted(bug_types))


def is_heldout(combo: Sequence[str], heldout_combo: Sequence[str] | None) -> bool:
    """Whether a combination is held out for evaluation: it contains every held-out type."""
    return bool(heldout_combo) and set(heldout_combo) <= set(combo)


def bug_combos(
    bug_types: Sequence[str],
    n_bugs: int,
    *,
    heldout_combo: Sequence[str] | None,
    split: str,
    repeat: bool = True,
) -> tuple[tuple[str, ...], ...]:
    """Bug-type combinations of ``n_bugs`` bugs that a split uses.

    Combinations are sorted multisets (``repeat``: a type may occur several times, as when the
    environment samples one type per bug) or sets. A combination containing every type of
    ``heldout_combo`` is held out (`is_heldout`): removed from ``train``/``heldout``, and the only
    kind ``heldout_combo`` uses.

    Args:
      bug_types: the environment's bug type names (distinct, non-empty).
      n_bugs: bugs per task (>= 1).
      heldout_combo: bug types of the held-out combination, or None.
      split: one of `SPLITS`.
      repeat: allow a bug type more than once.

    Returns:
      Sorted tuple of sorted bug-type tuples (possibly empty, e.g. ``heldout_combo`` with one bug).

    Raises:
      ValueError: unknown split, empty/duplicate bug types, held-out types not in ``bug_types``,
        ``n_bugs`` < 1 or (without ``repeat``) more than the number of types.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if not bug_types or len(set(bug_types)) != len(bug_types):
        raise ValueError(f"bug_types={tuple(bug_types)} must be non-empty and distinct")
    if not 1 <= n_bugs <= (64 if repeat else len(bug_types)):
        raise ValueError(f"n_bugs={n_bugs} must be in [1, {64 if repeat else len(bug_types)}]")
    if heldout_combo and not set(heldout_combo) <= set(bug_types):
        raise ValueError(
            f"heldout_combo={tuple(heldout_combo)} must be a subset of bug_types={tuple(bug_types)}"
        )
    pick = itertools.combinations_with_replacement if repeat else itertools.combinations
    combos = list(pick(sorted(bug_types), n_bugs))
    want_held = split == "heldout_combo"
    return tuple(c for c in combos if is_heldout(c, heldout_combo) == want_held)


def split_cells(
    split: str,
    difficulties: Sequence[int],
    bug_types: Sequence[str],
    *,
    bugs_per_difficulty: Sequence[int],
    heldout_combo: Sequence[str] | None = None,
    repeat: bool = True,
) -> tuple[Cell, ...]:
    """All ``(difficulty, bug_types)`` cells of a split, in a fixed order (see `bug_combos`).

    Args:
      bugs_per_difficulty: ``bugs_per_difficulty[d]`` bugs per task at difficulty ``d``.

    Raises:
      ValueError: no difficulties, a difficulty outside ``[0, len(bugs_per_difficulty))``, or
        what `bug_combos` raises.
    """
    if not difficulties:
        raise ValueError("difficulties must be non-empty")
    n_levels = len(bugs_per_difficulty)
    for d in difficulties:
        if not 0 <= d < n_levels:
            raise ValueError(f"difficulty={d} must be in [0, len(bugs_per_difficulty)={n_levels})")
    return tuple(
        (int(d), combo)
        for d in sorted(set(difficulties))
        for combo in bug_combos(
            bug_types,
            bugs_per_difficulty[d],
            heldout_combo=heldout_combo,
            split=split,
            repeat=repeat,
        )
    )


class TaskSpecSource:
    """Random-access grain data source over ``cells x range(seed_lo, seed_hi)``.

    Difficulties get equal weight, and cells (bug combinations) equal weight within a difficulty:
    element ``i`` has difficulty ``D[i % nD]`` (``D`` the sorted distinct difficulties of
    ``cells``); with ``j = i // nD`` and ``C_d`` that difficulty's cells (in the given order), its
    cell is ``C_d[j % len(C_d)]`` and its seed ``seed_lo + (j // len(C_d)) % n_seeds``. The length
    is ``nD * max_d len(C_d) * n_seeds``, so difficulties with fewer cells revisit tasks within
    one epoch. Nothing is materialised.
    """

    def __init__(self, split: str, cells: Sequence[Cell], seed_range: tuple[int, int]):
        """Builds the source.

        Raises:
          ValueError: unknown split, no cells, or an empty/negative seed range.
        """
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}")
        if not cells:
            raise ValueError(f"cells must be non-empty (split={split!r})")
        lo, hi = int(seed_range[0]), int(seed_range[1])
        if not 0 <= lo < hi:
            raise ValueError(f"seed_range={seed_range} must satisfy 0 <= lo < hi")
        self.split = split
        self.cells = tuple((int(d), tuple(b)) for d, b in cells)
        self.seed_range = (lo, hi)
        by_difficulty: dict[int, list[tuple[str, ...]]] = {}
        for d, b in self.cells:
            by_difficulty.setdefault(d, []).append(b)
        self._difficulties = tuple(sorted(by_difficulty))
        self._combos = tuple(tuple(by_difficulty[d]) for d in self._difficulties)
        self._n_seeds = hi - lo
        self._len = len(self._difficulties) * max(map(len, self._combos)) * self._n_seeds

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> TaskSpec:
        if not 0 <= index < self._len:
            raise IndexError(f"index={index} out of range [0, {self._len})")
        j, d_idx = divmod(int(index), len(self._difficulties))
        combos = self._combos[d_idx]
        seed_offset, c_idx = divmod(j, len(combos))
        return {
            "seed": self.seed_range[0] + seed_offset % self._n_seeds,
            "difficulty": self._difficulties[d_idx],
            "bug_types": combos[c_idx],
            "split": self.split,
        }

    def __repr__(self) -> str:
        n = len(self.cells)
        return f"TaskSpecSource(split={self.split!r}, cells={n}, seeds={self.seed_range})"


def task_dataset(
    split: str,
    cells: Sequence[Cell],
    seed_range: tuple[int, int],
    shuffle_seed: int | None,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.MapDataset:
    """Infinite, deterministic `grain.MapDataset` of task specs.

    Shuffled with ``shuffle_seed`` (reshuffled every epoch; None keeps grid order), repeated
    forever, then sharded: shard ``s`` of ``n`` takes elements ``s, s + n, ...``, so processes of a
    multi-host run draw disjoint streams.

    Raises:
      ValueError: bad split/cells/seed range (see `TaskSpecSource`) or shard index out of range.
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in [0, shard_count={shard_count})")
    ds = grain.MapDataset.source(TaskSpecSource(split, cells, seed_range))
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=int(shuffle_seed))
    ds = ds.repeat(None)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    return ds


def task_iterator(ds: grain.MapDataset) -> grain.DatasetIterator:
    """Single-threaded iterator over a task dataset (state: ``{"next_index": n}``, JSON-safe).

    Specs are cheap, so reading threads would only contend for the GIL; with no threads the
    iterator never reads ahead, and ``get_state`` is exactly the position of the next element.
    """
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(ds.to_iter_dataset(read))


def make_task_factory(make_task: Callable[..., Any]) -> Callable[[TaskSpec], Any]:
    """Adapts ``make_task(seed, difficulty, *, bug_types)`` to a ``factory(spec) -> task``."""

    def factory(spec: TaskSpec) -> Any:
        return make_task(spec["seed"], spec["difficulty"], bug_types=tuple(spec["bug_types"]))

    return factory


def spec_only(item: TaskSpec) -> TaskSpec:
    """The four spec fields of an item (drops ``"task"`` and any other key)."""
    return {k: item[k] for k in ("seed", "difficulty", "bug_types", "split")}
