"""RL trainer configuration, train state and optimiser.

``RLConfig`` fixes every knob of the RL algorithm (the advantage estimator, optimiser, PPO
epochs/minibatches, micro-batching, the nested ``LossConfig``, replay switches, non-finite
fallback, asynchrony); ``TrainState`` is the pytree
the jitted updates of SFT and RL consume and return (donated); ``make_optimizer`` builds the one
optax chain clip_by_global_norm -> AdamW, its learning rate and weight decay injected
hyperparameters (``rl_optimizer``: with the RL settings and warmup(+cosine) shape).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from agentrl_jax.precision import policy_names
from agentrl_jax.rl.advantages import advantage_names
from agentrl_jax.rl.losses import LossConfig

OLD_LOGPROBS = ("recompute", "rollout")
PARTIAL_ROLLOUTS = ("continue", "reprefill", "abort")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Every knob of the RL algorithm (hashable; bad values raise ``ValueError``).

    Attributes:
      advantage: registered advantage estimator (``agentrl_jax.rl.advantages``).
      advantage_kwargs: its hyperparameters (not part of the hash; equality compares them).
      lr: peak learning rate (> 0).
      warmup_steps: linear warmup from 0 over this many optimiser updates (>= 0).
      decay_steps: cosine decay to ``lr * final_lr_ratio`` over this many updates after warmup;
        0 keeps the rate constant after warmup.
      final_lr_ratio: end of the cosine decay as a fraction of ``lr``, in [0, 1].
      weight_decay: decoupled AdamW weight decay (>= 0), applied to parameters with ndim >= 2.
      b1, b2: Adam moment decay rates, in [0, 1).
      eps: Adam epsilon (> 0).
      grad_clip: global-norm clip (> 0); None disables clipping.
      ppo_epochs: passes over the batch per update step (>= 1).
      n_minibatches: optimiser updates per epoch; the batch is permuted (per epoch, from the
        step's rng) and split into this many minibatches (must divide the batch size).
      micro_batch: sequences per gradient-accumulation micro-batch (must divide the minibatch);
        None = the whole minibatch at once.
      loss: the policy-loss configuration (clipping, aggregation, KL, entropy coefficient
        ``loss.entropy_coef``, MoE load-balance/z coefficients, mismatch corrections).
      old_logprobs: PPO anchor logp_old. 'recompute': a no-gradient teacher-forced pass with the
        pre-update parameters at the start of the step (same policy and path as training, so the
        first PPO ratio is exactly 1 and rollout/train numerics go into the correction weights
        rho = exp(logp_old - logp_rollout)); 'rollout': the sampler's logprobs (rho = 1, the
        numerics mismatch enters the PPO ratio itself). With 1 epoch x 1 minibatch the
        recompute is fused into the gradient pass (its stop-gradient logprobs, no extra forward).
      log_mismatch: compute rollout-vs-train mismatch metrics every step (from the pre-update
        pass; free with old_logprobs='recompute').
      use_routing_replay: recompute with ``batch['routes']`` forced as the MoE routes.
      use_kv_mask_replay: replay the rollout's KV evictions (``batch['kv_evict_at']``) and int8
        KV decisions (``batch['kv_int8_at']``, when present) in the recompute; needs a parity
        policy (the chunked path).
      use_block_replay: every F layer attends to the blocks the rollout selected
        (``batch['sparse_blocks']``, recorded with ``rollout.record_blocks``), in both passes.
      max_consecutive_nonfinite: non-finite steps in a row after which ``FallbackController``
        switches to ``fallback_policy`` (>= 0; 0 disables the fallback).
      fallback_policy: dtype-policy preset used during a fallback.
      fallback_steps: steps run under the fallback policy before switching back (>= 1).
      max_staleness: asynchronous RL (``train/async_rl.py``): the rollouts of batch ``b`` start
        under policy version ``max(0, b - max_staleness)`` (version ``v`` = the parameters after
        ``v`` updates) while the learner trains on earlier batches, so a token the update of
        step ``b`` trains on lags the current parameters by at most ``max_staleness`` versions
        (>= 0). 0 is the synchronous loop: every batch rolled out by the current parameters,
        then the update. With ``old_logprobs='recompute'`` a value > 0 needs an importance
        correction of the lag (``loss.tis_cap``, ``loss.icepop_band`` or ``loss.geo_band``).
      sync_every_rounds: asynchronous RL: every this many agent-loop rounds of a batch's
        rollouts (counted over its refill rounds) the rollout side moves one version closer to
        the batch's own (never past it), waiting for it if the learner has not published it
        yet; episodes in flight then continue as ``partial_rollout`` says (>= 0; 0: a batch
        keeps the version it started with). Switch points are counted in rounds, never timed,
        so a run is reproducible and resumes bitwise.
      partial_rollout: what episodes in flight do when the weights switch mid-batch:
        ``"continue"`` (decode on under the new weights over the KV the old ones computed; each
        token keeps the version and the logprob it was sampled with), ``"reprefill"`` (their
        whole token stream is prefilled again under the new weights first; nothing decoded is
        lost) or ``"abort"`` (they restart from their prompt: their tokens are thrown away).
      mismatch_sources: log the rollout/trainer logprob gap by source every step
        (``mismatch_src/*``: policy lag, numerics, routing replay, KV-mask replay) from extra
        teacher-forced passes: one per behaviour version other than the current one, one of
        the current parameters, and one more each for MoE routing and recorded KV marks
        (``train/mismatch_sources.py``; ``mismatch_src/extra_passes`` counts them).
    """

    advantage: str = "grpo"
    advantage_kwargs: dict = dataclasses.field(default_factory=dict, hash=False)
    lr: float = 1e-4
    warmup_steps: int = 0
    decay_steps: int = 0
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    ppo_epochs: int = 1
    n_minibatches: int = 1
    micro_batch: int | None = None
    loss: LossConfig = LossConfig()
    old_logprobs: str = "recompute"
    log_mismatch: bool = True
    use_routing_replay: bool = False
    use_kv_mask_replay: bool = False
    use_block_replay: bool = False
    max_consecutive_nonfinite: int = 3
    fallback_policy: str = "bf16"
    fallback_steps: int = 10
    max_staleness: int = 0
    sync_every_rounds: int = 0
    partial_rollout: str = "continue"
    mismatch_sources: bool = False

    def __post_init__(self):
        if self.advantage not in advantage_names():
            raise ValueError(
                f"RLConfig.advantage={self.advantage!r} is not registered; known: "
                f"{advantage_names()}"
            )
        if not isinstance(self.advantage_kwargs, Mapping):
            raise ValueError(
                f"RLConfig.advantage_kwargs={self.advantage_kwargs!r} must be a dict of the "
                "estimator's keyword arguments"
            )
        if not self.lr > 0:
            raise ValueError(f"RLConfig.lr={self.lr} must be > 0")
        for field in (
            "warmup_steps",
            "decay_steps",
            "max_consecutive_nonfinite",
            "max_staleness",
            "sync_every_rounds",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"RLConfig.{field}={value!r} must be an int >= 0")
        for field in ("ppo_epochs", "n_minibatches", "fallback_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RLConfig.{field}={value!r} must be an int >= 1")
        if self.micro_batch is not None and (
            not isinstance(self.micro_batch, int) or self.micro_batch < 1
        ):
            raise ValueError(f"RLConfig.micro_batch={self.micro_batch!r} must be an int >= 1")
        if not 0.0 <= self.final_lr_ratio <= 1.0:
            raise ValueError(f"RLConfig.final_lr_ratio={self.final_lr_ratio} must be in [0, 1]")
        if not self.weight_decay >= 0:
            raise ValueError(f"RLConfig.weight_decay={self.weight_decay} must be >= 0")
        for field in ("b1", "b2"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ValueError(f"RLConfig.{field}={getattr(self, field)} must be in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"RLConfig.eps={self.eps} must be > 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"RLConfig.grad_clip={self.grad_clip} must be > 0 or None")
        if not isinstance(self.loss, LossConfig):
            raise ValueError(f"RLConfig.loss must be a LossConfig, got {type(self.loss).__name__}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"RLConfig.old_logprobs={self.old_logprobs!r}; allowed: {OLD_LOGPROBS}"
            )
        if self.fallback_policy not in policy_names():
            raise ValueError(
                f"RLConfig.fallback_policy={self.fallback_policy!r}; allowed: {policy_names()}"
            )
        if self.partial_rollout not in PARTIAL_ROLLOUTS:
            raise ValueError(
                f"RLConfig.partial_rollout={self.partial_rollout!r}; allowed: {PARTIAL_ROLLOUTS}"
            )
        loss = self.loss
        corrected = loss.tis_cap or loss.icepop_band or loss.geo_band
        if self.max_staleness > 0 and self.old_logprobs == "recompute" and not corrected:
            raise ValueError(
                f"RLConfig.max_staleness={self.max_staleness} trains on tokens of older policy "
                "versions: with old_logprobs='recompute' set an importance correction of the "
                "lag (loss.tis_cap, loss.icepop_band or loss.geo_band), or old_logprobs='rollout'"
            )

    def replace(self, **changes) -> RLConfig:
        return dataclasses.replace(self, **changes)


class TrainState(NamedTuple):
    """Everything a jitted update carries from step to step (a pytree; donated to the update).

    The one train state of the project: SFT's ``train_step`` and RL's ``update_fn`` both take and
    return it.

    Attributes:
      step: int32 scalar, update steps taken (skipped ones included).
      params: model parameters.
      opt_state: optax state of ``make_optimizer`` (unchanged by a skipped step); its
        ``hyperparams`` hold the learning rate and weight decay as f32 scalars.
      rng: typed PRNG key of the run (the loop splits it; ``update_fn`` only reads it when no
        rng is passed).
      nonfinite_count: int32 scalar, steps skipped for non-finite loss/gradients so far.
      consecutive_nonfinite: int32 scalar, skipped steps in a row (0 after a good step).
      hparams: loss hyperparameters as traced f32 scalars that override ``RLConfig.loss``
        (the registered loss's ``traced`` fields; ``ppo``: ``clip_low``, ``clip_high``), for a
        vectorised sweep (``jax.vmap`` of the update over points); empty otherwise (the
        config's Python constants are used).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    nonfinite_count: jax.Array
    consecutive_nonfinite: jax.Array
    hparams: dict = {}


def unit_schedule(cfg: RLConfig) -> optax.Schedule | None:
    """The shape of the RL learning rate over updates, peak 1 (None: constant).

    Linear warmup from 0 over ``warmup_steps``, then constant, or cosine to ``final_lr_ratio``
    over ``decay_steps``. ``make_optimizer`` multiplies it by the (injected) peak rate.
    """
    if cfg.decay_steps > 0:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=1.0,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.warmup_steps + cfg.decay_steps,
            end_value=cfg.final_lr_ratio,
        )
    if cfg.warmup_steps > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, 1.0, cfg.warmup_steps), optax.constant_schedule(1.0)],
            [cfg.warmup_steps],
        )
    return None


def decay_mask(params):
    """Weight decay on parameters with ndim >= 2 only (not norm scales or biases)."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def freeze_lower(frozen_groups: int) -> optax.GradientTransformation:
    """Zeroes the updates of what ``ModelConfig.frozen_groups`` freezes: the token embedding
    (``embed/table``; a tied head with it) and rows ``[0, frozen_groups)`` of the stacked
    pattern groups (``groups/...`` [G, ...]). Their gradients are zero already (the forward
    stops them); this keeps weight decay off them too."""

    def one(path, u):
        keys = [getattr(k, "key", None) for k in path]
        if "embed" in keys and keys[-1] == "table":
            return jnp.zeros_like(u)
        if "groups" in keys:
            return u.at[:frozen_groups].set(0)
        return u

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    shape: optax.Schedule | None = None,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float | None = None,
    mask: Any = None,
    frozen_groups: int = 0,
) -> optax.GradientTransformation:
    """The project's optimiser: clip_by_global_norm(grad_clip) -> AdamW (-> ``freeze_lower``).

    ``learning_rate`` and ``weight_decay`` are injected hyperparameters
    (``optax.inject_hyperparams``): they live in the optimiser state as f32 scalars, so a
    vectorised sweep stacks states whose points each carry their own values.

    Args:
      learning_rate: a float (the peak rate, stored in the state; times ``shape(count)`` when a
        shape is given) or a schedule (evaluated every update from the state's count).
      shape: optional schedule multiplying a float ``learning_rate`` (``unit_schedule``).
      weight_decay: decoupled AdamW weight decay.
      b1, b2, eps: Adam.
      grad_clip: global-norm clip; None or 0 disables it.
      mask: AdamW's weight-decay mask (``decay_mask``) or None (all parameters).
      frozen_groups: ``ModelConfig.frozen_groups`` (> 0: their updates zeroed, ``freeze_lower``).

    Raises:
      ValueError: ``shape`` with a schedule ``learning_rate``.
    """
    if shape is not None and callable(learning_rate):
        raise ValueError("shape multiplies a float learning_rate, not a schedule")

    def chain(learning_rate, weight_decay):
        lr = learning_rate if shape is None else (lambda count: learning_rate * shape(count))
        parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
        adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)
        frozen = [freeze_lower(frozen_groups)] if frozen_groups else []
        return optax.chain(*parts, adamw, *frozen)

    return optax.inject_hyperparams(chain)(learning_rate=learning_rate, weight_decay=weight_decay)


def rl_optimizer(cfg: RLConfig, frozen_groups: int = 0) -> optax.GradientTransformation:
    """``make_optimizer`` with the RL settings (peak ``cfg.lr`` times ``unit_schedule(cfg)``) and
    the model's ``frozen_groups``."""
    return make_optimizer(
        cfg.lr,
        shape=unit_schedule(cfg),
        weight_decay=cfg.weight_decay,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        grad_clip=cfg.grad_clip,
        mask=decay_mask,
        frozen_groups=frozen_groups,
    )


def init_train_state(params, cfg: RLConfig, rng: jax.Array, tx=None) -> TrainState:
    """Fresh ``TrainState`` (step 0, zero counters, optimiser initialised from ``params``).

    ``tx`` is the optimiser (default ``rl_optimizer(cfg)``). ``params`` are not copied: the
    update donates the state, so pass a copy (``jax.tree.map(jnp.copy, params)``) if the caller
    keeps using its own.
    """
    zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state is donated
    tx = rl_optimizer(cfg) if tx is None else tx
    return TrainState(
        step=zero(),
        params=params,
        opt_state=tx.init(params),
        rng=rng,
        nonfinite_count=zero(),
        consecutive_nonfinite=zero(),
    )
