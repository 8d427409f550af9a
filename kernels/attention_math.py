"""Shared pieces of the attention ops: softmax scale, masked fp32 softmax, flash-attention steps.

Conventions used by every op in this package: softmax and accumulation run in float32 whatever
the input dtype, and a query row that sees no key at all returns zeros (not NaN, not a uniform
average).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """Returns ``softmax_scale`` or ``1/sqrt(head_dim)`` when it is None."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not softmax_scale > 0:
        raise ValueError(f"{softmax_scale=} must be > 0")
    return float(softmax_scale)


def masked_softmax(logits: jax.Array, mask: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax of fp32 ``logits`` over ``axis`` restricted to ``mask``; all-masked rows give 0.

    The row maximum is taken without gradient (softmax is invariant to it) so masked entries
    never produce NaN gradients.
    """
    logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=axis, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def softmax_grad(p: jax.Array, dp: jax.Array, delta: jax.Array) -> jax.Array:
    """Softmax backward from the probabilities: dS = P * (dP - delta), ``delta`` [..., R] the
    rows' sums of dO * O (equal to the sums of P * dP)."""
    return p * (dp - delta[..., None])


def masked_logsumexp(logits: jax.Array, mask: jax.Array, axis: int = -1) -> jax.Array:
    """fp32 log-sum-exp of ``logits`` over ``axis`` restricted to ``mask``; -inf where nothing
    is visible (the neutral element of the merge of partial softmaxes)."""
    logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
    m = jnp.max(logits, axis=axis)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    den = jnp.sum(jnp.where(mask, jnp.exp(logits - jnp.expand_dims(m_safe, axis)), 0.0), axis)
    return jnp.where(den > 0, m_safe + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)


def check_gqa(q_heads: int, kv_heads: int) -> int:
    """Returns the GQA group size ``q_heads // kv_heads``; raises if it is not whole."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads=} must be a positive multiple of {kv_heads=}")
    return q_heads // kv_heads


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    s: jax.Array,
    v: jax.Array,
    v_col_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention step: folds a block of masked logits into fp32 (m_i, l_i, acc).

    Args:
      carry: running max m_i [R], normaliser l_i [R], unnormalised output acc [R, H] (fp32).
      s: [R, C] fp32 logits of this key block, -inf where masked.
      v: [C, H] values of this key block (the probabilities are cast to its dtype).
      v_col_scale: optional fp32 [C] factor of each value row (int8 dequantisation), applied
        to the probabilities' columns before the matmul so V itself is never rescaled.
    """
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    pw = p if v_col_scale is None else p * v_col_scale[None, :]
    pv = jax.lax.dot_general(
        pw.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, alpha * l_prev + jnp.sum(p, axis=-1), alpha[:, None] * acc + pv


def online_softmax_update_cols(
    m_prev: jax.Array,
    l_prev: jax.Array,
    acc: jax.Array,
    s: jax.Array,
    v: jax.Array,
    pv_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``online_softmax_step`` with the statistics as [R, 1] columns (the TPU kernels' layout).

    Args:
      m_prev, l_prev: running max and normaliser, fp32 [R, 1]; acc: fp32 [R, H].
      s: [R, C] fp32 logits, -inf where masked; v: [C, H] values.
      pv_scale: optional [R, 1] factor on this block's ``p @ v`` (int8 value scales).
    """
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    pv = matmul_f32(p.astype(v.dtype), v, (1, 0))
    if pv_scale is not None:
        pv = pv * pv_scale
    return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def online_softmax_init(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Initial fp32 (m_i, l_i, acc) for ``rows`` query rows."""
    return (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def online_softmax_finish(
    carry: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [R, H] fp32, logsumexp [R]); rows that saw no key give out 0, lse +inf."""
    m_i, l_i, acc = carry
    visible = l_i > 0
    l_safe = jnp.where(visible, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = jnp.where(visible, m_i + jnp.log(l_safe), jnp.inf)
    return out, lse


def qk_logits(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """[R, H] x [C, H] -> fp32 [R, C] logits times ``scale``."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s * scale


def matmul_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """2-D matmul contracting ``a`` dim contract[0] with ``b`` dim contract[1], fp32 result."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def gpu_compiler_params(num_warps: int = 4, num_stages: int = 2):
    """Compiler params selecting the lowering these generic kernels are written for.

    On GPU the kernels use the Triton lowering (whole-array K/V refs sliced with ``pl.ds``,
    dynamic loop bounds), which Mosaic GPU, the default since JAX 0.10, does not accept. None
    elsewhere (interpret mode, TPU).
    """
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # a JAX without the Triton lowering: let Pallas pick
        return None
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def padded_group(g: int, interpret: bool, tokens_per_tile: int = 1) -> int:
    """Query heads per kv head a tile of ``tokens_per_tile`` tokens is padded to on GPU.

    Triton dots need power-of-two tiles of >= 16 rows; elsewhere ``g`` is returned unchanged.
    """
    if interpret or jax.default_backend() != "gpu":
        return g
    need = -(-16 // tokens_per_tile)
    return max(1 << (g - 1).bit_length(), 1 << (need - 1).bit_length())
