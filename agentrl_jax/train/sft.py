"""SFT warm start: behaviour cloning of scripted-expert demonstrations.

Legend: B batch, T padded episode length, V vocabulary, K turn slots (``MAX_TURN_SLOTS``).

Loss (``sft_loss``), next-token cross-entropy of the teacher-forced model, position t predicting
token t+1:

    loss = mean_{action tokens} nll + lm_weight * mean_{other valid tokens} nll

Action tokens are the expert's (``action_mask``) minus its deliberate detours (``detour_mask``,
which neither term trains on); ``lm_weight > 0`` adds a language-model loss on
prompt and observation tokens (program text, test output, value traces), which teaches the
model the code idioms and the copy skill an edit needs from far more tokens than the actions
alone. Both means are over the batch's tokens of that kind (a batch without such tokens
contributes 0).

Metrics per step: ``loss``, ``action_nll``, ``lm_nll``, ``action_acc`` (argmax accuracy on
action tokens), ``fix_acc`` (on the action tokens of ``edit``/``sub`` turns), ``turn_exact`` /
``fix_turn_exact`` (fraction of whole turns whose every token is the argmax: the teacher-forced
proxy of greedy success), ``grad_norm``, ``lr``, ``tokens_per_s``, ``steps_per_s`` and
``cpu_s_per_step`` (process CPU time: the honest cost on a shared machine), and where the backend
reports device memory ``peak_device_memory_bytes`` / ``_fraction`` (a warning at 85%).

Curriculum: the first ``curriculum_fraction`` of the steps draws demonstrations from
``curriculum_difficulties`` (e.g. easy level 0), cropped to ``curriculum_crop_len`` tokens ending
with the fix when that is > 0 (``demos.crop_demo``: cheap steps on the turns that decide
success), the rest whole episodes from ``difficulties``.

``run_sft`` writes ``metrics.jsonl`` (prefix ``sft/``) and orbax checkpoints under
``<run_dir>/checkpoints/sft`` and shows a progress bar with ETA. Training is teacher-forced with
``model.apply``; the ``*-parity`` dtype policies matter for RL logprob recomputation, not here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentrl_jax.data import DataConfig
from agentrl_jax.envs.registry import EnvSpec, as_env
from agentrl_jax.metrics import MetricsWriter, ProgressBar, memory_metrics
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params, training_view
from agentrl_jax.precision import DTypePolicy, get_policy
from agentrl_jax.rl.state import TrainState, make_optimizer
from agentrl_jax.sharding import StepShardings
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir
from agentrl_jax.train.demos import DemoSource, DemoStream
from agentrl_jax.train.placement import Placement

logger = logging.getLogger(__name__)

MAX_TURN_SLOTS = 64  # turns per episode tracked by the exact-match metrics (later ones merged)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """SFT settings (config section ``sft``). Bad values raise ``ValueError`` naming the field.

    Attributes:
      steps: optimiser steps.
      batch_size: demonstrations per step.
      lr: peak learning rate (AdamW).
      warmup_steps: linear warm-up steps, then cosine decay to ``lr * min_lr_ratio``.
      min_lr_ratio: final learning rate as a fraction of ``lr``.
      weight_decay: AdamW decoupled weight decay.
      grad_clip: global-norm clip (0 disables).
      b2: AdamW second-moment decay.
      lm_weight: weight of the LM loss on non-action tokens (0 = action tokens only).
      difficulties: environment levels of the demonstrations (equal weight each).
      curriculum_difficulties: levels of the first ``curriculum_fraction`` of steps (empty: none).
      curriculum_fraction: fraction of steps in the curriculum phase, in ``[0, 1)``.
      curriculum_crop_len: crop curriculum demonstrations to this many tokens (0: whole).
      detour_prob: probability of a detour (wrong edit, run, fix) before each expert fix.
      max_guesses: most wrong guesses in a row in a wrong-guess detour (>= 1; the expert's
        ``expert_plan_detours``).
      learn_guesses: train on the wrong-guess detours instead of masking them
        (``demos.demo_episode``): the model imitates a search over same-kind words.
      buckets: padded sequence lengths (one compiled step each); longer demos are dropped.
      read_threads: grain threads that play demonstrations while the step runs.
      log_every: steps between metric records.
      checkpoint_every: steps between checkpoints (0: only the final one).
      max_to_keep: checkpoints kept.
      seed: parameter init, task order and detours.
    """

    steps: int = 2000
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    b2: float = 0.99
    lm_weight: float = 0.25
    difficulties: tuple[int, ...] = (1,)
    curriculum_difficulties: tuple[int, ...] = ()
    curriculum_fraction: float = 0.0
    curriculum_crop_len: int = 0
    detour_prob: float = 0.1
    max_guesses: int = 1
    learn_guesses: bool = False
    buckets: tuple[int, ...] = (256, 320, 384)
    read_threads: int = 1
    log_every: int = 25
    checkpoint_every: int = 0
    max_to_keep: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("difficulties", "curriculum_difficulties", "buckets"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        for name in ("steps", "batch_size", "log_every", "max_to_keep", "max_guesses"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "checkpoint_every", "read_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"SFTConfig.lr={self.lr} must be > 0")
        for name in ("min_lr_ratio", "detour_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be in [0, 1]")
        if not 0.0 <= self.curriculum_fraction < 1.0:
            raise ValueError(
                f"SFTConfig.curriculum_fraction={self.curriculum_fraction} must be in [0, 1)"
            )
        if self.curriculum_crop_len < 0 or self.curriculum_crop_len == 1:
            raise ValueError(
                f"SFTConfig.curriculum_crop_len={self.curriculum_crop_len} must be 0 or >= 2"
            )
        if not 0.0 < self.b2 < 1.0:
            raise ValueError(f"SFTConfig.b2={self.b2} must be in (0, 1)")
        for name in ("lm_weight", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 0")
        if not self.difficulties:
            raise ValueError("SFTConfig.difficulties must be non-empty")
        for d in self.difficulties + self.curriculum_difficulties:
            if not 0 <= d <= 4:
                raise ValueError(f"SFTConfig difficulty {d} must be in [0, 4]")
        if not self.buckets or list(self.buckets) != sorted(self.buckets) or self.buckets[0] < 2:
            raise ValueError(f"SFTConfig.buckets={self.buckets} must be ascending and >= 2")

    @property
    def curriculum_steps(self) -> int:
        if not self.curriculum_difficulties:
            return 0
        return int(round(self.steps * self.curriculum_fraction))


def lr_schedule(cfg: SFTConfig) -> optax.Schedule:
    """Linear warm-up to ``lr`` over ``warmup_steps``, cosine decay to ``lr * min_lr_ratio``."""
    warmup = min(cfg.warmup_steps, cfg.steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=cfg.steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def sft_optimizer(cfg: SFTConfig, frozen_groups: int = 0) -> optax.GradientTransformation:
    """The project's ``make_optimizer`` with the SFT settings: the ``lr_schedule``, b1 0.9,
    weight decay on every parameter, global-norm clipping when ``grad_clip > 0``, the model's
    ``frozen_groups`` left unchanged."""
    return make_optimizer(
        lr_schedule(cfg),
        weight_decay=cfg.weight_decay,
        b2=cfg.b2,
        grad_clip=cfg.grad_clip,
        frozen_groups=frozen_groups,
    )


def _turn_exact(correct, mask, turn_ids):
    """Fraction of (row, turn) groups with at least one ``mask`` token, all of them correct."""
    b = correct.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], correct.shape)
    turns = jnp.clip(turn_ids, 0, MAX_TURN_SLOTS - 1)
    has = jnp.zeros((b, MAX_TURN_SLOTS), bool).at[rows, turns].max(mask)
    wrong = jnp.zeros((b, MAX_TURN_SLOTS), bool).at[rows, turns].max(mask & ~correct)
    n = jnp.sum(has)
    return jnp.sum(has & ~wrong) / jnp.maximum(n, 1), n


def _masked_mean(x, mask):
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def sft_loss(
    logits: jax.Array, batch: dict[str, jax.Array], lm_weight: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The SFT loss (module docstring) and its metrics from teacher-forced logits.

    Args:
      logits: float32 [B, T, V], ``model.apply(params, batch["tokens"])``.
      batch: ``tokens`` int32 [B, T], ``valid``, ``action_mask``, ``fix_mask`` bool [B, T],
        optional ``detour_mask`` bool [B, T] (skipped by both terms), ``turn_ids`` int32
        [B, T] (``demos.pad_batch`` layout).
      lm_weight: weight of the LM term on valid non-action tokens (>= 0).

    Returns:
      ``(loss scalar float32, metrics dict of float32 scalars)``.
    """
    tgt = batch["tokens"][:, 1:]
    lg = logits[:, :-1].astype(jnp.float32)
    nll = jax.nn.logsumexp(lg, axis=-1) - jnp.take_along_axis(lg, tgt[..., None], -1)[..., 0]
    act = batch["action_mask"][:, 1:]
    fix = batch["fix_mask"][:, 1:]
    other = batch["valid"][:, 1:] & ~act
    if "detour_mask" in batch:  # the expert's deliberate mistakes: no loss on them
        act = act & ~batch["detour_mask"][:, 1:]
    action_nll = _masked_mean(nll, act)
    lm_nll = _masked_mean(nll, other)
    loss = action_nll + lm_weight * lm_nll
    correct = jnp.argmax(lg, axis=-1) == tgt
    turn_exact, n_turns = _turn_exact(correct, act, batch["turn_ids"][:, 1:])
    fix_exact, n_fix = _turn_exact(correct, fix, batch["turn_ids"][:, 1:])
    metrics = {
        "loss": loss,
        "action_nll": action_nll,
        "lm_nll": lm_nll,
        "action_acc": _masked_mean(correct, act),
        "fix_acc": _masked_mean(correct, fix),
        "turn_exact": turn_exact,
        "fix_turn_exact": fix_exact,
        "action_tokens": jnp.sum(act).astype(jnp.float32),
        "fix_turns": n_fix.astype(jnp.float32),
        "turns": n_turns.astype(jnp.float32),
    }
    return loss, metrics


def make_train_step(
    model: Transformer,
    optimizer: optax.GradientTransformation,
    lm_weight: float,
    shardings: StepShardings | None = None,
):
    """The jitted ``train_step(state, batch) -> (state, metrics)`` (``TrainState`` donated).

    ``batch`` holds the ``pad_batch`` arrays; one compile per bucket length. With
    ``shardings`` the step is jitted with them (``StepShardings.jit``): parameters, gradients and
    optimiser state sharded by the logical rules, batch rows over the batch axes, metrics
    replicated; without, plain ``jax.jit`` on the default device.
    """

    def loss_fn(params, batch):
        view, view_params = training_view(model, params)
        logits, _, extras = view.apply(view_params, batch["tokens"])
        loss, metrics = sft_loss(logits, batch, lm_weight)
        if "aux_loss" in extras:  # MoE load-balance / z losses
            loss = loss + extras["aux_loss"]
            metrics["aux_loss"] = extras["aux_loss"]
        return loss, metrics

    def train_step(state: TrainState, batch):
        grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.global_norm(grads)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

    if shardings is not None:
        return shardings.jit(train_step)
    return jax.jit(train_step, donate_argnums=(0,))


def _streams(cfg: SFTConfig, env: EnvSpec | str, data: DataConfig | None) -> dict[str, DemoStream]:
    """The demonstration streams of a run: ``main`` and, with a curriculum, ``curriculum``."""

    def stream(difficulties, seed_offset: int, crop_len: int = 0) -> DemoStream:
        source = DemoSource(
            env=env,
            crop_len=crop_len,
            difficulties=difficulties,
            detour_prob=cfg.detour_prob,
            max_guesses=cfg.max_guesses,
            learn_guesses=cfg.learn_guesses,
            buckets=cfg.buckets,
            shuffle_seed=cfg.seed + seed_offset,
            read_threads=cfg.read_threads,
        )
        return DemoStream(source, cfg.batch_size, data)

    streams = {"main": stream(cfg.difficulties, 0)}
    if cfg.curriculum_steps:
        streams["curriculum"] = stream(cfg.curriculum_difficulties, 1, cfg.curriculum_crop_len)
    return streams


class _StepLog:
    """Accumulates step metrics (device scalars, no sync) until a log line is written."""

    def __init__(self, cfg: SFTConfig):
        self.cfg = cfg
        self.acc: dict[str, Any] = {}
        self.n, self.tokens = 0, 0
        self.t, self.cpu = time.perf_counter(), time.process_time()

    def add(self, metrics: dict[str, Any], n_tokens: int) -> None:
        self.n += 1
        self.tokens += n_tokens
        for k, v in metrics.items():
            self.acc[k] = self.acc.get(k, 0.0) + v

    def line(self, step: int, seq_len: int) -> dict[str, float]:
        """The averaged metrics of the steps since the last line (``step`` is 0-based)."""
        now, cpu = time.perf_counter(), time.process_time()
        out = {k: float(v) / self.n for k, v in self.acc.items()}
        out["lr"] = float(lr_schedule(self.cfg)(step))
        out["tokens_per_s"] = self.tokens / (now - self.t)
        out["steps_per_s"] = self.n / (now - self.t)
        out["seq_len"] = seq_len
        # CPU seconds per step (all threads): on a shared machine, wall time / step overstates
        # the cost; this is what an idle machine would need (divided by cores).
        out["cpu_s_per_step"] = (cpu - self.cpu) / self.n
        # device memory where the backend reports it (warns at the 85% watermark)
        memory = memory_metrics()
        for key in ("peak_device_memory_bytes", "peak_device_memory_fraction"):
            if memory[key] is not None:
                out[key] = memory[key]
        self.acc, self.n, self.tokens, self.t, self.cpu = {}, 0, 0, now, cpu
        return out


def _restore(ckpt: Checkpointer, state: TrainState, streams: dict) -> tuple[TrainState, int]:
    """The latest SFT checkpoint's state and the streams' positions; returns ``(state, step)``
    (the restored arrays placed like ``state``'s)."""
    out = ckpt.restore(params=state.params, opt_state=state.opt_state, set_aside=True)
    start = out["step"]
    state = state._replace(
        params=out["params"],
        opt_state=out["opt_state"],
        step=jnp.asarray(start, jnp.int32),
        rng=out["rng"],
    )
    for name, st in out["meta"].get("data", {}).items():
        if name in streams:
            streams[name].restore(st)
    logger.info("resumed SFT at step %d", start)
    return state, start


def run_sft(
    model_cfg: ModelConfig,
    policy: DTypePolicy | str,
    cfg: SFTConfig,
    run_dir: str,
    *,
    env: EnvSpec | str = "coderepair",
    data: DataConfig | None = None,
    params: Any = None,
    resume: bool = False,
    writer: MetricsWriter | None = None,
    progress: bool | None = None,
    placement: Placement | None = None,
) -> tuple[Any, dict[str, float]]:
    """Runs the SFT stage; returns ``(params, final metrics)``.

    Args:
      model_cfg: the model (its ``vocab_size`` must cover the environment's tokenizer).
      policy: dtype policy or preset name.
      cfg: SFT settings.
      run_dir: an existing run directory (metrics and ``checkpoints/sft`` are written there).
      env: the environment or its registry name (its expert makes the demonstrations).
      data: the run's task settings (``DemoStream``); default ``DataConfig()``.
      params: initial parameters (default: ``init_params`` with ``cfg.seed``).
      resume: continue from the newest intact checkpoint in ``run_dir`` (newer unusable ones
        are set aside, ``Checkpointer.restore``; without ``resume`` an existing one is an
        error: a checkpoint is never overwritten silently).
      writer: metrics writer to share with the caller (default: a new one on ``run_dir``).
      progress: force the progress bar on/off (default: on for a TTY).
      placement: the run's mesh (``train/placement.py``): parameters and optimiser state
        sharded, batches split over the batch axes, one jitted step over the mesh; on a
        multi-process run only process 0 writes metrics. Default: the default device.

    Returns:
      ``(params, metrics)``: metrics of the last logged step plus ``sft/wall_s``, ``sft/steps``,
      ``sft/steps_per_s``, ``sft/tokens_per_s`` (padded tokens) and ``sft/dropped_demos``.

    Raises:
      ValueError: the vocabulary is too small, ``run_dir`` already holds SFT checkpoints and
        ``resume`` is False, or none of them is intact.
    """
    vocab = as_env(env).tokenizer().vocab_size
    if model_cfg.vocab_size < vocab:
        raise ValueError(f"model vocab_size={model_cfg.vocab_size} must be >= {vocab}")
    model = Transformer(model_cfg, get_policy(policy))
    place = placement or Placement.default_device(model_cfg, model.policy)
    ckpt = Checkpointer(stage_dir(run_dir, "sft"), resume=resume, max_to_keep=cfg.max_to_keep)
    optimizer = sft_optimizer(cfg, model_cfg.frozen_groups)
    rng = jax.random.key(cfg.seed)
    if params is None:
        params = init_params(model, jax.random.fold_in(rng, 0))
    state = place.init_state(params, None, rng, optimizer)
    streams = _streams(cfg, env, data)
    start = 0
    if resume and ckpt.latest_step() is not None:
        state, start = _restore(ckpt, state, streams)
        state = place.place_state(state, optimizer)

    own_writer = writer is None
    writer = MetricsWriter(run_dir, enabled=place.primary) if own_writer else writer
    shardings = place.step_shardings(optimizer, cfg.batch_size)
    step_fn = make_train_step(model, optimizer, cfg.lm_weight, shardings)
    save = lambda step: ckpt.save(  # noqa: E731
        step,
        params=state.params,
        opt_state=state.opt_state,
        rng=state.rng,
        meta={"data": {k: s.state() for k, s in streams.items()}},
    )
    last: dict[str, float] = {}
    log = _StepLog(cfg)
    t0 = time.perf_counter()
    progress = progress if place.primary else False  # one bar: process 0's
    bar = ProgressBar(cfg.steps, desc="sft", initial=start, enabled=progress)
    try:
        for step in range(start, cfg.steps):
            batch = streams["curriculum" if step < cfg.curriculum_steps else "main"].next_batch()
            state, metrics = step_fn(state, place.place_batch(batch))
            log.add(metrics, batch["tokens"].size)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                n = log.n
                last = log.line(step, int(batch["tokens"].shape[1]))
                writer.write(done, last, prefix="sft")
                bar.update(n, loss=last["loss"], acc=last["action_acc"], fix=last["fix_turn_exact"])
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.steps:
                save(done)
        if start < cfg.steps or ckpt.latest_step() != cfg.steps:
            save(cfg.steps)
    finally:
        bar.close()
        ckpt.close()
        if own_writer:
            writer.close()
        else:
            writer.flush()
    wall = time.perf_counter() - t0
    summary = {f"sft/{k}": v for k, v in last.items()}
    summary.update(
        {
            "sft/wall_s": wall,
            "sft/steps": float(cfg.steps),
            "sft/steps_per_s_overall": (cfg.steps - start) / wall if wall > 0 else 0.0,
            "sft/dropped_demos": float(sum(s.dropped for s in streams.values())),
        }
    )
    return state.params, summary


def sft_model(model_cfg: ModelConfig, policy: DTypePolicy | str) -> Transformer:
    """The ``Transformer`` SFT trains (helper for callers holding config sections)."""
    return Transformer(model_cfg, get_policy(policy))


def param_summary(params) -> dict[str, int]:
    """``{"params": total parameter count}``."""
    return {"params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))}
