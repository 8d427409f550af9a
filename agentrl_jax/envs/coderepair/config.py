"""Difficulty knobs, bug-type names and the train / held-out split of the code-repair tasks.

Difficulty levels (``difficulty_config(level)``):

====  =====  ===========  ====  ==================  =============  =========
lvl   fns    distractors  bugs  tests vis/hid (fn)  program shown  max turns
====  =====  ===========  ====  ==================  =============  =========
0     2      0            1     2 / 2               yes            8
1     3      1            1     2 / 2               yes            10
2     5      2            2     2 / 3               no (view)      16
3     8      4            3     2 / 3               no (view)      24
4     12     6            6     3 / 3               yes            48
====  =====  ===========  ====  ==================  =============  =========

Level 1 is the default "medium" (a few hundred tokens per episode); level 4 is the long-context
level (thousands of tokens, the rule stated once at the start).

Split: seeds ``[0, HELDOUT_SEED_START)`` are train, ``[HELDOUT_SEED_START, MAX_SEED)`` held out.
Tasks that contain both ``off_by_one`` and ``missing_dependency`` (``HELDOUT_COMBO``) are only
sampled for held-out seeds: a model trained on the train split never saw that combination.
"""

from __future__ import annotations

import dataclasses

BUG_TYPES = ("syntax", "logic", "off_by_one", "missing_dependency")
HELDOUT_COMBO = frozenset({"off_by_one", "missing_dependency"})
HELDOUT_SEED_START = 1_000_000
MAX_SEED = 2_000_000
SPLITS = ("train", "heldout")
MAX_LINES = 192  # line-id tokens L0 .. L191
MAX_TESTS = 48  # test-id tokens T0 .. T47


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Knobs of one difficulty level. Every bad value raises ``ValueError`` naming the field.

    Attributes:
      n_functions: tested functions (the bugs live in these).
      n_distractors: extra untested, uncalled functions (reading noise).
      n_bugs: injected bugs (distinct lines).
      n_visible_tests: visible tests per tested function.
      n_hidden_tests: hidden tests per tested function (checked only at submit).
      show_program: the prompt lists the program; otherwise only function names and line ranges.
      max_turns: model turns before the episode ends unsolved.
      max_failures_shown: failing tests listed by ``run`` (the first one gets a value trace).
      max_trace_lines: trace lines shown for the first failing test.
      step_budget: interpreter instructions per test (more is a ``timeout``).
      time_limit_s: wall-clock limit of one tool call.
      max_edit_lines: lines one ``edit`` may write.
      golden_trace: ``run`` marks the first traced line whose value differs from the reference
        solution's with ``want V`` and points the cursor at it (see ``tools``).
    """

    n_functions: int = 3
    n_distractors: int = 1
    n_bugs: int = 1
    n_visible_tests: int = 2
    n_hidden_tests: int = 2
    show_program: bool = True
    max_turns: int = 10
    max_failures_shown: int = 3
    max_trace_lines: int = 10
    step_budget: int = 5000
    time_limit_s: float = 2.0
    max_edit_lines: int = 8
    golden_trace: bool = True

    def __post_init__(self):
        _check("n_functions", self.n_functions, 1, 12)
        _check("n_distractors", self.n_distractors, 0, 8)
        _check("n_bugs", self.n_bugs, 1, 8)
        if self.n_functions + self.n_distractors > 24:
            raise ValueError("n_functions + n_distractors must be <= 24 (the function-name pool)")
        if self.n_bugs > self.n_functions:
            raise ValueError(f"n_bugs={self.n_bugs} must be <= n_functions={self.n_functions}")
        _check("n_visible_tests", self.n_visible_tests, 1, 4)
        _check("n_hidden_tests", self.n_hidden_tests, 0, 6)
        if self.n_functions * self.n_visible_tests > MAX_TESTS:
            raise ValueError(f"n_functions * n_visible_tests must be <= {MAX_TESTS}")
        _check("max_turns", self.max_turns, 2, 200)
        _check("max_failures_shown", self.max_failures_shown, 1, MAX_TESTS)
        _check("max_trace_lines", self.max_trace_lines, 0, 64)
        _check("step_budget", self.step_budget, 100, 10**7)
        _check("max_edit_lines", self.max_edit_lines, 1, 32)
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s={self.time_limit_s} must be > 0")


def _check(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")


DIFFICULTIES: tuple[EnvConfig, ...] = (
    EnvConfig(n_functions=2, n_distractors=0, n_bugs=1, n_hidden_tests=2, max_turns=8),
    EnvConfig(n_functions=3, n_distractors=1, n_bugs=1, n_hidden_tests=2, max_turns=10),
    EnvConfig(
        n_functions=5, n_distractors=2, n_bugs=2, n_hidden_tests=3, show_program=False, max_turns=16
    ),
    EnvConfig(
        n_functions=8, n_distractors=4, n_bugs=3, n_hidden_tests=3, show_program=False, max_turns=24
    ),
    EnvConfig(
        n_functions=12,
        n_distractors=6,
        n_bugs=6,
        n_visible_tests=3,
        n_hidden_tests=3,
        show_program=True,
        max_turns=48,
        max_failures_shown=4,
    ),
)


def difficulty_config(level: int) -> EnvConfig:
    """The ``EnvConfig`` of difficulty ``level`` (0 easy .. 3 hardest). Raises ValueError."""
    if not 0 <= level < len(DIFFICULTIES):
        raise ValueError(f"difficulty={level} must be in [0, {len(DIFFICULTIES) - 1}]")
    return DIFFICULTIES[level]


def split_of(seed: int) -> str:
    """``'train'`` or ``'heldout'`` for a task seed. Raises ValueError outside ``[0, MAX_SEED)``."""
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed={seed} must be in [0, {MAX_SEED})")
    return "train" if seed < HELDOUT_SEED_START else "heldout"


def seed_range(split: str) -> range:
    """The seeds of ``split`` (``'train'`` or ``'heldout'``). Raises ValueError."""
    if split == "train":
        return range(0, HELDOUT_SEED_START)
    if split == "heldout":
        return range(HELDOUT_SEED_START, MAX_SEED)
    raise ValueError(f"split={split!r} must be one of {SPLITS}")


def is_heldout_combo(bug_types: tuple[str, ...]) -> bool:
    """Whether a bug-type combination is reserved for the held-out split."""
    return HELDOUT_COMBO <= set(bug_types)
