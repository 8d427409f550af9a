"""Parameters for the sampler's one-row decode, prepared once per weight version.

At one row per sequence a decode step's matmuls are small ([B, D] rows) and it reads every
weight each step, so the decode model reads its parameters in the layout that multiplies
fastest there: unstacked groups (no per-step slice out of the depth scan), joined MLP
projections, the tied head transposed, or every weight packed for the CPU skinny-matmul kernel
(the ``decode_matmul`` op's 'cpu' impl). :func:`prepare_decode` rewrites a parameter tree once
(the agent loop calls it when the weights change) into a :class:`DecodeParams`: the rewritten
tree and the :class:`~agentrl_jax.model.layers.DecodeForm` saying which rewrites it holds, which
the decode model is built with, so each module reads the weights the form names. The products
are the same up to the matmuls' summation order.

Which rewrites apply is :func:`decode_form`'s table:

===============  ===============================================================================
rewrite          when
===============  ===============================================================================
unstacked        ``cfg.n_groups <= options.unstack_max_groups`` (compile time grows with depth)
fused_mlp        ``options.fuse_projections``, a dense model, no fp8 matmuls (their per-tensor
                 scales would change), no multi-device mesh (the joined weight would be
                 resharded)
matmul (packed)  the ``decode_matmul`` op's impl (``model.dispatch.kernel_impl``: the experiment's
                 ``kernels.decode_matmul``, 'auto' = the C++ kernel on the CPU backend under
                 float32 operands and accumulation, no multi-device mesh, where it builds)
head transposed  ``options.transpose_head``, a tied head, not packed, no multi-device mesh
===============  ===============================================================================
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.dispatch import kernel_impl, op_shapes
from agentrl_jax.model.layers import PACKED, DecodeForm
from agentrl_jax.precision import DTypePolicy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Which rewrites :func:`prepare_decode` may make (each also needs its conditions: the
    module table). Packing is the ``decode_matmul`` op's kernel choice, not an option here.

    Attributes:
      unstack_max_groups: unstack models of at most this many pattern groups.
      fuse_projections: join each dense MLP's gate and up projections.
      transpose_head: transpose a tied head's table once.
    """

    unstack_max_groups: int = 16
    fuse_projections: bool = True
    transpose_head: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """A parameter tree as the decode model reads it (a pytree; ``form`` is static).

    Attributes:
      params: the rewritten parameters (leaves the rewrites do not touch are the originals).
      form: which rewrites they hold; the decode model is built with it.
    """

    params: Any
    form: DecodeForm = dataclasses.field(default=DecodeForm(), metadata=dict(static=True))


def decode_form(
    cfg: ModelConfig,
    policy: DTypePolicy,
    options: DecodeOptions = DecodeOptions(),
    backend: str | None = None,
) -> DecodeForm:
    """The rewrites a one-row decode of ``cfg`` under ``policy`` gets on ``backend`` (default:
    the current one) under the ambient mesh (the module table)."""
    multi = kernels.on_multi_device_mesh()
    shape = op_shapes(cfg, policy, seq_len=1, page_size=1)["decode_matmul"]
    matmul = kernel_impl(policy, "decode_matmul", shape, backend)
    head = "table"
    if matmul != "xla":
        head = "packed"
    elif options.transpose_head and cfg.tie_embeddings and not multi:
        head = "transposed"
    fuse = options.fuse_projections and not cfg.is_moe and not policy.fp8_matmul and not multi
    return DecodeForm(
        unstacked=cfg.n_groups <= options.unstack_max_groups,
        fused_mlp=fuse,
        head=head,
        matmul=matmul,
    )


def prepare_decode(
    params,
    policy: DTypePolicy,
    backend: str | None = None,
    *,
    cfg: ModelConfig,
    options: DecodeOptions = DecodeOptions(),
    form: DecodeForm | None = None,
) -> DecodeParams:
    """``params`` rewritten for a one-row decode: :func:`decode_form`'s rewrites (or ``form``'s).

    Call it once per weight version (outside jit: the rewritten leaves are kept; inside a trace
    it rewrites on every call). The originals stay where a rewrite adds a copy beside them (the
    packed copies are float32: the weights' memory twice over).
    """
    form = decode_form(cfg, policy, options, backend) if form is None else form
    out = params
    if form.unstacked:
        out = unstack_groups(out, cfg.n_groups)
    if form.fused_mlp:
        out = fuse_projections(out)
    if form.packed:
        out = pack_weights(out, cfg)
    elif form.head == "transposed":
        out = transpose_head(out)
    return DecodeParams(out, form)


def unstack_groups(params: dict, n_groups: int) -> dict:
    """Parameters of a scanned model (``groups`` stacked [G, ...]) as those of the same model
    with ``unstacked=True`` (``group_0`` .. ``group_<G-1>``, one group's slice each)."""
    inner = dict(params["params"])
    stacked = inner.pop("groups")
    for g in range(n_groups):
        inner[f"group_{g}"] = jax.tree.map(lambda a, g=g: a[g], stacked)
    return {**params, "params": inner}


def fuse_projections(params: dict) -> dict:
    """Parameters for a decode that runs each dense MLP's gate and up projections as one
    matmul: every ``mlp`` gets ``w_gate_up`` [..., D, 2F] (``w_gate``, ``w_up`` joined, leading
    stacked axes kept) in place of the two, which ``MLP`` reads under ``DecodeForm.fused_mlp``.
    At one row per sequence a step's matmuls are small ([B, D] rows), and one [32, 256] x
    [256, 1536] matmul took 0.75x the time of its two halves on the 2-core development CPU. The
    products are the halves' up to the matmul library's summation order (bitwise equal at the
    shapes tested). q/k/v are not joined: their narrow k/v products (N = K * H columns) differ
    in the last bits from a wide one's, for about 1.5% of a step."""

    def walk(tree, name=None):
        if not isinstance(tree, dict):
            return tree
        out = {k: walk(v, k) for k, v in tree.items()}
        if name == "mlp" and {"w_gate", "w_up"} <= out.keys():
            out["w_gate_up"] = jnp.concatenate([out.pop("w_gate"), out.pop("w_up")], axis=-1)
        return out

    return walk(params)


def transpose_head(params: dict) -> dict:
    """Parameters for a decode that runs a tied LM head against its table transposed once: the
    ``embed`` subtree gets ``table_t`` [D, V] (``table`` kept for the token lookup), which
    ``Embedder.decode`` reads under ``DecodeForm.head='transposed'``. At one row per sequence
    the head's [B, D] x [V, D]^T matmul contracts the table's minor axis, and on the 2-core
    development CPU the [8, 256] x [256, 1024] form took 0.6x its time (one row's logits differ
    from the untransposed form's in the last bits: the matmul library sums in another order).
    Untied models (an ``unembed`` [D, V] already) are returned unchanged."""
    inner = dict(params["params"])
    embed = dict(inner["embed"])
    if "unembed" in embed:
        return params
    embed["table_t"] = embed["table"].T
    inner["embed"] = embed
    return {**params, "params": inner}


# weights ``pack_weights`` packs, by their module's name: {weight: (its rank, contracted axes)}
PACKABLE = {
    "attn": {"wq": (3, 1), "wk": (3, 1), "wv": (3, 1), "wo": (3, 2)},
    "mlp": {"w_gate_up": (2, 1), "w_gate": (2, 1), "w_up": (2, 1), "w_down": (2, 1)},
    "moe": {"w_gate": (2, 1), "w_up": (2, 1), "w_down": (2, 1)},  # [E, K, n]: E packed apart
}


def pack_weights(params: dict, cfg: ModelConfig) -> dict:
    """Parameters for a one-row decode that runs its weight matmuls on packed weights (the
    ``decode_matmul`` op's 'cpu' or 'reference' impl): each attention projection, dense MLP and
    MoE expert weight gets ``<name>_packed`` beside it (its [contract, out] view as column
    panels, ``kernels.pack_weight``, leading stacked and expert axes kept), and ``embed`` gets
    ``head_packed``, the LM head's [D, V] weight as it multiplies (a tied table transposed and
    scaled as ``Embedder.decode`` scales it, or ``unembed``); the modules read those under a
    packed ``DecodeForm`` (``layers.weight_product``, ``layers.PackedExperts``; a MoE layer on
    a mesh keeps XLA's). The router keeps XLA's matmul. On the CPU backend under float32
    policies the kernel streams a weight about twice as fast as XLA's matmul at a few rows
    (docs/results.md); the products differ from XLA's in the last bits. The packed copies are
    float32 (the weights as a float32 policy multiplies them, whatever their stored dtype) and
    live beside the weights: the weights' memory twice over."""

    def pack_as(w, rank, n_c):
        lead = w.shape[: w.ndim - rank]
        k = math.prod(w.shape[len(lead) : len(lead) + n_c])
        return kernels.pack_weight(w.reshape(*lead, k, -1))

    def walk(tree, name=None):
        if not isinstance(tree, dict):
            return tree
        out = {k: walk(v, k) for k, v in tree.items()}
        for weight, (rank, n_c) in PACKABLE.get(name, {}).items():
            if weight in out:
                out[weight + PACKED] = pack_as(out[weight], rank, n_c)
        return out

    packed = walk(params)
    inner = dict(packed["params"])
    embed = dict(inner["embed"])
    if "unembed" in embed:
        head = embed["unembed"]
    else:
        # scaled in the stored dtype, as ``Embedder.decode`` writes it (for bf16-stored tables
        # a jitted head may skip that product's rounding to bf16: XLA drops the round trip)
        head = embed["table"].T
        if cfg.scaled_embeddings:
            head = head * (1.0 / jnp.sqrt(float(cfg.d_model)))
    embed["head" + PACKED] = kernels.pack_weight(head)
    inner["embed"] = embed
    return {**packed, "params": inner}
