"""int8 fake quantisation of paged K/V with one fp32 scale per (logical page, KV head).

Legend: B sequences, S key time (a multiple of L), J = S / L logical pages, L page size,
K kv heads, H head dim.

A logical page is ``page_size`` consecutive positions (``[j*L, (j+1)*L)``), i.e. one block-table
entry. Only the marked tokens of a page are quantised, with
``scale[b, j, k] = max |x[b, s, k, :]| * fp32(1/127)`` over the marked ``s`` of page ``j`` and
``x_q = clip(round(x / scale), -127, 127)`` (round half to even), dequantised as
``x_q * scale`` and cast back to ``x.dtype``; unmarked tokens are returned unchanged. A page whose
marked values are all zero gets scale 0 and dequantises to zeros.

Used by the rollout cache (``model.attention``): tokens the KV-compression rule moves to int8
(``EvictionConfig(int8=True)``) and, under a ``kv_cache_dtype='int8'`` policy, every completed
page are replaced *in the pool* by these dequantised values (the pool keeps its float dtype; see
``rollout.kv_cache.kv_bytes_per_seq`` for the int8 storage accounting). The gradient is
straight-through (identity): rounding has no useful derivative, and the forward values, which
are what replay has to reproduce bitwise, do not depend on this choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

INT8_MAX = 127.0


def page_scales(x: jax.Array, mark: jax.Array, page_size: int) -> jax.Array:
    """Per (page, head) int8 scales of the marked tokens.

    Args:
      x: [B, S, K, H] keys or values (any float dtype), S a multiple of ``page_size``.
      mark: bool [B, S] tokens to quantise.
      page_size: L.

    Returns:
      float32 [B, J, K]: ``max |x|`` over the marked tokens of each page and head times
      ``fp32(1/127)``
      (0 where a page has no marked token).

    Raises:
      ValueError: S not a multiple of ``page_size``.
    """
    b, s, k, h = x.shape
    if s % page_size:
        raise ValueError(f"key length {s=} must be a multiple of {page_size=}")
    a = jnp.abs(x.astype(jnp.float32)).max(axis=-1)  # [B, S, K]
    a = jnp.where(mark[..., None], a, 0.0)
    # times the fp32 reciprocal (not a division): XLA may rewrite division by a constant that way
    return a.reshape(b, s // page_size, page_size, k).max(axis=2) * jnp.float32(1.0 / INT8_MAX)


def quantize_pages(x: jax.Array, mark: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """int8 codes and scales: x [B,S,K,H], mark bool [B,S] -> (int8 [B,S,K,H], f32 [B,J,K]).

    Unmarked tokens get code 0. ``codes * scale`` (scale broadcast over the page) is what
    :func:`fake_quant_pages` returns for the marked tokens.
    """
    b, s, k, h = x.shape
    scale = page_scales(x, mark, page_size)
    per_tok = jnp.repeat(scale, page_size, axis=1)[..., None]  # [B, S, K, 1]
    safe = jnp.where(per_tok > 0, per_tok, 1.0)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / safe), -INT8_MAX, INT8_MAX)
    q = jnp.where(mark[:, :, None, None], q, 0.0)
    return q.astype(jnp.int8), scale


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def fake_quant_pages(x: jax.Array, mark: jax.Array, page_size: int) -> jax.Array:
    """Marked tokens of ``x`` replaced by their int8 round trip (module docstring).

    x [B, S, K, H] float, mark bool [B, S] -> same shape and dtype as ``x``. Straight-through
    gradient.
    """
    codes, scale = quantize_pages(x, mark, page_size)
    per_tok = jnp.repeat(scale, page_size, axis=1)[..., None]
    deq = (codes.astype(jnp.float32) * per_tok).astype(x.dtype)
    return jnp.where(mark[:, :, None, None], deq, x)


@fake_quant_pages.defjvp
def _fake_quant_jvp(page_size, primals, tangents):
    x, mark = primals
    return fake_quant_pages(x, mark, page_size), tangents[0]
