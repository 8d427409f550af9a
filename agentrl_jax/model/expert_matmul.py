"""The MoE layer's per-expert matmuls ``EC<k>,E<k><n>->EC<n>`` (``expert_einsum``), in the form
this backend runs fastest: one batched einsum, or on the CPU backend with bf16 compute one 2-D
matmul per expert with a hand-written backward (``per_expert_matmuls``, ``PER_EXPERT_MAX``).

The per-expert form unrolls E at trace time (hence the bound): stand-alone, bf16, the expert
SwiGLU's forward + backward took 1.6x the batched einsum's time as a ``lax.map`` over the
experts and 0.75x as unrolled dots.

Legend: E experts (local to the shard), C capacity rows, k contracted dim, n output dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.layers import PackedExperts
from agentrl_jax.precision import DTypePolicy


@functools.cache
def mixed_batched_dot_compiles(compute: str, accum: str) -> bool:
    """Whether this backend compiles a batched ``compute x compute -> accum`` dot.

    Some XLA:CPU builds reject bf16 x bf16 -> f32 batched dots ("Unsupported element type for
    DotThunk"; seen in this project, not on jax 0.10.2): a tiny one is compiled once to find out.
    """
    x = jax.ShapeDtypeStruct((2, 4, 8), jnp.dtype(compute))
    w = jax.ShapeDtypeStruct((2, 8, 4), jnp.dtype(compute))

    def dot(x, w):
        return jnp.einsum("ECD,EDF->ECF", x, w, preferred_element_type=jnp.dtype(accum))

    try:
        jax.jit(dot).lower(x, w).compile()
    except (jax.errors.JaxRuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


# On the CPU backend, up to this many local experts run their narrow-dtype (bf16) matmuls as one
# 2-D matmul per expert, forward and backward (``_per_expert_matmul``); more go batched.
PER_EXPERT_MAX = 16


def per_expert_matmuls(policy: DTypePolicy, n_local_experts: int) -> bool:
    """Whether ``expert_einsum`` runs one 2-D matmul per expert (else one batched einsum): on
    the CPU backend, a compute dtype narrower than the accumulation (bf16; not fp8) and at most
    ``PER_EXPERT_MAX`` local experts."""
    return (
        jax.default_backend() == "cpu"
        and jnp.dtype(policy.compute).itemsize < jnp.dtype(policy.accum).itemsize
        and not policy.fp8_matmul
        and n_local_experts <= PER_EXPERT_MAX
    )


def _check_expert_form(subscripts: str) -> None:
    ins, out = subscripts.split("->")
    xs, ws = ins.split(",")
    if (xs[0], xs[1], xs[2], ws[2]) != (ws[0], out[1], ws[1], out[2]) or out[0] != xs[0]:
        raise ValueError(f"expert matmul {subscripts!r} is not EC<k>,E<k><n>->EC<n>")


def expert_einsum(policy: DTypePolicy, subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``policy.einsum`` for batched per-expert matmuls ``EC<k>,E<k><n>->EC<n>``.

    Where :func:`per_expert_matmuls` holds, each expert's product is a 2-D matmul
    (``_per_expert_matmul``): XLA CPU runs the 2-D bf16 dots of the forward and of the
    hand-written backward faster than the batched dots (the bf16 MoE update step 0.80-0.85x as
    long; docs/results.md). Elsewhere one batched dot; where the CPU backend rejects the
    mixed-dtype batched dot (``mixed_batched_dot_compiles``) the inputs are rounded to the
    compute dtype first and multiplied in the accumulation dtype: the same products, a dot every
    CPU build has, at about 0.4x the bf16 rate where both exist.
    """
    if isinstance(w, PackedExperts):  # the one-row decode's packed experts (pack_weights)
        _check_expert_form(subscripts)
        y = kernels.packed_matmul(x.astype(jnp.float32), w.panels, w.n, impl=w.impl)
        return y.astype(policy.compute)
    if per_expert_matmuls(policy, w.shape[0]):
        _check_expert_form(subscripts)
        x, w = x.astype(policy.compute), w.astype(policy.compute)
        return _per_expert_matmul(x, w, policy.accum, policy.compute)
    if (
        jax.default_backend() != "cpu"
        or policy.compute == policy.accum
        or mixed_batched_dot_compiles(policy.compute_dtype, policy.accum_dtype)
    ):
        return policy.einsum(subscripts, x, w)
    if not policy.fp8_matmul:  # fp8 quantises from the original values; rounding first would differ
        x, w = x.astype(policy.compute), w.astype(policy.compute)
    wide = policy.replace(compute_dtype=policy.accum_dtype)
    return wide.einsum(subscripts, x, w).astype(policy.compute)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _per_expert_matmul(x, w, accum, out):
    """x [E, C, K] @ w [E, K, N] -> [E, C, N] in ``out``, accumulated in ``accum``, as E 2-D
    matmuls; the backward reads the cotangent in x's dtype and is E 2-D matmuls per operand
    (the weight gradients in ``precision._matmul``'s fast form, a leading unit batch axis).
    The same products and sums as the batched einsum; only the summation order may differ.
    Not ``precision.weight_einsum`` per expert slice: the same bits and step time (with
    ``jnp.split``; ``x[e]`` slices transpose to zero-padded full arrays, twice the step time),
    but each expert's residuals are then saved as separate slices: the bf16 MoE gradient's XLA
    temp bytes grew 9% (``tests/model/test_plan.py``'s MoE case: 435 -> 475 MB)."""
    return _per_expert_fwd(x, w, accum, out)[0]


def _per_expert_fwd(x, w, accum, out):
    ys = [jnp.einsum("ck,kn->cn", x[e], w[e], preferred_element_type=accum) for e in range(len(w))]
    return jnp.stack(ys).astype(out), (x, w)


def _per_expert_bwd(accum, out, res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = [jnp.einsum("cn,kn->ck", g[e], w[e], preferred_element_type=accum) for e in range(len(w))]
    dw = [
        jnp.einsum("uck,ucn->kn", x[e][None], g[e][None], preferred_element_type=accum)
        for e in range(len(w))
    ]
    return jnp.stack(dx).astype(x.dtype), jnp.stack(dw).astype(w.dtype)


_per_expert_matmul.defvjp(_per_expert_fwd, _per_expert_bwd)
