"""Tasks: a HumanEval problem with injected bugs, its visible and hidden tests, validated.

``make_task(seed, difficulty, *, bug_types)`` is deterministic: the seed picks the split (see
``config``) and a problem of that split (``seed mod n``, then the next ones if a problem admits
no such bug), and seeds the choice of helpers and mutations. A task is kept only if, run in the
sandbox,

  * the reference program (the canonical solution, after any helper extraction) passes every
    test, visible and hidden;
  * the buggy program fails at least one visible test, and no visible test hits the per-test
    time limit (``MUTANT_TEST_TIMEOUT_S``: a hanging mutant would make every ``run_tests``
    slow);
  * with several bugs, each bug alone fails at least one test (no bug is a no-op).

Up to ``CANDIDATES`` mutations are validated in one sandboxed batch. Built tasks are cached in
memory (``functools.lru_cache``), so the sandbox work is paid once per task and process. A level
with ``show_failure`` also records the visible tests' report on the buggy program (``failure``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import random
from typing import NamedTuple

from agentrl_jax.envs.pyrepair.basics import basic_problems_of_split
from agentrl_jax.envs.pyrepair.config import (
    BUG_TYPES,
    EnvConfig,
    difficulty_config,
    is_heldout_combo,
    split_of,
)
from agentrl_jax.envs.pyrepair.execution import Job, default_sandbox, evaluate_batch
from agentrl_jax.envs.pyrepair.mutations import Site, apply_sites, find_sites
from agentrl_jax.envs.pyrepair.problems import (
    SOLUTION_FILE,
    TEST_FILE,
    Problem,
    problems_of_split,
    render_tests,
)
from agentrl_jax.envs.pyrepair.prompts import user_prompt
from agentrl_jax.envs.pyrepair.refactor import extract_helpers

CANDIDATES = 8
REFERENCE_TEST_TIMEOUT_S = 2.0
MUTANT_TEST_TIMEOUT_S = 0.25  # a mutant slower than this is rejected (as hanging)
VALIDATION_RUN_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One injected bug, as a hunk of ``solution.py`` (1-based lines).

    Attributes:
      bug_type: one of ``BUG_TYPES``.
      function: the function it is in.
      line: first line of the hunk in the buggy file (a dropped statement: the line the missing
        lines go before).
      buggy: the hunk's lines in the buggy file (empty for a dropped statement).
      fixed: the lines that repair it (the reference program's).
      description: the mutation, e.g. ``"< -> <="``.
    """

    bug_type: str
    function: str
    line: int
    buggy: tuple[str, ...]
    fixed: tuple[str, ...]
    description: str

    @property
    def type(self) -> str:
        """The bug type (the name evaluation groups results by, as for every environment)."""
        return self.bug_type


@dataclasses.dataclass(frozen=True)
class Task:
    """One Python repair task.

    Attributes:
      seed, difficulty: what made it (``make_task(seed, difficulty)`` rebuilds it).
      split: ``'train'`` or ``'heldout'``.
      config: the difficulty's ``EnvConfig``.
      problem: HumanEval task id (``"HumanEval/N"``).
      entry_point: the tested function (its signature must be kept).
      bug_types: one per bug, by line.
      mutations: the injected bugs (ground truth; the expert reads it, the model never sees it).
      helpers: helper functions split out of the entry point (level 2), else empty.
      solution: the buggy ``solution.py``.
      reference: the repaired ``solution.py``.
      visible_tests: ``test_solution.py`` (shown, editable, not to be edited).
      hidden_tests: ``test_hidden.py`` (never shown; decides the outcome with the visible ones).
      n_visible, n_hidden: number of tests in each.
      failure: with ``config.show_failure``, the report of the visible tests on ``solution``
        (``prompts.failure_excerpt`` shows its failures); else empty.
    """

    seed: int
    difficulty: int
    split: str
    config: EnvConfig
    problem: str
    entry_point: str
    bug_types: tuple[str, ...]
    mutations: tuple[Mutation, ...]
    helpers: tuple[str, ...]
    solution: str
    reference: str
    visible_tests: str
    hidden_tests: str
    n_visible: int
    n_hidden: int
    failure: str = ""

    @property
    def bugs(self) -> tuple[Mutation, ...]:
        """``mutations`` under the name the mini-language task uses for its ground truth."""
        return self.mutations

    @property
    def files(self) -> dict[str, str]:
        """The agent's starting work tree."""
        return {SOLUTION_FILE: self.solution, TEST_FILE: self.visible_tests}

    @property
    def signature(self) -> str:
        """The ``def`` line of the entry point, e.g. ``def f(xs: List[int]) -> int:``."""
        return signature_of(self.reference, self.entry_point) or ""

    @property
    def prompt(self) -> str:
        """The first user message (``prompts.user_prompt``)."""
        return user_prompt(self)


def signature_of(source: str, name: str) -> str | None:
    """The normalised ``def`` line of top-level function ``name``, or None (absent, or the
    source does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            stub = ast.FunctionDef(
                name=node.name,
                args=node.args,
                body=[ast.Pass()],
                decorator_list=node.decorator_list,
                returns=node.returns,
            )
            if "type_params" in ast.FunctionDef._fields:
                stub.type_params = getattr(node, "type_params", [])
            return ast.unparse(ast.fix_missing_locations(stub)).split("\n")[-2]
    return None


def make_task(seed: int, difficulty: int, *, bug_types: tuple[str, ...] | None = None) -> Task:
    """Builds the task of ``seed`` at ``difficulty``; deterministic (see module docstring).

    Args:
      seed: in ``[0, MAX_SEED)``; the range decides the split (``config.split_of``).
      difficulty: level in ``[0, len(DIFFICULTIES))``.
      bug_types: force these bug types (length must equal the level's ``n_bugs``); by default
        they are sampled uniformly, excluding ``HELDOUT_COMBO`` for train seeds.

    Raises:
      ValueError: bad seed, difficulty, bug type or number of bug types.
      RuntimeError: no problem of the split admits the bug types.
      SandboxUnavailable: the sandbox cannot run on this host.
    """
    split_of(seed)  # validates the seed
    cfg = difficulty_config(difficulty)
    if bug_types is not None:
        bad = [t for t in bug_types if t not in BUG_TYPES]
        if bad:
            raise ValueError(f"bug_types {bad} must be in {BUG_TYPES}")
        if len(bug_types) != cfg.n_bugs:
            raise ValueError(f"len(bug_types)={len(bug_types)} must be n_bugs={cfg.n_bugs}")
        bug_types = tuple(bug_types)
    return _build(seed, difficulty, bug_types)


@functools.lru_cache(maxsize=4096)
def _build(seed: int, difficulty: int, bug_types: tuple[str, ...] | None) -> Task:
    split, cfg = split_of(seed), difficulty_config(difficulty)
    rng = random.Random(f"pyrepair-{seed}-{difficulty}")
    types = bug_types
    while types is None or (split == "train" and bug_types is None and is_heldout_combo(types)):
        types = tuple(rng.choice(BUG_TYPES) for _ in range(cfg.n_bugs))
    problems = (basic_problems_of_split if cfg.source == "basics" else problems_of_split)(split)
    start = seed % len(problems)
    for j in range(len(problems)):
        problem = problems[(start + j) % len(problems)]
        task = _try_problem(problem, types, cfg, rng, seed, difficulty, split)
        if task is not None:
            return task
    raise RuntimeError(f"no {split} problem admits bug types {types} at difficulty {difficulty}")


def _hunks(buggy: str, reference: str) -> list[tuple[int, tuple[str, ...], tuple[str, ...]]]:
    a, b = buggy.split("\n"), reference.split("\n")
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return [
        (i1 + 1, tuple(a[i1:i2]), tuple(b[j1:j2])) for tag, i1, i2, j1, j2 in ops if tag != "equal"
    ]


def _pick(rng: random.Random, sites: dict[str, list[Site]], types) -> list[Site] | None:
    chosen: list[Site] = []
    for t in types:
        options = [s for s in sites[t] if all(s.compatible(c) for c in chosen)]
        if not options:
            return None
        chosen.append(rng.choice(options))
    return chosen


class _Candidate(NamedTuple):
    sites: list[Site]
    buggy: str
    hunks: list[tuple[int, tuple[str, ...], tuple[str, ...]]]
    singles: list[str]  # each bug alone (several bugs only)


def _reference(problem: Problem, cfg: EnvConfig, rng: random.Random):
    """(reference program, functions that may hold bugs, helper names) or None."""
    if cfg.n_helpers == 0:
        return problem.program, [problem.entry_point], ()
    tree, helpers = extract_helpers(
        ast.parse(problem.program), problem.entry_point, cfg.n_helpers, rng
    )
    if not helpers:
        return None
    functions = list(helpers) if cfg.bug_in_helper else [problem.entry_point, *helpers]
    return ast.unparse(tree) + "\n", functions, helpers


def _candidates(program: str, functions, types, rng: random.Random) -> list[_Candidate]:
    """Up to ``CANDIDATES`` distinct mutants with one hunk per bug (not validated yet)."""
    tree = ast.parse(program)
    sites = find_sites(tree, functions)
    if any(not sites[t] for t in types):
        return []
    out, seen = [], {program}
    for _ in range(CANDIDATES):
        chosen = _pick(rng, sites, types)
        if chosen is None:
            continue
        buggy = ast.unparse(apply_sites(tree, chosen)) + "\n"
        if buggy in seen:
            continue
        seen.add(buggy)
        hunks = _hunks(buggy, program)
        if len(hunks) == len(types):
            singles = [ast.unparse(apply_sites(tree, [s])) + "\n" for s in chosen]
            out.append(_Candidate(chosen, buggy, hunks, singles if len(chosen) > 1 else []))
    return out


def _try_problem(problem, types, cfg, rng, seed, difficulty, split) -> Task | None:
    ref = _reference(problem, cfg, rng)
    if ref is None:
        return None
    program, functions, helpers = ref
    candidates = _candidates(program, functions, types, rng)
    if not candidates:
        return None
    n_vis, n_all = problem.n_visible(cfg.max_visible_tests), len(problem.cases)
    visible, every = render_tests(problem, range(n_vis)), render_tests(problem, range(n_all))
    jobs = [Job(program, every, n_all, timeout_s=REFERENCE_TEST_TIMEOUT_S)]
    for c in candidates:
        jobs.append(Job(c.buggy, visible, n_vis))  # every visible test: none may hang
        jobs += [Job(s, every, n_all, stop_at_first_failure=True) for s in c.singles]
    results = _validate(jobs)
    if not results[0].all_pass:
        return None
    k = 1
    for c in candidates:
        found, k = results[k : k + 1 + len(c.singles)], k + 1 + len(c.singles)
        if all(_fails_cleanly(e) for e in found):
            ordered = sorted(c.sites, key=lambda s: s.line)
            mutations = tuple(
                Mutation(s.bug_type, s.function, line, b, f, s.description)
                for s, (line, b, f) in zip(ordered, c.hunks)
            )
            failure = _failure_report(c.buggy, visible, n_vis, cfg) if cfg.show_failure else ""
            return Task(
                seed=seed,
                difficulty=difficulty,
                split=split,
                config=cfg,
                problem=problem.task_id,
                entry_point=problem.entry_point,
                bug_types=tuple(m.bug_type for m in mutations),
                mutations=mutations,
                helpers=tuple(helpers),
                solution=c.buggy,
                reference=program,
                visible_tests=visible,
                hidden_tests=render_tests(problem, range(n_vis, n_all), first_number=n_vis + 1),
                n_visible=n_vis,
                n_hidden=n_all - n_vis,
                failure=failure,
            )
    return None


def _failure_report(buggy: str, visible: str, n_vis: int, cfg: EnvConfig) -> str:
    """The report of the visible tests on the buggy program (what ``run_tests`` would show)."""
    job = Job(buggy, visible, n_vis)
    kw = dict(test_timeout_s=cfg.test_timeout_s, run_timeout_s=VALIDATION_RUN_TIMEOUT_S)
    return evaluate_batch(default_sandbox(), [job], report=True, **kw)[0].report


def _fails_cleanly(e) -> bool:
    return e.any_fail and e.stopped is None and "TestTimeout" not in e.errors


def _validate(jobs: list[Job]):
    """Runs the jobs in one sandboxed batch; if a limit stopped the batch, one run per job."""
    kw = dict(test_timeout_s=MUTANT_TEST_TIMEOUT_S, run_timeout_s=VALIDATION_RUN_TIMEOUT_S)
    sandbox = default_sandbox()
    results = evaluate_batch(sandbox, jobs, **kw)
    if any(r.stopped for r in results):
        results = [evaluate_batch(sandbox, [j], **kw)[0] for j in jobs]
    return results
