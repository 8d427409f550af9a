"""Scripted expert: solves a task through the tools, in the model's own token format.

The expert reads the ground-truth bugs of the task (location and fix) but acts only through tool
calls, so its demonstrations are token streams a model could have produced:

    run -> [view F] -> fix bug 1 -> run -> [view F] -> fix bug 2 -> run -> ... -> submit

A fix on the line the cursor points at (``run`` sets it) is written without the line id.

Syntax bugs come first (nothing runs until the program parses), then the others by line. ``view``
is used only when the prompt does not show the program. With ``detour_prob > 0`` a fix is
sometimes preceded by a detour of one of three kinds:
  * a wrong guess: the bug's own word replaced by another word of its kind (another operator,
    comparison, digit, or variable bound at that line; for a dropped operator, the wrong
    operator put back) and a ``run`` that still fails; the fix then replaces the guess
    (``sub GUESS GOOD``, or ``edit``).
    Bugs whose repair is a choice among alternatives (which operator, which constant) cannot be
    read off the observation; these demonstrations show the search: try one, run, try another.
    With ``max_guesses`` > 1 a demonstration makes 1 to ``max_guesses`` (uniform) distinct wrong
    guesses in a row, each followed by a ``run``, before the fix replaces the last one;
  * a plausible wrong edit of another word of the same line and a ``run`` that shows it did not
    help; the fix then rewrites the whole line (``edit Lk <original line>``);
  * a slip: a ``sub`` of a word the line does not hold, answered by an error observation.
A bug that admits a wrong guess gets one with probability 1/2, else each of the other two kinds
with probability 1/4; otherwise the two others with 1/2 each. Detours show recovery from a failed
or rejected call; ``ExpertPolicy.detour_turns`` lists them so behaviour cloning can learn the
recovery (and, after a wrong guess, which alternatives are left) without imitating the mistake;
``ExpertPolicy.guess_turns`` lists the wrong guesses among them, for a behaviour cloning that
imitates the search too (``demos.demo_episode(learn_guesses=True)``).
"""

from __future__ import annotations

import random

from agentrl_jax.envs.base import call_tool
from agentrl_jax.envs.coderepair.bugs import Bug, bound_names, repair_call
from agentrl_jax.envs.coderepair.evaluation import evaluate
from agentrl_jax.envs.coderepair.language import (
    FUNCTION_NAMES,
    TYPO_TO_NAME,
    VARIABLES,
    function_spans,
)
from agentrl_jax.envs.coderepair.task import Task
from agentrl_jax.envs.coderepair.tokenizer import CodeTokenizer
from agentrl_jax.envs.coderepair.tools import _LINE_ID, RepairState, default_registry

_SWAPS = (("+", "-", "*"), ("<", "<=", ">", ">="), tuple(str(d) for d in range(1, 10)))
# Alternatives a wrong guess draws from, by the kind of the bug's word.
_GUESSES = (
    ("+", "-", "*", "%"),
    ("<", "<=", ">", ">=", "==", "!="),
    tuple(str(d) for d in range(1, 10)),
    VARIABLES,
)


def _wrong_line(rng: random.Random, bug: Bug) -> tuple[str, ...] | None:
    """The buggy line with one more word changed to a same-kind word (a plausible bad fix)."""
    words = list(bug.mutated)
    options = []
    for pos, w in enumerate(words):
        if pos == 0:
            continue
        orig = bug.original[pos] if pos < len(bug.original) else None
        for group in (*_SWAPS, VARIABLES, FUNCTION_NAMES):
            choices = [g for g in group if g not in (w, orig)] if w in group else []
            if choices:
                options.append((pos, choices))
    if options:
        pos, choices = rng.choice(options)
        words[pos] = rng.choice(choices)
        return tuple(words)
    return None


def _wrong_guesses(rng: random.Random, task: Task, bug: Bug, n: int = 1) -> list[tuple[str, ...]]:
    """Up to ``n`` distinct wrong guesses at the repair: the correct line with the bug's word
    replaced by another same-kind word that still fails a visible test (empty when the bug admits
    none).

    The bug's word is the one the mutation changed (same-length lines) or dropped (one word
    shorter); it is never the mutated word itself, so each guess is a new line.
    """
    good, bad = bug.original, bug.mutated
    if len(good) == len(bad):
        diff = [p for p in range(len(good)) if good[p] != bad[p]]
        if len(diff) != 1:
            return []
        pos = diff[0]
    elif len(good) == len(bad) + 1:
        pos = next((p for p in range(len(bad)) if good[p] != bad[p]), len(bad))
    else:
        return []
    group = next((g for g in _GUESSES if good[pos] in g), None)
    if group is None:
        return []
    if group is VARIABLES:  # a name bound at the line, as the bug itself draws them
        group = tuple(bound_names(task.original, bug.line))
    choices = [w for w in group if w != good[pos] and (len(good) != len(bad) or w != bad[pos])]
    rng.shuffle(choices)
    visible = [t for t in task.tests if not t.hidden]
    out = []
    for w in choices:
        lines = list(task.original)
        lines[bug.line] = good[:pos] + (w,) + good[pos + 1 :]
        ev = evaluate(lines, visible, task.config.step_budget)
        if not ev.all_pass:
            out.append(lines[bug.line])
            if len(out) == n:
                break
    return out


def _slip(rng: random.Random, bug: Bug) -> tuple[str, ...]:
    """A ``sub`` on the bug line of a word the line does not hold (the tool rejects it)."""
    line = set(bug.mutated)
    pairs = [(t, n) for t, n in TYPO_TO_NAME.items() if t not in line]
    for group in _SWAPS:
        pairs += [(a, b) for a in group if a not in line for b in group if b != a]
    old, new = rng.choice(sorted(pairs))
    return ("sub", f"L{bug.line}", old, new)


def _at_cursor(call: tuple[str, ...], cursor: int) -> tuple[str, ...]:
    """``call`` without its line id when it targets the cursor line (``sub Lk A B`` -> ``sub A B``).

    Multi-line edits (``edit La Lb ...``) keep their ids.
    """
    if len(call) >= 2 and call[0] in ("sub", "edit") and call[1] == f"L{cursor}":
        if not (call[0] == "edit" and len(call) >= 3 and _LINE_ID.fullmatch(call[2])):
            return (call[0], *call[2:])
    return call


def expert_plan(
    task: Task, *, detour_prob: float = 0.0, seed: int = 0, max_guesses: int = 1
) -> list[tuple[str, ...]]:
    """The expert's tool calls (as word tuples) for ``task``; see ``expert_plan_detours``."""
    return expert_plan_detours(task, detour_prob=detour_prob, seed=seed, max_guesses=max_guesses)[0]


def expert_plan_detours(
    task: Task, *, detour_prob: float = 0.0, seed: int = 0, max_guesses: int = 1
) -> tuple[list[tuple[str, ...]], frozenset[int], frozenset[int]]:
    """The expert's tool calls (as word tuples) for ``task``, the indices of detour calls and of
    those detours that are wrong guesses (a subset).

    The plan is played on a copy of the program with the environment's own tools, so the expert
    sees the cursor ``run`` sets and writes ``sub OLD NEW`` / ``edit <line>`` (no line id) when
    the cursor is on the line it fixes.

    Args:
      task: the task (its ``bugs`` give locations and fixes).
      detour_prob: probability of a wrong edit (then ``run``) before each fix, in ``[0, 1]``.
      seed: randomness of the detours.
      max_guesses: most wrong guesses in a row in a wrong-guess detour (>= 1; the number is
        uniform in ``1 .. max_guesses``, fewer when the bug admits fewer).

    Raises:
      ValueError: if ``detour_prob`` is outside ``[0, 1]`` or ``max_guesses`` < 1.
    """
    if not 0.0 <= detour_prob <= 1.0:
        raise ValueError(f"detour_prob={detour_prob} must be in [0, 1]")
    if max_guesses < 1:
        raise ValueError(f"max_guesses={max_guesses} must be >= 1")
    rng = random.Random(f"expert-{task.seed}-{task.difficulty}-{seed}")
    spans = function_spans(task.lines)
    state = RepairState(task=task, lines=list(task.lines))
    registry = default_registry()
    plan: list[tuple[str, ...]] = []
    detours: set[int] = set()
    guess_calls: set[int] = set()

    def act(
        call: tuple[str, ...], detour: bool = False, rejected: bool = False, guess: bool = False
    ) -> None:
        call = _at_cursor(call, state.cursor)
        if detour:
            detours.add(len(plan))
        if guess:
            guess_calls.add(len(plan))
        plan.append(call)
        res = call_tool(registry, list(call), state, task.config.time_limit_s)
        if res.error != rejected:  # pragma: no cover - the expert's calls are valid by design
            raise RuntimeError(f"expert call {call} gave {res.output!r}")

    viewed: set[str] = set()
    act(("run",))
    for bug in sorted(task.bugs, key=lambda b: (b.type != "syntax", b.line)):
        if not task.config.show_program:
            fn = next(f for f, (s, e) in spans.items() if s <= bug.line <= e)
            if fn not in viewed:
                viewed.add(fn)
                act(("view", fn))
        fix = bug.fix
        if detour_prob > 0 and rng.random() < detour_prob:
            # no draw at max_guesses=1: the default demonstrations keep their random stream
            n = rng.randint(1, max_guesses) if max_guesses > 1 else 1
            guesses = _wrong_guesses(rng, task, bug, n) if rng.random() < 0.5 else []
            wrong = _wrong_line(rng, bug) if not guesses and rng.random() < 0.5 else None
            if guesses:
                for guess in guesses:
                    call = repair_call(bug.line, guess, state.lines[bug.line])
                    act(call, detour=True, guess=True)
                    act(("run",))
                fix = repair_call(bug.line, bug.original, guess)
            elif wrong is not None:
                act(("edit", f"L{bug.line}", *wrong), detour=True)
                act(("run",))
                fix = ("edit", f"L{bug.line}", *bug.original)
            else:
                act(_slip(rng, bug), detour=True, rejected=True)
        act(fix)
        act(("run",))
    plan.append(("submit",))
    return plan, frozenset(detours), frozenset(guess_calls)


class ExpertPolicy:
    """A policy callable (``stream -> action ids``) that replays ``expert_plan`` turn by turn.

    Args:
      task: the task to solve.
      tokenizer: shared tokenizer.
      detour_prob, seed, max_guesses: see ``expert_plan_detours``.
    """

    def __init__(
        self,
        task: Task,
        tokenizer: CodeTokenizer | None = None,
        *,
        detour_prob: float = 0.0,
        seed: int = 0,
        max_guesses: int = 1,
    ):
        self.tokenizer = tokenizer or CodeTokenizer()
        self.plan, detours, guesses = expert_plan_detours(
            task, detour_prob=detour_prob, seed=seed, max_guesses=max_guesses
        )
        self.detour_turns = frozenset(k + 1 for k in detours)  # 1-based turn numbers
        self.guess_turns = frozenset(k + 1 for k in guesses)  # the wrong-guess detour turns
        self.turn = 0

    def action_ids(self, words: tuple[str, ...]) -> list[int]:
        """``<call> words </call>`` as ids."""
        return self.tokenizer.encode_words(["<call>", *words, "</call>"])

    def __call__(self, stream: list[int]) -> list[int]:
        words = self.plan[min(self.turn, len(self.plan) - 1)]
        self.turn += 1
        return self.action_ids(words)
