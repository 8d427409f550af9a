"""Causal sliding-window attention with grouped-query heads.

Query ``t`` attends to keys ``t - window + 1 .. t``; ``window >= T`` is dense causal attention.

Einsum legend: B batch, T query time, S key time, K kv heads, G query heads per kv head
(N = K * G query heads), H head dim, C chunk index, Q query position inside a chunk.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import (
    check_gqa,
    default_scale,
    masked_softmax,
    softmax_grad,
)
from agentrl_jax.kernels.chunked_causal import chunked_causal_attention
from agentrl_jax.kernels.select import OpShape, dtype_name, select_impl
from agentrl_jax.kernels.sliding_window_pallas import sliding_window_attention_pallas

# Largest query chunk of the blocked XLA path: logits per chunk are [C, C * (n_prev + 1)].
_XLA_MAX_CHUNK = 256


def _validate(q: jax.Array, k: jax.Array, v: jax.Array, window: int) -> int:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4; got {q.shape=}, {k.shape=}, {v.shape=}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
    b, t, n, h = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != h:
        raise ValueError(f"k must be [B={b}, T={t}, Hkv, D={h}]; got {k.shape=}")
    if not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"{window=} must be an int >= 1")
    return check_gqa(n, k.shape[2])


def sliding_window_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, softmax_scale: float | None = None
) -> jax.Array:
    """Dense fp32 reference: builds the full [T, T] band mask.

    Args:
      q: [B, T, Hq, D] queries.
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, T, Hkv, D] values.
      window: keys per query, >= 1 (query t sees keys t - window + 1 .. t).
      softmax_scale: logit scale; default 1/sqrt(D).

    Returns:
      [B, T, Hq, D] in q.dtype.

    Raises:
      ValueError: on inconsistent shapes or window < 1.
    """
    g = _validate(q, k, v, window)
    b, t, n, h = q.shape
    scale = default_scale(h, softmax_scale)
    qg = q.astype(jnp.float32).reshape(b, t, n // g, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * scale
    pos = jnp.arange(t)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    p = masked_softmax(logits, mask)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", p, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def _band_geometry(t: int, window: int) -> tuple[int, int, int]:
    """(chunk length c, key chunks before a query chunk n_prev, chunks nc) of the banded path."""
    c = min(t, max(16, min(window, _XLA_MAX_CHUNK)))
    return c, -(-(window - 1) // c), -(-t // c)


def _windows(x, c, n_prev, nc):
    """Keys [B, nc * c, K, H] -> each query chunk's key window [B, nc, (n_prev + 1) * c, K, H]."""
    b, _, kh, h = x.shape
    x = jnp.pad(x, ((0, 0), (n_prev * c, 0), (0, 0), (0, 0))).reshape(b, nc + n_prev, c, kh, h)
    x = jnp.stack([x[:, j : j + nc] for j in range(n_prev + 1)], axis=2)
    return x.reshape(b, nc, (n_prev + 1) * c, kh, h)


def _pad_rows(x, rows):
    return jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0), (0, 0)))


def _banded_forward(q, k, v, window, scale):
    """-> (out [B, T, N, H] in q.dtype, f32 probabilities [B, nc, K, G, c, (n_prev + 1) c])."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    c, n_prev, nc = _band_geometry(t, window)
    q, k, v = (_pad_rows(x, nc * c) for x in (q, k, v))
    kw, vw = _windows(k, c, n_prev, nc), _windows(v, c, n_prev, nc)
    qc = q.reshape(b, nc, c, kh, n // kh, h)
    logits = jnp.einsum("BCQKGH,BCSKH->BCKGQS", qc, kw, preferred_element_type=jnp.float32)
    # Key slot s of chunk i sits at position (i - n_prev) * c + s; query slot r at i * c + r.
    rel = jnp.arange((n_prev + 1) * c)[None, :] - n_prev * c - jnp.arange(c)[:, None]
    kpos = (jnp.arange(nc)[:, None] - n_prev) * c + jnp.arange((n_prev + 1) * c)[None, :]
    mask = (rel <= 0) & (rel > -window)
    mask = mask[None, :, :] & (kpos >= 0)[:, None, :]  # [nc, Q, S]
    p = masked_softmax(logits * scale, mask[None, :, None, None])
    out = jnp.einsum(
        "BCKGQS,BCSKH->BCQKGH", p.astype(vw.dtype), vw, preferred_element_type=jnp.float32
    )
    return out.reshape(b, nc * c, n, h)[:, :t].astype(q.dtype), p


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _banded_xla(q, k, v, window, scale):
    """Sliding-window attention by query chunks, each against the key chunks the window
    reaches (``_band_geometry``); the backward pass reuses the forward's probabilities."""
    return _banded_forward(q, k, v, window, scale)[0]


def _banded_xla_fwd(q, k, v, window, scale):
    out, probs = _banded_forward(q, k, v, window, scale)
    return out, (q, k, v, out, probs)


def _banded_xla_bwd(window, scale, res, d_out):
    q, k, v, out, p = res
    b, t, n, h = q.shape
    kh, g, f32 = k.shape[2], n // k.shape[2], jnp.float32
    c, n_prev, nc = _band_geometry(t, window)
    q, k, v, out, d_out = (_pad_rows(x, nc * c) for x in (q, k, v, out, d_out))
    qc, oc, doc = (x.reshape(b, nc, c, kh, g, h) for x in (q, out, d_out))
    kw, vw = _windows(k, c, n_prev, nc), _windows(v, c, n_prev, nc)
    d_vw = jnp.einsum("BCKGQS,BCQKGH->BCSKH", p.astype(v.dtype), doc, preferred_element_type=f32)
    dp = jnp.einsum("BCQKGH,BCSKH->BCKGQS", doc, vw, preferred_element_type=f32)
    ds = softmax_grad(p, dp, jnp.einsum("BCQKGH,BCQKGH->BCKGQ", doc.astype(f32), oc.astype(f32)))
    ds = (ds * scale).astype(q.dtype)
    dq = jnp.einsum("BCKGQS,BCSKH->BCQKGH", ds, kw, preferred_element_type=f32)
    d_kw = jnp.einsum("BCKGQS,BCQKGH->BCSKH", ds, qc, preferred_element_type=f32)
    (dk,) = jax.linear_transpose(lambda x: _windows(x, c, n_prev, nc), k.astype(f32))(d_kw)
    (dv,) = jax.linear_transpose(lambda x: _windows(x, c, n_prev, nc), v.astype(f32))(d_vw)
    dq = dq.reshape(b, nc * c, n, h)
    return tuple(x[:, :t].astype(y.dtype) for x, y in ((dq, q), (dk, k), (dv, v)))


_banded_xla.defvjp(_banded_xla_fwd, _banded_xla_bwd)


def sliding_window_attention_xla(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, softmax_scale: float | None = None
) -> jax.Array:
    """Blocked XLA implementation with hand-written backward passes.

    ``window >= T`` is plain causal attention: the queries in up to four chunks, each against
    the keys up to its end (``chunked_causal``), GQA without repeating K/V, with a hand-written
    backward pass that reuses the forward's probabilities (``docs/kernels.md``: faster than
    ``jax.nn.dot_product_attention``'s autodiff, which computes the masked half of the logits).
    Otherwise the sequence is cut into chunks and each query chunk attends only to the chunks
    the window reaches (the same kind of backward pass). Matmuls take the input dtype with
    float32 accumulation (probabilities in the value dtype) and the softmax is float32. Shapes
    as :func:`sliding_window_attention_reference`.
    """
    _validate(q, k, v, window)
    scale = default_scale(q.shape[-1], softmax_scale)
    if window >= q.shape[1]:
        return chunked_causal_attention(q, k, v, None, scale)
    return _banded_xla(q, k, v, window, scale)


def sliding_window_attention_cudnn(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, softmax_scale: float | None = None
) -> jax.Array:
    """cuDNN flash attention (``jax.nn.dot_product_attention``) with its sliding-window mask.

    GPU only; bf16/fp16 inputs, head_dim a multiple of 8 up to 128 (cuDNN's limits). Shapes as
    :func:`sliding_window_attention_reference`.
    """
    _validate(q, k, v, window)
    scale = default_scale(q.shape[-1], softmax_scale)
    local = None if window >= q.shape[1] else (window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn"
    )


def op_shape(q: jax.Array, k: jax.Array) -> OpShape:
    """The static facts ``select_impl`` decides on."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    return OpShape(head_dim=h, group=n // kh, dtype=dtype_name(q), seq_len=t, batch=b, kv_heads=kh)


@functools.partial(jax.jit, static_argnames=("window", "softmax_scale", "impl", "interpret"))
def sliding_window_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int,
    softmax_scale: float | None = None,
    impl: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Causal sliding-window attention with grouped-query heads.

    Args:
      q: [B, T, Hq, D] queries (float32 or bfloat16).
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, T, Hkv, D] values.
      window: keys per query, >= 1: query t sees keys t - window + 1 .. t; window >= T is
        dense causal attention.
      softmax_scale: logit scale; default 1/sqrt(D).
      impl: 'xla', 'pallas' (generic kernel: Triton on GPU, interpret mode on CPU), 'cudnn'
        (GPU), 'reference' or 'auto' (``select.TABLE``: cuDNN on GPU where it applies, else
        the Triton kernel where it tiles; XLA on CPU and TPU).
      interpret: run the Pallas kernel in interpret mode (CPU testing).

    Returns:
      [B, T, Hq, D] in q.dtype; softmax and accumulation in float32.

    Raises:
      ValueError: on inconsistent shapes, window < 1 or an unknown impl.
    """
    _validate(q, k, v, window)
    impl = select_impl("sliding_window", impl, op_shape(q, k))
    kw = dict(window=window, softmax_scale=softmax_scale)
    if impl == "pallas":
        return sliding_window_attention_pallas(q, k, v, interpret=interpret, **kw)
    return IMPLEMENTATIONS[impl](q, k, v, **kw)


# Every impl of ``select.TABLE['sliding_window']``, by name.
IMPLEMENTATIONS = {
    "cudnn": sliding_window_attention_cudnn,
    "pallas": sliding_window_attention_pallas,
    "xla": sliding_window_attention_xla,
    "reference": sliding_window_attention_reference,
}
