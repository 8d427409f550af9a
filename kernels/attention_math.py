"""Shared pieces of the attention ops: impl selection, softmax scale, masked fp32 softmax.

Conventions used by every op in this package: softmax and accumulation run in float32 whatever
the input dtype, and a query row that sees no key at all returns zeros (not NaN, not a uniform
average).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    """Maps ``impl`` to a concrete implementation name.

    Args:
      impl: 'auto' (Pallas on GPU/TPU, XLA on CPU), 'xla' or 'pallas'.

    Returns:
      'xla' or 'pallas'.

    Raises:
      ValueError: if ``impl`` is not one of 'auto', 'xla', 'pallas'.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(repr(i) for i in IMPLS)}")
    if impl == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return impl


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


def check_gqa(q_heads: int, kv_heads: int) -> int:
    """Returns the GQA group size ``q_heads // kv_heads``; raises if it is not whole."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads=} must be a positive multiple of {kv_heads=}")
    return q_heads // kv_heads
