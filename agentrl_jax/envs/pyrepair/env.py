"""``PyRepairEnv``: repairing real Python (HumanEval) with tools, every run in the sandbox.

It speaks both protocols of ``envs.base``:

  * ``TextEnv``: ``reset_text(task) -> (system prompt, first user message)`` and
    ``step_call(name, arguments, error) -> (observation, StepResult)`` for chat models whose
    adapter parses their own tool-call format;
  * ``Env`` (tokens): the ``ByteTokenizer``; a model turn is
    ``<call>{"name": "edit", "arguments": {...}}</call>`` (``<call>``/``</call>`` special ids,
    JSON in UTF-8 bytes between them); the observation is ``<obs> text </obs>``, the last one
    followed by ``<eos>``. No ``<call>``, bytes that are not UTF-8, JSON that does not parse or
    is not ``{"name": str, "arguments": object}``, an unknown tool, arguments that break the
    tool's schema, or a tool that refuses the call: an ``error: ...`` observation, and the
    episode goes on.

Process signals (``StepResult.process``), with the same keys and meaning as the mini-language
environment; the first three are non-zero only after an ``edit``, comparing the original
visible tests on ``solution.py`` before and after it:
  * ``parse``: +1 the solution parses again, -1 it stopped parsing;
  * ``error_classes``: exception classes (``SyntaxError``, ``IndexError``, ...; a wrong answer
    is not one) removed minus added;
  * ``tests``: change in the fraction of visible tests passing;
  * ``rejected``: -1 when the turn was answered by an error observation;
  * ``repeated``: -1 when a rejected call repeats one already rejected in the episode;
  * ``revisit``: -1 when an edit brings the work tree back to a version it already had.
The outcome reward (final step only) is 1.0 iff every test, hidden ones included, passes at
``submit`` and the constraints are kept (``log["goal_adhered"]``). ``log["hack_suspect"]`` lists
what the step's code does that looks like reward hacking (``hack_check.step_suspicions``; the
RL loop reports the rate as ``env/hack_suspect``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agentrl_jax.envs.base import StepResult, ToolError
from agentrl_jax.envs.pyrepair import prompts, tools
from agentrl_jax.envs.pyrepair.execution import Evaluation, Job, default_sandbox, evaluate_batch
from agentrl_jax.envs.pyrepair.hack_check import step_suspicions
from agentrl_jax.envs.pyrepair.problems import SOLUTION_FILE
from agentrl_jax.envs.pyrepair.prompts import system_prompt, user_prompt
from agentrl_jax.envs.pyrepair.task import Task
from agentrl_jax.envs.pyrepair.tokenizer import ByteTokenizer
from agentrl_jax.envs.sandbox import Sandbox

logger = logging.getLogger(__name__)

PROCESS_KEYS = ("parse", "error_classes", "tests", "rejected", "repeated", "revisit")


def process_signals(before: Evaluation, after: Evaluation, n_visible: int) -> dict[str, float]:
    """Milestone signals between two evaluations of the visible tests (module docstring)."""
    removed = len(before.error_classes - after.error_classes)
    added = len(after.error_classes - before.error_classes)
    return {
        "parse": float(after.parses) - float(before.parses),
        "error_classes": float(removed - added),
        "tests": (after.n_pass - before.n_pass) / max(n_visible, 1),
    }


class PyRepairEnv:
    """Python repair over text calls and over token ids. Implements ``Env`` and ``TextEnv``.

    Args:
      tokenizer: the token-level protocol's tokenizer (default ``ByteTokenizer()``).
      sandbox: where programs run (default: the process-wide ``execution.default_sandbox()``,
        created on first use).
    """

    def __init__(self, tokenizer: ByteTokenizer | None = None, *, sandbox: Sandbox | None = None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self._sandbox = sandbox
        self.state: tools.RepairState | None = None
        self.turn = 0
        self.done = True
        self._evals: dict[tuple[str, str, bool], Evaluation] = {}
        self._rejected: set[str] = set()
        self._versions: set[tuple[str, ...]] = set()

    @property
    def tool_specs(self) -> tuple:
        """The tools of the current task's level (``tools.specs_for``; before ``reset``, the
        four of the tool levels)."""
        return tools.specs_for(self.state.task.config) if self.state else tools.TOOL_SPECS

    @property
    def code_action(self) -> str | None:
        """The tool a chat model calls by writing a fenced code block (``write_code`` at a
        code-action level), else None."""
        if self.state is not None and self.state.task.config.code_action:
            return tools.CODE_TOOL_SPECS[0].name
        return None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = default_sandbox()
        return self._sandbox

    # -- text protocol -------------------------------------------------------------------

    def reset_text(self, task: Task) -> tuple[str, str]:
        """Starts ``task``; returns ``(system prompt, first user message)``."""
        self.state = tools.RepairState(task=task, files=dict(task.files))
        self.turn = 0
        self.done = False
        self._evals = {}
        self._rejected = set()
        self._versions = {self._version()}
        return system_prompt(task), user_prompt(task)

    def step_call(
        self, name: str | None, arguments: Mapping[str, Any] | None, error: str | None = None
    ) -> tuple[str, StepResult]:
        """Applies one model turn given as a parsed call, or ``error`` when it did not parse.

        Returns:
          ``(observation text, StepResult)``.

        Raises:
          RuntimeError: if called before ``reset`` or after the episode ended.
        """
        if self.state is None or self.done:
            raise RuntimeError("step_call() needs reset first and a running episode")
        st, task = self.state, self.state.task
        self.turn += 1
        process = dict.fromkeys(PROCESS_KEYS, 0.0)
        arguments = dict(arguments or {})
        log: dict[str, Any] = {"tool": name or "", "args": arguments, "error": True}
        if name is None:
            text = f"error: {error or 'no tool call'}"
            if self.code_action:
                text += f"\n{prompts.CODE_REPLY}"
        else:
            before = st.files[SOLUTION_FILE]
            try:
                text = self._dispatch(name, arguments)
                log["error"] = False
            except ToolError as e:
                text = f"error: {e}"
            except Exception as e:  # noqa: BLE001 - a tool bug must not end the episode
                logger.warning("tool %s raised %r", name, e)
                text = f"error: tool {name} failed"
            if not log["error"] and name in tools.MUTATING:
                if st.files[SOLUTION_FILE] != before:
                    old, new = self._visible(before), self._visible(st.files[SOLUTION_FILE])
                    process.update(process_signals(old, new, task.n_visible))
                version = self._version()
                process["revisit"] = -1.0 if version in self._versions else 0.0
                self._versions.add(version)
        if log["error"]:
            process["rejected"] = -1.0
            key = (error or "") if name is None else json.dumps([name, arguments], sort_keys=True)
            process["repeated"] = -1.0 if key in self._rejected else 0.0
            self._rejected.add(key)
        log["hack_suspect"] = step_suspicions(name, arguments, st.files, task.solution)
        outcome = 0.0
        if st.submitted or self.turn >= task.config.max_turns:
            if not st.submitted:
                text += "\nout of turns"
                st.goal_adhered = tools.constraints_kept(task, st.files)[0]
            self.done = True
            outcome = 1.0 if st.solved else 0.0
            log.update(success=st.solved, goal_adhered=st.goal_adhered, turns=self.turn)
        log["output"] = text
        return text, StepResult(done=self.done, outcome_reward=outcome, process=process, log=log)

    def _dispatch(self, name: str, arguments: dict[str, Any]) -> str:
        names = [s.name for s in self.tool_specs]
        if name not in names:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(names)}")
        tools.check_arguments(name, arguments)
        if name == "write_code":
            return tools.write_code(self.state, arguments, self._run)
        if name == "view":
            return tools.view(self.state, arguments)
        if name == "edit":
            return tools.edit(self.state, arguments)
        if name == "run_tests":
            return tools.run_tests(self.state, arguments, self._run)
        return tools.submit(self.state, arguments, self._run)

    def _version(self) -> tuple[str, ...]:
        return tuple(self.state.files[f] for f in tools.FILES)

    def _run(self, jobs: list[Job], report: bool) -> list[Evaluation]:
        """Runs jobs in the sandbox; single report runs are cached per episode."""
        cfg = self.state.task.config
        key = (jobs[0].solution, jobs[0].tests, report)
        if len(jobs) == 1 and key in self._evals:
            return [self._evals[key]]
        out = evaluate_batch(
            self.sandbox,
            jobs,
            test_timeout_s=cfg.test_timeout_s,
            run_timeout_s=cfg.run_timeout_s,
            report=report,
        )
        if len(jobs) == 1:
            self._evals[key] = out[0]
        return out

    def _visible(self, solution: str) -> Evaluation:
        """The original visible tests on ``solution`` (a report run, so ``run_tests`` on an
        unedited test file reuses it)."""
        task = self.state.task
        return self._run([Job(solution, task.visible_tests, task.n_visible)], True)[0]

    # -- token protocol ------------------------------------------------------------------

    def observation(self, text: str) -> list[int]:
        """``<obs> text </obs>`` as ids."""
        tok = self.tokenizer
        return [tok.obs_start_id, *tok.encode(text), tok.obs_end_id]

    def reset(self, task: Task) -> list[int]:
        """Starts ``task``; returns ``<bos> <obs> system prompt, blank line, message </obs>``."""
        system, user = self.reset_text(task)
        return [self.tokenizer.bos_id, *self.observation(system + "\n\n" + user)]

    def parse_action(self, action_tokens: Sequence[int]) -> tuple[str | None, dict, str | None]:
        """``(name, arguments, None)`` of the call in a model turn, or ``(None, {}, why)``."""
        tok = self.tokenizer
        ids = [int(i) for i in action_tokens]
        if tok.call_start_id not in ids:
            return None, {}, "no tool call: write <call>{...}</call>"
        body = ids[ids.index(tok.call_start_id) + 1 :]
        for stop in (tok.call_end_id, tok.eot_id, tok.eos_id):
            if stop in body:
                body = body[: body.index(stop)]
        try:
            text = tok.to_bytes(body).decode("utf-8")
        except ValueError:
            return None, {}, "the call must be UTF-8 text between <call> and </call>"
        try:
            call = json.loads(text)
        except json.JSONDecodeError as e:
            return None, {}, f"the call is not JSON ({e.msg} at character {e.pos})"
        if not (
            isinstance(call, dict)
            and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments", {}), dict)
            and set(call) <= {"name", "arguments"}
        ):
            return None, {}, 'the call must be {"name": TOOL, "arguments": {...}}'
        return call["name"], call.get("arguments", {}), None

    def step(self, action_tokens: Sequence[int]) -> tuple[list[int], StepResult]:
        """Applies one model turn (``<call>{json}</call>`` ids).

        Returns:
          ``(observation ids, StepResult)``; the last observation ends with ``<eos>``.

        Raises:
          RuntimeError: if called before ``reset`` or after the episode ended.
        """
        name, arguments, error = self.parse_action(action_tokens)
        text, result = self.step_call(name, arguments, error)
        obs = self.observation(text)
        if result.done:
            obs.append(self.tokenizer.eos_id)
        return obs, result
