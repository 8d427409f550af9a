"""The RL loop's config section ``train`` (:class:`TrainConfig`); ``train/rl_loop.py`` runs it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The RL loop (config section ``train``).

    Attributes:
      rl_steps: update steps.
      sft: run the SFT stage first (else start from ``init_from`` or a fresh init).
      init_from: run dir or checkpoint dir whose SFT params start RL ('' = none).
      process_weights: weight of each environment process signal (``EnvSpec.process_keys``;
        code repair: ``envs.coderepair.PROCESS_KEYS``) in ``process_rewards``; a missing key
        weighs 1.0 (``experiment.build`` checks the keys against the environment).
        Only estimators (``rl.advantage``) that read process rewards use them
        (``episode_process``, ``prm_orm``, ``gigpo``, the discounted ones).
      max_turns: model turns per episode.
      eval_every: held-out evaluation every N steps (0: only before and after RL). Every
        evaluation writes ``eval/heldout_success``, ``..._truncated``, ``..._goal_adherence`` and
        ``eval/heldout_bug_type/<type>`` to the metrics; the mid-run results are kept whole in
        ``summary.json`` under ``eval_mid`` (by step), so paired gains can be computed later.
      ckpt_every: RL checkpoint every N steps (and at the end).
      log_tool_calls: append every tool call of every rollout to ``tool_calls.jsonl``, each row
        with the ``step`` (as in ``metrics.jsonl``) and ``attempt`` it belongs to.
      eval_before: evaluate the SFT checkpoint on the held-out split before RL. When False and
        ``init_from`` is a run dir whose ``summary.json`` holds its own before-RL evaluation
        of that SFT checkpoint under the same ``eval`` section and dtype policy, that
        evaluation is reused (``eval_before_from`` in the summary names it), so RL-only runs
        from one SFT run still report paired gains. It was computed by that run's code: after
        a change to the environment or the evaluation, set ``eval_before=True`` instead.
      greedy_member: the last rollout of each group decodes greedily (argmax, as greedy
        evaluation does) instead of sampling. Greedy-only failures (e.g. repeating a rejected
        call) then reach the gradient: a greedy member that fails where its sampled siblings
        succeed gets a negative advantage. Its logprobs are the sampling policy's, like every
        rollout's. One at most: two greedy members would play the same episode. Needs
        ``data.group_size >= 2``.
      guide_groups: off-policy guidance (LUFFY-style, 0 = off): in up to this many groups per
        step whose sampled members all failed, the first member's episode is replaced by the
        scripted expert's on the same task (``EnvSpec.expert``, no detours;
        ``train/guidance.py``). Its reward makes the group informative, so the expert's turns
        get a positive group-baselined advantage and the failed members a negative one. The
        expert's "rollout" logprobs are the current policy's teacher-forced ones (importance
        ratio 1 at the update's first epoch). Step metrics (``success``, ``reward``, ...) and
        the task pipeline's difficulty estimates see the sampled episodes only;
        ``guided_groups`` counts the replacements.
        Dense models only (a scripted episode has no recorded MoE routes).
      guide_source: where ``guide_groups``' successful episode comes from: ``"expert"`` (above)
        or ``"policy"``: ``guide_samples`` more episodes of the current policy on each such
        task (one batched rollout per round), the first success replacing the first member,
        with its own rollout logprobs and routes. On-policy rejection sampling on the tasks
        the group alone failed: the rare success gets the group's positive advantage.
      guide_samples: extra samples per all-failed group for ``guide_source="policy"``.
      env_workers: threads that run environment steps (tool calls; >= 1). With
        ``rl.max_staleness`` > 0 (or ``overlap_env``) they run while the model decodes
        (``train/rollout_worker.py``); the observations are recorded once this many calls are
        pending or no slot can decode. The synchronous loop steps the environments of a round
        (every slot whose turn ended) at once on this many threads and waits for them: the
        same observations as one call after another (each environment steps alone; results
        in order), in the time of the slowest call rather than their sum; 1 steps them on
        the loop's thread.
      overlap_env: with ``rl.max_staleness`` = 0, play the rollouts through the asynchronous
        rollout side all the same: no staleness (batch ``b`` is rolled out by the parameters
        after ``b`` updates, the learner waits for it), but environment steps overlap the model
        as above. Reproducible and resumable like an asynchronous run; not bitwise the
        synchronous loop (observations reach the cache in other rounds).
    """

    rl_steps: int = 40
    sft: bool = True
    init_from: str = ""
    process_weights: dict = dataclasses.field(default_factory=dict)
    max_turns: int = 8
    eval_every: int = 0
    ckpt_every: int = 10
    log_tool_calls: bool = True
    eval_before: bool = True
    greedy_member: bool = False
    guide_groups: int = 0
    guide_source: str = "expert"
    guide_samples: int = 8
    env_workers: int = 8
    overlap_env: bool = False

    def __post_init__(self):
        for name in (
            "rl_steps",
            "max_turns",
            "eval_every",
            "ckpt_every",
            "guide_groups",
            "guide_samples",
            "env_workers",
        ):
            if getattr(self, name) < (
                0 if name in ("rl_steps", "eval_every", "guide_groups") else 1
            ):
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} is out of range")
        if self.guide_source not in ("expert", "policy"):
            raise ValueError(
                f"TrainConfig.guide_source={self.guide_source!r} must be 'expert' or 'policy'"
            )
