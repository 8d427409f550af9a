"""Difficulty levels, bug types and the train / held-out split of the Python repair tasks.

Difficulty levels (``difficulty_config(level)``):

====  ====  =======================  ==============  =========  ========
lvl   bugs  where                    program shown   max turns  problems
====  ====  =======================  ==============  =========  ========
0     1     the tested function      yes             10         HumanEval
1     2     the tested function      yes             14         HumanEval
2     1     one of up to 3 helpers   no (``view``)   14         HumanEval
3     1     the tested function      yes, + failure  2          basics
====  ====  =======================  ==============  =========  ========

At level 2 parts of the tested function are moved into helper functions (each checked to keep
every test passing) and the bug is put in one of them: the failing test points at the tested
function, the model must find the helper.

Level 3 is sized for a small pretrained chat model (``basics.py``: short beginner-style
functions with a one-line docstring). The first message shows the function and the failing
visible test's output; the action is the whole corrected program (``code_action``: the tool
``write_code``, which a chat model calls by writing a fenced code block), which replaces
``solution.py`` and runs the visible tests; once they all pass the program is submitted.

Split: problems (HumanEval or basic) whose index is ``4 mod 5`` are held out (never trained
on); seeds ``[0, HELDOUT_SEED_START)`` draw train problems, ``[HELDOUT_SEED_START, MAX_SEED)``
held-out ones.
Two-bug tasks whose types contain ``HELDOUT_COMBO`` are drawn only for held-out seeds.
"""

from __future__ import annotations

import dataclasses

BUG_TYPES = (
    "operator",
    "comparison",
    "off_by_one",
    "wrong_variable",
    "constant",
    "dropped_statement",
    "swapped_arguments",
    "wrong_return",
)
HELDOUT_COMBO = frozenset({"off_by_one", "wrong_variable"})
HELDOUT_SEED_START = 1_000_000
MAX_SEED = 2_000_000
HELDOUT_EVERY = 5  # problem index % 5 == 4 -> held out
SPLITS = ("train", "heldout")
SOURCES = ("humaneval", "basics")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Knobs of one difficulty level. Every bad value raises ``ValueError`` naming the field.

    Attributes:
      n_bugs: injected bugs (on distinct lines), 1..3.
      n_helpers: helper functions split out of the tested function, 0..4 (0: none).
      bug_in_helper: the bugs go into the helpers (needs ``n_helpers >= 1``).
      max_visible_tests: tests shown to the agent (at most half of a problem's tests, at least
        one); the rest are hidden and decide the outcome with them.
      show_program: the first message lists ``solution.py``; otherwise the agent must ``view``.
      max_turns: model turns before the episode ends unsolved, 2..200.
      max_output_chars: ``run_tests`` output is cut to this many characters, 200..100000.
      max_view_lines: lines one ``view`` shows, 5..1000.
      max_file_chars: largest file an ``edit`` may produce, 1000..1000000.
      test_timeout_s: wall-clock limit of one test inside a run, in (0, 60].
      run_timeout_s: wall-clock limit of one sandboxed test run, in (0, 600].
      source: where problems come from: ``'humaneval'`` or ``'basics'`` (``basics.py``).
      show_failure: the first message shows the failing visible test's output.
      code_action: the one tool is ``write_code(code)`` (module docstring) instead of
        view / run_tests / edit / submit.
    """

    n_bugs: int = 1
    n_helpers: int = 0
    bug_in_helper: bool = False
    max_visible_tests: int = 3
    show_program: bool = True
    max_turns: int = 10
    max_output_chars: int = 2000
    max_view_lines: int = 80
    max_file_chars: int = 20000
    test_timeout_s: float = 1.0
    run_timeout_s: float = 30.0
    source: str = "humaneval"
    show_failure: bool = False
    code_action: bool = False

    def __post_init__(self):
        _check("n_bugs", self.n_bugs, 1, 3)
        _check("n_helpers", self.n_helpers, 0, 4)
        if self.bug_in_helper and self.n_helpers < 1:
            raise ValueError(f"bug_in_helper needs n_helpers >= 1, got {self.n_helpers}")
        _check("max_visible_tests", self.max_visible_tests, 1, 20)
        _check("max_turns", self.max_turns, 2, 200)
        _check("max_output_chars", self.max_output_chars, 200, 100_000)
        _check("max_view_lines", self.max_view_lines, 5, 1000)
        _check("max_file_chars", self.max_file_chars, 1000, 1_000_000)
        if not 0 < self.test_timeout_s <= 60:
            raise ValueError(f"test_timeout_s={self.test_timeout_s} must be in (0, 60]")
        if not 0 < self.run_timeout_s <= 600:
            raise ValueError(f"run_timeout_s={self.run_timeout_s} must be in (0, 600]")
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} must be one of {SOURCES}")
        if self.code_action and not self.show_program:
            raise ValueError("code_action needs show_program (the agent cannot view files)")


def _check(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")


DIFFICULTIES: tuple[EnvConfig, ...] = (
    EnvConfig(n_bugs=1, max_turns=10),
    EnvConfig(n_bugs=2, max_turns=14),
    EnvConfig(n_bugs=1, n_helpers=3, bug_in_helper=True, show_program=False, max_turns=14),
    EnvConfig(n_bugs=1, max_turns=2, source="basics", show_failure=True, code_action=True),
)
BUGS_PER_DIFFICULTY = tuple(c.n_bugs for c in DIFFICULTIES)


def difficulty_config(level: int) -> EnvConfig:
    """The ``EnvConfig`` of difficulty ``level``. Raises ValueError outside the levels."""
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


def problem_split(index: int) -> str:
    """The split of HumanEval problem ``index`` (its number in ``HumanEval/N``)."""
    return "heldout" if index % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"


def is_heldout_combo(bug_types: tuple[str, ...]) -> bool:
    """Whether a bug-type combination is reserved for the held-out split."""
    return HELDOUT_COMBO <= set(bug_types)
