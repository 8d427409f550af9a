"""Block-sparse causal attention with grouped-query heads and per-token block selection.

Each query token and kv head selects up to ``n_sel`` key blocks of ``block_size`` tokens
(shared by the query heads of that kv head's group); ``-1`` marks an unused slot. Causality
still applies: key ``s`` is never seen by query ``t < s``, including inside the query's own
block. Selections are sets: out-of-range entries count as unused and a repeated block counts
once. Queries and keys share positions (self-attention, S == T).

The reference, the XLA path and the selection helpers live in ``block_sparse_xla``; the Triton
kernels in ``block_sparse_pallas``, the Mosaic TPU forward in ``block_sparse_tpu``.

Einsum legend: B batch, T query time, S key time, K kv heads, G query heads per kv head
(N = K * G query heads), H head dim, L selection slot, P position inside a key block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from agentrl_jax.kernels.block_sparse_pallas import block_sparse_attention_pallas
from agentrl_jax.kernels.block_sparse_tpu import block_sparse_attention_pallas_tpu
from agentrl_jax.kernels.block_sparse_xla import (
    block_sparse_attention_reference,
    block_sparse_attention_xla,
    block_sparse_attention_xla_gather,
    normalize_block_indices,
    validate,
)
from agentrl_jax.kernels.select import OpShape, dtype_name, select_impl

__all__ = [
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "block_sparse_attention_xla",
    "normalize_block_indices",
    "op_shape",
]


def op_shape(
    q: jax.Array, k: jax.Array, block_indices: jax.Array, block_size: int, query_block: int
):
    """The static facts ``select_impl`` decides on."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    return OpShape(
        head_dim=h,
        group=n // kh,
        dtype=dtype_name(q),
        seq_len=t,
        batch=b,
        kv_heads=kh,
        block_size=block_size,
        query_block=query_block,
        n_sel=block_indices.shape[-1],
    )


@functools.partial(
    jax.jit, static_argnames=("block_size", "softmax_scale", "query_block", "impl", "interpret")
)
def block_sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block_indices: jax.Array,
    *,
    block_size: int,
    softmax_scale: float | None = None,
    query_block: int = 1,
    impl: str = "auto",
    interpret: bool | Any = False,
) -> jax.Array:
    """Block-sparse causal attention; the block selection is shared by each GQA group.

    Args:
      q: [B, T, Hq, D] queries (float32 or bfloat16).
      k: [B, T, Hkv, D] keys; Hq must be a multiple of Hkv.
      v: [B, T, Hkv, D] values.
      block_indices: int32 [B, T, Hkv, n_sel] key blocks each query token attends to for each
        kv head; -1 = unused slot; out-of-range ids count as unused, repeats count once.
      block_size: tokens per key block (block j holds keys j*block_size .. (j+1)*block_size-1).
      softmax_scale: logit scale; default 1/sqrt(D).
      query_block: the caller's promise that the selection is the same for every aligned group
        of ``query_block`` tokens (tokens i*query_block ..); the fast impls then read each
        group's first row and process the group as one tile (bigger matmuls, K/V read once per
        group). 1 (default): per-token selection. The reference ignores it.
      impl: 'xla', 'xla_gather' (the gathered form at every length), 'pallas' (generic
        kernels: Triton on GPU, interpret mode on CPU), 'pallas_tpu' (scalar-prefetch Mosaic
        forward, XLA backward), 'reference' or 'auto' (``select.TABLE``: the Triton kernels on
        GPU and the Mosaic one on TPU where their tiles fit, else XLA; XLA on CPU).
      interpret: run the Pallas kernel in interpret mode (CPU testing): True, or for
        'pallas_tpu' also ``pltpu.InterpretParams()`` (TPU semantics).

    Returns:
      [B, T, Hq, D] in q.dtype; float32 softmax/accumulation; a query whose selected blocks hold
      no key <= t returns zeros.

    Raises:
      ValueError: on inconsistent shapes, block_size or query_block < 1, or an unknown impl.
    """
    validate(q, k, v, block_indices, block_size, query_block)
    shape = op_shape(q, k, block_indices, block_size, query_block)
    impl = select_impl("block_sparse", impl, shape)
    kw = dict(block_size=block_size, softmax_scale=softmax_scale, query_block=query_block)
    if impl in ("pallas", "pallas_tpu"):
        return IMPLEMENTATIONS[impl](q, k, v, block_indices, interpret=interpret, **kw)
    if impl == "reference":
        kw.pop("query_block")  # the reference reads every row's own selection
    return IMPLEMENTATIONS[impl](q, k, v, block_indices, **kw)


# Every impl of ``select.TABLE['block_sparse']``, by name.
IMPLEMENTATIONS = {
    "pallas": block_sparse_attention_pallas,
    "pallas_tpu": block_sparse_attention_pallas_tpu,
    "xla": block_sparse_attention_xla,
    "xla_gather": block_sparse_attention_xla_gather,
    "reference": block_sparse_attention_reference,
}
