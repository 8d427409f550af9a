"""Demonstrations for the SFT warm start: scripted-expert episodes as padded token batches.

A demonstration is one episode of the run's environment (``envs.registry``; the code-repair
task by default) played by its scripted expert (``EnvSpec.expert``), optionally with detours (a
wrong edit, a ``run`` that shows it failed, then the fix). It is stored as numpy arrays (T =
episode tokens):

  * ``tokens`` int32 [T]: the whole episode stream (prompt, turns, observations);
  * ``action_mask`` bool [T]: tokens the expert (the policy) emitted;
  * ``fix_mask`` bool [T]: action tokens of the turns that change the program
    (``EnvSpec.fix_tools``, ``edit``/``sub`` in code repair),
    the turns that decide success (``run`` and ``submit`` turns are easy to imitate); detours
    excluded;
  * ``detour_mask`` bool [T]: action tokens of detour turns (a wrong edit or a rejected call the
    expert makes on purpose): the SFT loss skips them, so the model learns to recover from the
    observation that follows without learning to make the mistake. With ``learn_guesses`` the
    wrong-guess detours (a same-kind word tried in the bug's place, then ``run``) are left out of
    it and count as fix turns: the model imitates the search itself (which words to try, never
    one already tried), not only the recovery;
  * ``turn_ids`` int32 [T]: 0 on the prompt, k on the k-th turn and its observation.

Crops (``crop_demo``): with ``crop_len > 0`` a demonstration is cut to the ``crop_len`` tokens
that end with its last fix turn (the ``run`` observation that locates the bug, then the fix):
about 4x cheaper steps than whole episodes at the same per-step progress on fix tokens
(measured), so a curriculum can spend its first phase on the skill that decides success.

Batches (``pad_batch``) pad every array to the smallest bucket length that holds the longest
episode, so a run compiles one train step per bucket; ``valid`` marks real tokens. Episodes
longer than the largest bucket are dropped by ``DemoStream`` (counted in ``dropped``).

The stream is a ``grain`` pipeline: task specs from ``data.task_dataset`` over the train split
of the run's ``data`` section (its bug types, held-out combinations and seeds at the stream's own
difficulties, equal weight per difficulty), mapped to demonstrations by
``MakeDemo`` in reader threads that overlap with the jitted train step; its iterator state is a
small JSON dict (restored exactly on resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from agentrl_jax.data import DataConfig, task_dataset
from agentrl_jax.envs.base import Tokenizer
from agentrl_jax.envs.episode import play_episode
from agentrl_jax.envs.registry import EnvSpec, as_env

DEMO_KEYS = ("tokens", "action_mask", "fix_mask", "detour_mask", "turn_ids")


def demo_episode(
    spec: Mapping[str, Any],
    tokenizer: Tokenizer,
    *,
    env: EnvSpec | None = None,
    detour_prob: float = 0.0,
    detour_seed: int = 0,
    max_guesses: int = 1,
    learn_guesses: bool = False,
) -> dict[str, Any]:
    """Plays the expert on the task of ``spec``; returns the demonstration arrays.

    Args:
      spec: a task spec (``seed``, ``difficulty``, ``bug_types``) as ``data.task_dataset`` yields.
      tokenizer: the shared tokenizer.
      env: the environment (default: code repair).
      detour_prob: probability of a detour before each fix, in ``[0, 1]``.
      detour_seed: randomness of the detours.
      max_guesses: most wrong guesses in a row in a wrong-guess detour (``expert_plan_detours``).
      learn_guesses: wrong guesses are trained on (fix turns), not masked as detours.

    Returns:
      ``{"tokens", "action_mask", "fix_mask", "detour_mask", "turn_ids"}`` numpy arrays of
      length T (see the
      module docstring), plus ``"success"`` (bool), ``"bug_types"`` and ``"seed"``.

    Raises:
      ValueError: bad ``detour_prob``, ``max_guesses`` or task spec.
    """
    env = as_env(env)
    task = env.task_factory()(spec)
    policy = env.expert(
        task, tokenizer, detour_prob=detour_prob, seed=detour_seed, max_guesses=max_guesses
    )
    ep = play_episode(env.env(tokenizer), task, policy)
    skipped = policy.detour_turns - policy.guess_turns if learn_guesses else policy.detour_turns
    detour_turns = sorted(skipped)
    fix_turns = [
        k + 1
        for k, log in enumerate(ep.logs)
        if log.get("tool") in env.fix_tools and k + 1 not in skipped
    ]
    fix_mask = ep.action_mask & np.isin(ep.turn_ids, fix_turns)
    return {
        "tokens": ep.tokens,
        "action_mask": ep.action_mask,
        "fix_mask": fix_mask,
        "detour_mask": ep.action_mask & np.isin(ep.turn_ids, detour_turns),
        "turn_ids": ep.turn_ids,
        "success": ep.success,
        "bug_types": task.bug_types,
        "seed": task.seed,
    }


class MakeDemo(grain.transforms.Map):
    """grain transform: task spec -> demonstration (``demo_episode``)."""

    def __init__(
        self,
        env: EnvSpec | str = "coderepair",
        detour_prob: float = 0.0,
        detour_seed: int = 0,
        max_guesses: int = 1,
        learn_guesses: bool = False,
    ):
        if not 0.0 <= detour_prob <= 1.0:
            raise ValueError(f"detour_prob={detour_prob} must be in [0, 1]")
        self.detour_prob = detour_prob
        self.detour_seed = detour_seed
        self.max_guesses = max_guesses
        self.learn_guesses = learn_guesses
        self.env = as_env(env)
        self.tokenizer = self.env.tokenizer()

    def map(self, element: Mapping[str, Any]) -> dict[str, Any]:
        return demo_episode(
            element,
            self.tokenizer,
            env=self.env,
            detour_prob=self.detour_prob,
            detour_seed=self.detour_seed,
            max_guesses=self.max_guesses,
            learn_guesses=self.learn_guesses,
        )


def crop_demo(demo: Mapping[str, Any], crop_len: int) -> dict[str, Any] | None:
    """The ``crop_len`` tokens of ``demo`` ending with its last fix-turn token (None if no fix).

    Raises:
      ValueError: ``crop_len`` < 2.
    """
    if crop_len < 2:
        raise ValueError(f"crop_len={crop_len} must be >= 2")
    fix = np.nonzero(demo["fix_mask"])[0]
    if len(fix) == 0:
        return None
    end = int(fix[-1]) + 1
    start = max(0, end - crop_len)
    out = dict(demo)
    for k in DEMO_KEYS:
        out[k] = demo[k][start:end]
    return out


def bucket_length(n: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= ``n`` (``buckets`` ascending), or None if ``n`` exceeds them all."""
    for b in buckets:
        if n <= b:
            return int(b)
    return None


def pad_batch(demos: Sequence[Mapping[str, Any]], buckets: Sequence[int], pad_id: int) -> dict:
    """Stacks demonstrations into a padded batch.

    Args:
      demos: demonstrations (``demo_episode`` dicts), each at most ``max(buckets)`` tokens.
      buckets: allowed padded lengths, ascending.
      pad_id: token id used for padding.

    Returns:
      ``{"tokens" int32 [B, L], "valid", "action_mask", "fix_mask", "detour_mask" bool [B, L],
      "turn_ids" int32 [B, L] (-1 on padding)}`` with L the bucket of the longest.

    Raises:
      ValueError: empty ``demos``, unsorted ``buckets`` or an episode longer than every bucket.
    """
    if not demos:
        raise ValueError("demos must be non-empty")
    if list(buckets) != sorted(buckets) or not buckets or min(buckets) < 2:
        raise ValueError(f"buckets={tuple(buckets)} must be ascending and >= 2")
    longest = max(len(d["tokens"]) for d in demos)
    length = bucket_length(longest, buckets)
    if length is None:
        raise ValueError(f"episode of {longest} tokens exceeds the largest bucket {max(buckets)}")
    b = len(demos)
    out = {
        "tokens": np.full((b, length), pad_id, np.int32),
        "valid": np.zeros((b, length), bool),
        "action_mask": np.zeros((b, length), bool),
        "fix_mask": np.zeros((b, length), bool),
        "detour_mask": np.zeros((b, length), bool),
        "turn_ids": np.full((b, length), -1, np.int32),
    }
    for i, d in enumerate(demos):
        n = len(d["tokens"])
        out["tokens"][i, :n] = d["tokens"]
        out["valid"][i, :n] = True
        out["action_mask"][i, :n] = d["action_mask"]
        out["fix_mask"][i, :n] = d["fix_mask"]
        if "detour_mask" in d:
            out["detour_mask"][i, :n] = d["detour_mask"]
        out["turn_ids"][i, :n] = d["turn_ids"]
    return out


@dataclasses.dataclass(frozen=True)
class DemoSource:
    """What a demonstration stream draws: difficulties, detours, bucket lengths, seeds.

    Attributes:
      env: the environment (an ``EnvSpec`` or its registry name).
      difficulties: environment difficulty levels (equal weight each).
      detour_prob: probability of a detour before each fix.
      max_guesses: most wrong guesses in a row in a wrong-guess detour (>= 1).
      learn_guesses: train on the wrong guesses (``demo_episode``).
      buckets: padded sequence lengths, ascending; longer episodes are dropped.
      shuffle_seed: seed of the task order.
      read_threads: grain reader threads (demonstrations are played in them).
      crop_len: if > 0, demonstrations are cropped by ``crop_demo`` (padded to ``crop_len``).
    """

    env: EnvSpec | str = "coderepair"
    difficulties: tuple[int, ...] = (1,)
    detour_prob: float = 0.0
    max_guesses: int = 1
    learn_guesses: bool = False
    buckets: tuple[int, ...] = (256, 320, 384)
    shuffle_seed: int = 0
    read_threads: int = 1
    crop_len: int = 0

    def __post_init__(self):
        object.__setattr__(self, "difficulties", tuple(int(d) for d in self.difficulties))
        object.__setattr__(self, "buckets", tuple(int(b) for b in self.buckets))
        if not self.difficulties:
            raise ValueError("difficulties must be non-empty")
        if not 0.0 <= self.detour_prob <= 1.0:
            raise ValueError(f"detour_prob={self.detour_prob} must be in [0, 1]")
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses={self.max_guesses} must be >= 1")
        if not self.buckets or list(self.buckets) != sorted(self.buckets) or self.buckets[0] < 2:
            raise ValueError(f"buckets={self.buckets} must be non-empty, ascending and >= 2")
        if self.read_threads < 0:
            raise ValueError(f"read_threads={self.read_threads} must be >= 0")
        if self.crop_len < 0 or self.crop_len == 1:
            raise ValueError(f"crop_len={self.crop_len} must be 0 (off) or >= 2")


class DemoStream:
    """Infinite stream of padded demonstration batches from the train split (module docstring).

    Args:
      source: what to draw (``DemoSource``).
      batch_size: demonstrations per batch (>= 1).
      data: the run's task settings (bug types, held-out combinations, train seeds); the
        stream draws its train split at ``source.difficulties`` (default ``DataConfig()``).

    Raises:
      ValueError: bad ``batch_size`` or source.
    """

    def __init__(self, source: DemoSource, batch_size: int, data: DataConfig | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.source = source
        self.batch_size = batch_size
        self.tokenizer = as_env(source.env).tokenizer()
        data_cfg = dataclasses.replace(data or DataConfig(), difficulties=source.difficulties)
        ds = task_dataset(
            "train", data_cfg.cells("train"), data_cfg.train_seeds, source.shuffle_seed
        )
        ds = ds.map(
            MakeDemo(
                env=source.env,
                detour_prob=source.detour_prob,
                detour_seed=source.shuffle_seed,
                max_guesses=source.max_guesses,
                learn_guesses=source.learn_guesses,
            )
        )
        read = grain.ReadOptions(
            num_threads=source.read_threads, prefetch_buffer_size=4 * batch_size
        )
        self._iter = iter(ds.to_iter_dataset(read))
        self.dropped = 0

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next padded batch (``pad_batch`` layout)."""
        crop = self.source.crop_len
        buckets = (crop,) if crop else self.source.buckets
        demos = []
        while len(demos) < self.batch_size:
            d = next(self._iter)
            if crop:
                d = crop_demo(d, crop)
            if d is None or len(d["tokens"]) > buckets[-1]:
                self.dropped += 1
                continue
            demos.append(d)
        return pad_batch(demos, buckets, self.tokenizer.pad_id)

    def state(self) -> dict[str, Any]:
        """JSON-safe iterator state (position of the next task)."""
        return {"iterator": self._iter.get_state(), "dropped": self.dropped}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from a ``state()`` dict."""
        self._iter.set_state(state["iterator"])
        self.dropped = int(state.get("dropped", 0))
