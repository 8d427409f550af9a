"""Parameters for the sampler's one-row decode, transformed once per decode call.

At one row per sequence a decode step's matmuls are small ([B, D] rows) and it reads every
weight each step, so the sampler hands the decode model its parameters in the layout that
multiplies fastest there: unstacked groups (no per-step slice out of the depth scan), joined
MLP projections, the tied head transposed, or every weight packed for the CPU skinny-matmul
kernel. The modules use the extra entries where present; the products are the same up to the
matmuls' summation order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from agentrl_jax.kernels import on_multi_device_mesh, skinny_matmul_cpu
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.layers import PACKED
from agentrl_jax.precision import DTypePolicy


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
    stacked axes kept) in place of the two, which ``MLP`` uses where present. The sampler joins
    them once per decode call: at one row per sequence a step's matmuls are small ([B, D] rows),
    and one [32, 256] x [256, 1536] matmul took 0.75x the time of its two halves on the 2-core
    development CPU. The products are the halves' up to the matmul library's summation order
    (bitwise equal at the shapes tested). q/k/v are not joined: their narrow k/v products
    (N = K * H columns) differ in the last bits from a wide one's, for about 1.5% of a step."""

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
    ``Embedder.decode`` uses where present. The sampler adds it once per decode call: at one row
    per sequence the head's [B, D] x [V, D]^T matmul contracts the table's minor axis, and on
    the 2-core development CPU the [8, 256] x [256, 1024] form took 0.6x its time (one row's
    logits differ from the untransposed form's in the last bits: the matmul library sums in
    another order). Untied models (an ``unembed`` [D, V] already) are returned unchanged."""
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
    """Parameters for a one-row decode that runs its weight matmuls through the skinny-matmul
    kernel (``kernels.skinny_matmul_cpu``): each attention projection, dense MLP and MoE expert
    weight gets ``<name>_packed`` beside it (its [contract, out] view as column panels, leading
    stacked and expert axes kept), and ``embed`` gets ``head_packed``, the LM head's [D, V]
    weight as it multiplies (a tied table transposed and scaled as ``Embedder.decode`` scales
    it, or ``unembed``); the modules use those where present (``layers.einsum_or_packed``,
    ``layers.PackedExperts``; a MoE layer on a mesh keeps XLA's). The router keeps XLA's matmul.
    The sampler packs once per decode call, on the CPU backend under float32 policies, where
    the kernel streams a weight about twice as fast as XLA's matmul at a few rows
    (docs/results.md); the products differ from XLA's in the last bits. The packed copies are
    float32 (the weights as a float32 policy multiplies them, whatever their stored dtype) and
    live beside the weights for the call: the weights' memory twice over."""

    def pack_as(w, rank, n_c):
        lead = w.shape[: w.ndim - rank]
        k = math.prod(w.shape[len(lead) : len(lead) + n_c])
        return skinny_matmul_cpu.pack(w.reshape(*lead, k, -1).astype(jnp.float32))

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
    embed["head" + PACKED] = skinny_matmul_cpu.pack(head.astype(jnp.float32))
    inner["embed"] = embed
    return {**packed, "params": inner}


def can_pack(policy: DTypePolicy) -> bool:
    """Whether ``pack_weights`` serves a decode under ``policy`` here: the CPU backend, float32
    compute and accumulation, no fp8, no multi-device mesh (the kernel has no partitioning
    rule), the kernel built. Read at trace time."""
    return (
        jax.default_backend() == "cpu"
        and policy.compute == jnp.float32
        and policy.accum == jnp.float32
        and not policy.fp8_matmul
        and not on_multi_device_mesh()
        and skinny_matmul_cpu.available()
    )
