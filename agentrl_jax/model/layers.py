"""Basic layers: RMSNorm, tied embedding, rotary position embedding; the weight layout a decode
reads (``DecodeForm``) and the weight matmul that follows it.

Legend: B batch, T time, D model dim, N query heads, H head dim, V vocab.
Every layer takes the run's ``DTypePolicy``; nothing here hard-codes a dtype except the
fp32 statistics of the norm and the fp32 logits the policy requires.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import DTypePolicy, matmul_form, weight_einsum

PACKED = "_packed"  # suffix of a weight packed for a decode_matmul impl (``DecodeForm.matmul``)
HEADS = ("table", "transposed", "packed")


@dataclasses.dataclass(frozen=True)
class DecodeForm:
    """How the parameters a model reads are laid out (``model.decode_params.prepare_decode``
    rewrites them for the sampler's one-row decode); the modules read the weights this names.
    The default is the parameters as trained.

    Attributes:
      unstacked: the pattern groups stored per group (``group_<g>``), not stacked for the scan.
      fused_mlp: each dense MLP's gate and up projections joined (``w_gate_up`` [D, 2F]).
      head: the LM head's weight: 'table' (the tied table, or ``unembed``), 'transposed' (the
        tied table transposed once: ``table_t`` [D, V]) or 'packed' (``head_packed``).
      matmul: the ``decode_matmul`` impl of the weight matmuls (``kernels.select.TABLE``):
        'xla' (the weights as stored), 'cpu' or 'reference' (``<name>_packed`` beside every
        attention projection, dense MLP and MoE expert weight: ``kernels.pack_weight``).

    Raises:
      ValueError: an unknown head or matmul impl, or a packed matmul without the packed head.
    """

    unstacked: bool = False
    fused_mlp: bool = False
    head: str = "table"
    matmul: str = "xla"

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"DecodeForm.head={self.head!r}; allowed: {HEADS}")
        if self.matmul not in kernels.OP_IMPLS["decode_matmul"]:
            allowed = kernels.OP_IMPLS["decode_matmul"]
            raise ValueError(f"DecodeForm.matmul={self.matmul!r}; allowed: {allowed}")
        if self.packed != (self.head == "packed"):
            raise ValueError(f"DecodeForm: matmul={self.matmul!r} goes with head='packed' only")

    @property
    def packed(self) -> bool:
        """Whether the weight matmuls read packed copies."""
        return self.matmul != "xla"

    def describe(self) -> str:
        """What the form changes, for logs (``'as trained'`` for the default)."""
        parts = ["groups unstacked"] if self.unstacked else []
        parts += ["MLP gate/up joined"] if self.fused_mlp else []
        parts += [f"weights packed for decode_matmul={self.matmul!r}"] if self.packed else []
        parts += ["tied head transposed"] if self.head == "transposed" else []
        return ", ".join(parts) or "as trained"


def param_init(std: float):
    return nn.initializers.normal(stddev=std)


def packed_matmul(
    subscripts: str, x: jax.Array, packed: jax.Array, w_shape: tuple, impl: str
) -> jax.Array:
    """``einsum(subscripts, x, w)`` for ``w`` of shape ``w_shape`` given as
    ``kernels.pack_weight`` of its [contract, out] view: float32, by the decode_matmul impl
    ``impl`` ('cpu': the C++ kernel; 'reference'). ``subscripts`` must read
    ``<batch><contract>,<contract><out>-><batch><out>``."""
    ins, out = subscripts.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    form = matmul_form(xs, ws, out)
    if form is None or form[1]:
        raise ValueError(f"packed_matmul takes <batch><c>,<c><out> subscripts; got {subscripts!r}")
    n_b = form[0]
    n_c = x.ndim - n_b
    rows = x.reshape(*x.shape[:n_b], -1).astype(jnp.float32)
    y = kernels.packed_matmul(rows, packed, math.prod(w_shape[n_c:]), impl=impl)
    return y.reshape(*x.shape[:n_b], *w_shape[n_c:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExperts:
    """A MoE layer's expert weights [E, K, n] as ``kernels.pack_weight`` laid them out
    (``panels`` [E, Np, K, P], ``decode_params.pack_weights``), handed to the expert matmuls in
    place of the weight (``expert_matmul.expert_einsum``) with the decode_matmul ``impl`` that
    multiplies them. ``shape`` is the weight's."""

    panels: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    impl: str = dataclasses.field(default="cpu", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.panels.shape[0], self.panels.shape[2], self.n)


def weight_product(
    module: nn.Module,
    name: str,
    subscripts: str,
    x: jax.Array,
    w: jax.Array,
    policy: DTypePolicy,
    form: DecodeForm,
) -> jax.Array:
    """``policy.einsum(subscripts, x, w)`` for ``module``'s weight ``name``; under a packed
    ``form`` (``DecodeForm.matmul`` 'cpu' or 'reference', float32 policies) the same product
    of its packed copy ``<name>_packed`` by that impl (its sums run in another order, so the
    last bits differ).

    Raises:
      ValueError: a packed form whose parameters lack ``<name>_packed``.
    """
    if not form.packed:
        return policy.einsum(subscripts, x, w)
    packed = module.get_variable("params", name + PACKED)
    if packed is None:
        raise ValueError(
            f"{module.name}: DecodeForm.matmul={form.matmul!r} reads {name + PACKED!r}, which "
            "the parameters lack (decode_params.prepare_decode makes it)"
        )
    return packed_matmul(subscripts, x, packed, w.shape, form.matmul).astype(policy.compute)


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics; output in the compute dtype. x [..., D] -> [..., D].

    The weight multiplies as ``1 + scale`` (zero-initialised) or, with
    ``cfg.norm_offset=False``, as ``scale`` (one-initialised). ``axis`` is the weight's
    logical axis name (``head_dim`` for the q/k norms).
    """

    cfg: ModelConfig
    policy: DTypePolicy
    axis: str = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        offset = self.cfg.norm_offset
        init = nn.initializers.zeros_init() if offset else nn.initializers.ones_init()
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(init, (self.axis,)),
            (x.shape[-1],),
            self.policy.param,
        )
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        weight = scale.astype(jnp.float32) + 1.0 if offset else scale.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(var + self.cfg.norm_eps) * weight
        return y.astype(self.policy.compute)


class Embedder(nn.Module):
    """Token embedding; with tied embeddings the same table produces the logits. ``form.head``
    names the head weight :meth:`decode` reads."""

    cfg: ModelConfig
    policy: DTypePolicy
    form: DecodeForm = DecodeForm()

    def setup(self):
        self.table = self.param(
            "table",
            # std 1/sqrt(D): encode's sqrt(D) scale gives unit-rms rows, the scale of the layers'
            # outputs once trained. A unit-std table (rows of rms sqrt(D) in the residual
            # stream) drowned the layers: the default model could not learn to copy a token
            # from its context (the code-repair fix "sub TYPO NAME" stayed at chance).
            nn.with_logical_partitioning(param_init(self.cfg.d_model**-0.5), ("vocab", "embed")),
            (self.cfg.vocab_size, self.cfg.d_model),
            self.policy.param,
        )
        if not self.cfg.tie_embeddings:
            self.unembed = self.param(
                "unembed",
                nn.with_logical_partitioning(param_init(self.cfg.init_std), ("embed", "vocab")),
                (self.cfg.d_model, self.cfg.vocab_size),
                self.policy.param,
            )

    def encode(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, T] -> [B, T, D] (compute dtype), times sqrt(D) (unit rms at init)
        unless ``cfg.scaled_embeddings`` is False."""
        x = jnp.take(self.table, tokens, axis=0)
        if not self.cfg.scaled_embeddings:
            return x.astype(self.policy.compute)
        return (x * jnp.sqrt(float(self.cfg.d_model)).astype(x.dtype)).astype(self.policy.compute)

    def decode(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> logits float32 [B, T, V]."""
        if self.form.head == "packed":  # ``decode_params.pack_weights``
            d, v = self.cfg.d_model, self.cfg.vocab_size
            head = self.get_variable("params", "head" + PACKED)
            y = packed_matmul("BTD,DV->BTV", x, head, (d, v), self.form.matmul)
            return y.astype(self.policy.logits)
        if self.cfg.tie_embeddings:
            # The table transposed once per weight version (``decode_params.transpose_head``):
            # the same products, a faster matmul at a few rows.
            transposed = self.form.head == "transposed"
            w = self.get_variable("params", "table_t") if transposed else self.table
            if self.cfg.frozen_groups:  # a frozen embedding is a frozen tied head
                w = jax.lax.stop_gradient(w)
            # 1/sqrt(D): initial logits have std 1/sqrt(D) (rows of norm 1 at init, unit-rms x).
            if self.cfg.scaled_embeddings:
                w = w * (1.0 / jnp.sqrt(float(self.cfg.d_model)))
            logits = weight_einsum(
                "BTD,DV->BTV" if transposed else "BTD,VD->BTV",
                x.astype(self.policy.compute),
                w.astype(self.policy.compute),
                preferred_element_type=jnp.float32,
            )
        else:
            logits = weight_einsum(
                "BTD,DV->BTV",
                x.astype(self.policy.compute),
                self.unembed.astype(self.policy.compute),
                preferred_element_type=jnp.float32,
            )
        return logits.astype(self.policy.logits)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split layout). x [B, T, N, H], positions int32 [B, T]."""
    h = x.shape[-1]
    if h % 2:
        raise ValueError(f"rope needs an even head_dim, got {h=}")
    freq = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2.0 / h)
    angle = positions.astype(jnp.float32)[..., None] * freq  # [B, T, H/2]
    sin = jnp.sin(angle)[:, :, None, :]
    cos = jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
