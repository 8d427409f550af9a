"""Causal attention by query chunks with a hand-written backward pass (an XLA path).

The queries are cut into up to ``_CHUNKS`` chunks (``causal_chunks``); chunk ``i`` attends to the
keys up to its last row only, so of the ``T x T`` logits about ``(n + 1) / (2 n)`` are computed
for ``n`` chunks (0.625 at four). The backward pass reuses the forward's probabilities
(dS = P * (dP - rowsum(dO * O))) over each chunk's key range: on XLA's CPU backend this is
faster than autodiff of ``jax.nn.dot_product_attention``, which computes the masked half too
(``docs/kernels.md``). An optional block selection masks keys further: the dense form of
block-sparse attention, for sequences short enough that gathering each query's blocks costs
more than computing the masked logits.

Einsum legend: B batch, T query time, S key time, K kv heads, G query heads per kv head
(N = K * G query heads), H head dim, Q query row inside a chunk, J key block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from agentrl_jax.kernels.attention_math import masked_softmax, softmax_grad

# At most this many query chunks, of at least _MIN_CHUNK rows.
_CHUNKS = 4
_MIN_CHUNK = 32


def causal_chunks(t: int) -> list[tuple[int, int]]:
    """Query row ranges [start, end) over ``t`` rows; chunk ``i`` sees keys ``0 .. end_i - 1``."""
    c = max(_MIN_CHUNK, -(-t // _CHUNKS))
    return [(s, min(s + c, t)) for s in range(0, t, c)]


def _chunk_mask(s: int, e: int, blocks, block_size: int) -> jax.Array:
    """Visibility of keys 0 .. e-1 from query rows s .. e-1: [Q, S], or with ``blocks``
    (bool [B, T, K, J]: the key blocks each query row selected per kv head) [B, K, 1, Q, S]."""
    causal = jnp.arange(e)[None, :] <= jnp.arange(s, e)[:, None]
    if blocks is None:
        return causal
    chosen = blocks[:, s:e][..., jnp.arange(e) // block_size]  # [B, Q, K, S]
    return causal & chosen.transpose(0, 2, 1, 3)[:, :, None]


def _forward(q, k, v, blocks, scale, block_size):
    """-> (out [B, T, N, H] in q.dtype, per chunk the f32 probabilities [B, K, G, Q, S])."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    outs, probs = [], []
    for s, e in causal_chunks(t):
        logits = jnp.einsum(
            "BQKGH,BSKH->BKGQS", qg[:, s:e], k[:, :e], preferred_element_type=jnp.float32
        )
        p = masked_softmax(logits * scale, _chunk_mask(s, e, blocks, block_size))
        pv = jnp.einsum(
            "BKGQS,BSKH->BQKGH", p.astype(v.dtype), v[:, :e], preferred_element_type=jnp.float32
        )
        outs.append(pv)
        probs.append(p)
    return jnp.concatenate(outs, axis=1).reshape(b, t, n, h).astype(q.dtype), probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def chunked_causal_attention(q, k, v, blocks, scale, block_size=1):
    """Causal GQA attention by query chunks.

    Args:
      q: [B, T, N, H]; k, v: [B, T, K, H] (N a multiple of K).
      blocks: None, or bool [B, T, K, J] with ``J * block_size >= T``: query row t of kv head k
        sees key s only where ``blocks[b, t, k, s // block_size]`` (and s <= t).
      scale: logit scale. block_size: keys per block of ``blocks``.

    Returns:
      [B, T, N, H] in q.dtype (f32 softmax and accumulation, probabilities in v's dtype for
      the value matmul); rows that see no key are zero.
    """
    return _forward(q, k, v, blocks, scale, block_size)[0]


def _fwd(q, k, v, blocks, scale, block_size):
    out, probs = _forward(q, k, v, blocks, scale, block_size)
    return out, (q, k, v, blocks, out, probs)


def _bwd(scale, block_size, res, d_out):
    q, k, v, blocks, out, probs = res
    b, t, n, h = q.shape
    kh, f32 = k.shape[2], jnp.float32
    qg, dog = q.reshape(b, t, kh, n // kh, h), d_out.reshape(b, t, kh, n // kh, h)
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", dog.astype(f32), out.reshape(dog.shape).astype(f32))
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    for (s, e), p in zip(causal_chunks(t), probs):
        do_c = dog[:, s:e]
        dv = dv.at[:, :e].add(
            jnp.einsum("BKGQS,BQKGH->BSKH", p.astype(v.dtype), do_c, preferred_element_type=f32)
        )
        dp = jnp.einsum("BQKGH,BSKH->BKGQS", do_c, v[:, :e], preferred_element_type=f32)
        ds = (softmax_grad(p, dp, delta[..., s:e]) * scale).astype(q.dtype)
        dq.append(jnp.einsum("BKGQS,BSKH->BQKGH", ds, k[:, :e], preferred_element_type=f32))
        dk = dk.at[:, :e].add(
            jnp.einsum("BKGQS,BQKGH->BSKH", ds, qg[:, s:e], preferred_element_type=f32)
        )
    dq = jnp.concatenate(dq, axis=1).reshape(q.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


chunked_causal_attention.defvjp(_fwd, _bwd)
