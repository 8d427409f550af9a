"""Tasks: a buggy program, its tests, a constraint and the prompt, deterministic per seed.

``make_task(seed, difficulty)`` is a pure function of its arguments. The constraint is one of
  * ``("no_modify", F)``: the lines of function ``F`` must be unchanged at submit;
  * ``("keep_signature", F)``: the ``def`` line of ``F`` must be unchanged at submit.
Breaking it fails the episode even when every test passes (goal adherence).
"""

from __future__ import annotations

import dataclasses
import random

from agentrl_jax.envs.coderepair.bugs import Bug, inject_bugs
from agentrl_jax.envs.coderepair.config import (
    BUG_TYPES,
    EnvConfig,
    difficulty_config,
    is_heldout_combo,
    split_of,
)
from agentrl_jax.envs.coderepair.generator import Test, make_repo
from agentrl_jax.envs.coderepair.language import function_spans

CONSTRAINT_KINDS = ("no_modify", "keep_signature")


@dataclasses.dataclass(frozen=True)
class Task:
    """One code-repair task.

    Attributes:
      seed, difficulty: what made it (``make_task(seed, difficulty)`` rebuilds it).
      split: ``'train'`` or ``'heldout'`` (from the seed).
      config: the difficulty's ``EnvConfig``.
      bug_types: one type per bug, sorted by line.
      bugs: the injected bugs (ground truth; the expert may read it, the model never sees it).
      lines: the buggy program, one word tuple per line.
      original: the correct program.
      tests: visible tests first, then hidden ones.
      tested, distractors: function names.
      constraint: ``(kind, function name)``, kind in ``CONSTRAINT_KINDS``.
      prompt: the request text (vocabulary words, ``\\n`` between lines).
    """

    seed: int
    difficulty: int
    split: str
    config: EnvConfig
    bug_types: tuple[str, ...]
    bugs: tuple[Bug, ...]
    lines: tuple[tuple[str, ...], ...]
    original: tuple[tuple[str, ...], ...]
    tests: tuple[Test, ...]
    tested: tuple[str, ...]
    distractors: tuple[str, ...]
    constraint: tuple[str, str]

    @property
    def visible_tests(self) -> tuple[Test, ...]:
        return tuple(t for t in self.tests if not t.hidden)

    @property
    def prompt(self) -> str:
        return render_prompt(self)


def constraint_text(constraint: tuple[str, str]) -> str:
    kind, fn = constraint
    if kind == "no_modify":
        return f"rule : do not modify function {fn} ."
    return f"rule : keep the signature of function {fn} ."


def render_lines(lines, lo: int = 0, hi: int | None = None) -> list[str]:
    """``"Lk word word ..."`` for lines ``lo..hi`` inclusive."""
    hi = len(lines) - 1 if hi is None else hi
    return [f"L{k} " + " ".join(lines[k]) for k in range(lo, hi + 1)]


def render_listing(lines) -> list[str]:
    """``"name Ls Le"`` per function (works on broken programs)."""
    return [f"{name} L{s} L{e}" for name, (s, e) in function_spans(lines).items()]


def render_prompt(task: Task) -> str:
    head = [f"task : fix the code so all tests pass . {constraint_text(task.constraint)}"]
    if task.config.show_program:
        return "\n".join(head + ["program :"] + render_lines(task.lines))
    return "\n".join(head + ["functions :"] + render_listing(task.lines))


def _sample_bug_types(rng: random.Random, n: int, split: str) -> tuple[str, ...]:
    while True:
        types = tuple(rng.choice(BUG_TYPES) for _ in range(n))
        if split == "heldout" or not is_heldout_combo(types):
            return types


def make_task(seed: int, difficulty: int, *, bug_types: tuple[str, ...] | None = None) -> Task:
    """Builds the task of ``seed`` at ``difficulty``; deterministic.

    Args:
      seed: in ``[0, MAX_SEED)``; the range decides the split (``config.split_of``).
      difficulty: level in ``[0, len(DIFFICULTIES))``.
      bug_types: force these bug types (length must equal the level's ``n_bugs``); by default
        they are sampled uniformly, excluding ``HELDOUT_COMBO`` for train seeds (forced types
        are used as given, whatever the split).

    Raises:
      ValueError: bad seed, difficulty, bug type or number of bug types.
    """
    split = split_of(seed)
    cfg = difficulty_config(difficulty)
    if bug_types is not None:
        bad = [t for t in bug_types if t not in BUG_TYPES]
        if bad:
            raise ValueError(f"bug_types {bad} must be in {BUG_TYPES}")
        if len(bug_types) != cfg.n_bugs:
            raise ValueError(f"len(bug_types)={len(bug_types)} must be n_bugs={cfg.n_bugs}")
    rng = random.Random(f"coderepair-{seed}-{difficulty}")
    types = tuple(bug_types) if bug_types is not None else _sample_bug_types(rng, cfg.n_bugs, split)
    for _ in range(500):
        repo = make_repo(
            rng, cfg.n_functions, cfg.n_distractors, cfg.n_visible_tests, cfg.n_hidden_tests
        )
        kind = rng.choice(CONSTRAINT_KINDS)
        free = [f for f in repo.tested + repo.distractors]
        target = rng.choice(free)
        eligible = [f for f in repo.tested if not (kind == "no_modify" and f == target)]
        if not eligible:
            continue
        injected = inject_bugs(rng, repo.lines, repo.tests, eligible, types, cfg.step_budget)
        if injected is None:
            continue
        lines, bugs = injected
        return Task(
            seed=seed,
            difficulty=difficulty,
            split=split,
            config=cfg,
            bug_types=tuple(b.type for b in bugs),
            bugs=bugs,
            lines=lines,
            original=repo.lines,
            tests=repo.tests,
            tested=repo.tested,
            distractors=repo.distractors,
            constraint=(kind, target),
        )
    raise RuntimeError(f"no task for seed={seed} difficulty={difficulty} types={types}")
