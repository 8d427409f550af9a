"""``CodeRepairEnv``: the token-level code-repair environment.

Token stream of an episode (everything is one flat id sequence):

    <bos> <obs> task : ... rule : ... <nl> program : <nl> L0 def ... </obs>      reset()
    <call> run </call>                                                          model turn 1
    <obs> pass 1 of 4 <nl> fail T2 ... <nl> L5 x = a * 4 => 16 ... </obs>       step() obs
    <call> sub L5 * + </call>                                                   model turn 2
    <obs> ok L5 x = a + 4 </obs>
    ...
    <call> submit </call>
    <obs> submitted pass </obs> <eos>                                           last obs

A model turn is the tokens from ``<call>`` to ``</call>`` (the sampler stops there, or at
``<eot>``/``<eos>``). Anything else (no ``<call>``, unknown tool, bad arguments, a failing
tool) is answered by an ``error ...`` observation and costs the turn.

Process signals (``StepResult.process``); the first three are non-zero only after a call that
changed the program, relative to the program before it:
  * ``parse``: +1 the code parses again, -1 it stopped parsing;
  * ``error_classes``: error classes (``syntax`` or a runtime fault kind) removed minus added;
  * ``tests``: change in the fraction of visible tests passing;
  * ``rejected``: -1 when the turn was answered by an ``error ...`` observation (no call, a bad
    call, or a tool that refused it, e.g. a ``sub`` of a word the line does not hold);
  * ``repeated``: -1 when the turn is rejected and the same call (the same words) was already
    rejected earlier in the episode (greedy decoding's failure mode: one refused call, again
    and again);
  * ``revisit``: -1 when an accepted edit turns the program back into a version it already had
    in this episode, the starting one included (the edit loop ``sub - +``, ``run``,
    ``sub + -``, ``run``, ... that tries nothing new).
The outcome reward (final step only) is 1.0 iff every test, hidden ones included, passes at
``submit`` and the rule is kept. ``log["goal_adhered"]`` is set on the final step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl_jax.envs.base import StepResult, ToolRegistry, call_tool
from agentrl_jax.envs.coderepair.evaluation import Evaluation, evaluate
from agentrl_jax.envs.coderepair.task import Task
from agentrl_jax.envs.coderepair.text import SYSTEM_PROMPT, TOOL_SPECS, call_words
from agentrl_jax.envs.coderepair.tokenizer import CodeTokenizer
from agentrl_jax.envs.coderepair.tools import RepairState, constraint_kept, default_registry

PROCESS_KEYS = ("parse", "error_classes", "tests", "rejected", "repeated", "revisit")


def _zero_process() -> dict[str, float]:
    return dict.fromkeys(PROCESS_KEYS, 0.0)


def _version(lines) -> tuple[tuple[str, ...], ...]:
    """A hashable copy of a program (``revisit``)."""
    return tuple(tuple(w) for w in lines)


def process_signals(before: Evaluation, after: Evaluation, n_visible: int) -> dict[str, float]:
    """Milestone signals between two evaluations of the visible tests (see module docstring)."""
    removed = len(before.error_classes - after.error_classes)
    added = len(after.error_classes - before.error_classes)
    return {
        "parse": float(after.parses) - float(before.parses),
        "error_classes": float(removed - added),
        "tests": (after.n_pass - before.n_pass) / max(n_visible, 1),
    }


class CodeRepairEnv:
    """Multi-turn code repair over token ids. Implements ``envs.base.Env`` and, for chat
    models, ``envs.base.TextEnv`` (``tool_specs``, ``reset_text``, ``step_call``: the same
    episode with structured calls, see ``coderepair.text``).

    Args:
      tokenizer: shared tokenizer (default ``CodeTokenizer()``).
      registry: tools (default: run, view, edit, sub, submit).
    """

    def __init__(
        self, tokenizer: CodeTokenizer | None = None, registry: ToolRegistry | None = None
    ):
        self.tokenizer = tokenizer or CodeTokenizer()
        self.registry = registry or default_registry()
        self.state: RepairState | None = None
        self.turn = 0
        self.done = True
        self._eval: Evaluation | None = None
        self._rejected: set[tuple[str, ...] | None] = set()
        self._versions: set[tuple[tuple[str, ...], ...]] = set()  # programs seen this episode

    def reset(self, task: Task) -> list[int]:
        """Starts ``task``; returns ``<bos> <obs> prompt </obs>`` ids."""
        self.state = RepairState(task=task, lines=list(task.lines))
        self.turn = 0
        self.done = False
        self._rejected = set()
        self._versions = {_version(self.state.lines)}
        self._eval = self._evaluate_visible()
        return [self.tokenizer.bos_id, *self.observation(task.prompt)]

    def observation(self, text: str) -> list[int]:
        """``<obs> text </obs>`` as ids."""
        tok = self.tokenizer
        return [tok.obs_start_id, *tok.encode(text), tok.obs_end_id]

    def _evaluate_visible(self) -> Evaluation:
        st = self.state
        deadline = time.monotonic() + st.task.config.time_limit_s
        return evaluate(st.lines, st.task.visible_tests, st.task.config.step_budget, deadline)

    def parse_action(self, action_tokens: Sequence[int]) -> list[str] | None:
        """Words of the tool call in a model turn, or ``None`` without ``<call>``."""
        words = self.tokenizer.to_words(action_tokens)
        if "<call>" not in words:
            return None
        words = words[words.index("<call>") + 1 :]
        for stop in ("</call>", "<eot>", "<eos>"):
            if stop in words:
                words = words[: words.index(stop)]
        return words

    def step(self, action_tokens: Sequence[int]) -> tuple[list[int], StepResult]:
        """Applies one model turn.

        Args:
          action_tokens: ids of the model turn (``<call> tool args </call>``).

        Returns:
          ``(observation ids, StepResult)``; the last observation of an episode ends with
          ``<eos>``.

        Raises:
          RuntimeError: if called before ``reset`` or after the episode ended.
        """
        self._check_running()
        try:
            words = self.parse_action(action_tokens)
        except ValueError as e:
            words, bad_ids = None, str(e)
        else:
            bad_ids = ""
        error = "error bad call" if bad_ids else "error no tool call"
        text, result = self._turn(words, error)
        obs = self.observation(text)
        if self.done:
            obs.append(self.tokenizer.eos_id)
        return obs, result

    # TextEnv ---------------------------------------------------------------------------------
    tool_specs = TOOL_SPECS

    def reset_text(self, task: Task) -> tuple[str, str]:
        """Starts ``task`` (as :meth:`reset`); returns ``(system prompt, the task's prompt)``."""
        self.reset(task)
        return SYSTEM_PROMPT, task.prompt

    def step_call(
        self, name: str | None, arguments: Mapping[str, Any] | None, error: str | None = None
    ) -> tuple[str, StepResult]:
        """Applies one turn given as a structured call (``text.call_words``); a call that did
        not parse (``name`` None) is an ``error ...`` observation naming ``error``. Returns the
        observation text and the step result (the same as :meth:`step` on the word call).

        Raises:
          RuntimeError: if called before ``reset`` or after the episode ended.
        """
        self._check_running()
        words, message = None, f"error {error or 'no tool call'}"
        if name is not None:
            try:
                words = call_words(name, arguments or {})
            except ValueError as e:
                message = f"error {e}"
        return self._turn(words, message)

    # One turn ----------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self.state is None or self.done:
            raise RuntimeError("step() needs reset() first and a running episode")

    def _turn(self, words: list[str] | None, error: str) -> tuple[str, StepResult]:
        """Runs the call ``words`` (None: the turn is answered by ``error``)."""
        st, cfg = self.state, self.state.task.config
        self.turn += 1
        process = _zero_process()
        if words is None:
            text = error
            log = {"tool": "", "args": (), "output": text, "error": True}
        else:
            res = call_tool(self.registry, words, st, cfg.time_limit_s)
            text = res.output
            log = {"tool": res.name, "args": res.args, "output": text, "error": res.error}
            if res.timed_out:
                log["timeout"] = True
            tool = self.registry.get(res.name)
            if not res.error and tool is not None and tool.mutates:
                after = self._evaluate_visible()
                process.update(process_signals(self._eval, after, len(st.task.visible_tests)))
                self._eval = after
                version = _version(st.lines)
                process["revisit"] = -1.0 if version in self._versions else 0.0
                self._versions.add(version)
        process["rejected"] = -1.0 if log["error"] else 0.0
        if log["error"]:
            call = None if words is None else tuple(words)
            process["repeated"] = -1.0 if call in self._rejected else 0.0
            self._rejected.add(call)
        outcome = 0.0
        if st.submitted or self.turn >= cfg.max_turns:
            if not st.submitted:
                text += "\nout of turns"
                st.goal_adhered = constraint_kept(st.task, st.lines)
            self.done = True
            success = bool(st.submitted and st.final.all_pass and st.goal_adhered)
            outcome = 1.0 if success else 0.0
            log.update(success=success, goal_adhered=st.goal_adhered, turns=self.turn)
        return text, StepResult(done=self.done, outcome_reward=outcome, process=process, log=log)
