"""Attention kernels (installed as ``agentrl_jax.kernels``).

Each op has a pure-jnp ``*_reference``, a blocked XLA implementation and Pallas kernels, chosen
with ``impl='auto'|'xla'|'pallas'|...``; ``select.TABLE`` lists every op's implementations and
``select.select_impl`` is the one rule behind 'auto' (per op, backend, shapes and dtype; it
never picks a kernel that does not lower there). All of
them compute the softmax and accumulate in float32 whatever the input dtype, and return zeros
for a query row that sees no key. This package imports only jax/numpy. paged_decode_attention
also takes a per-token key mask and can return the log-sum-exp, so calls over disjoint key sets
(a float and an int8 page pool) merge exactly (``combine_attention``); ``compact_pages`` gives
each such call a table of only the pages it has keys in.

The 'pallas' kernels are generic Pallas: ``interpret=True`` runs them on CPU; on GPU they select
the Triton lowering (power-of-two tiles). paged_decode_attention and block_sparse_attention also
have ``impl='pallas_tpu'`` (``paged_decode_tpu``, ``block_sparse_tpu``): Mosaic TPU kernels whose
BlockSpec index maps read scalar-prefetched block tables / block selections, so the pipeline
DMAs only the pages / key blocks used. On CPU they run with ``interpret=True`` or
``interpret=pltpu.InterpretParams()`` (TPU semantics); compiled, they need a TPU backend.
paged_decode_attention also has ``impl='cpu'`` (``paged_decode_cpu``): a C++ kernel through the
XLA FFI, built on first use, that reads the pages in place on the CPU backend (and takes a block
table per kv head). ``skinny_matmul_cpu`` is the one non-attention kernel: a C++ matmul of a
few rows against a weight packed in column panels, which the one-row decode's weight matmuls
use on the CPU backend (op ``decode_matmul``, reached through ``decode_matmul.packed_matmul``;
built the same way, ``native``). sliding_window_attention also has
``impl='cudnn'`` (GPU: ``jax.nn.dot_product_attention`` with its sliding-window mask).
"""

from agentrl_jax.kernels.block_sparse import (
    block_sparse_attention,
    block_sparse_attention_reference,
    block_sparse_attention_xla,
    normalize_block_indices,
)
from agentrl_jax.kernels.decode_matmul import pack as pack_weight
from agentrl_jax.kernels.decode_matmul import packed_matmul
from agentrl_jax.kernels.paged_decode import (
    combine_attention,
    compact_pages,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_xla,
)
from agentrl_jax.kernels.paged_decode import op_shape as paged_decode_op_shape
from agentrl_jax.kernels.paged_decode_cpu import paged_decode_attention_cpu
from agentrl_jax.kernels.select import (
    ATTENTION_OPS,
    IMPLS,
    OP_IMPLS,
    OPS,
    TABLE,
    OpShape,
    check_impl,
    on_multi_device_mesh,
    select_impl,
)
from agentrl_jax.kernels.sliding_window import (
    sliding_window_attention,
    sliding_window_attention_reference,
    sliding_window_attention_xla,
)

__all__ = [
    "ATTENTION_OPS",
    "IMPLS",
    "OPS",
    "OP_IMPLS",
    "OpShape",
    "TABLE",
    "block_sparse_attention",
    "block_sparse_attention_reference",
    "block_sparse_attention_xla",
    "check_impl",
    "combine_attention",
    "compact_pages",
    "normalize_block_indices",
    "on_multi_device_mesh",
    "paged_decode_attention",
    "paged_decode_attention_cpu",
    "paged_decode_attention_reference",
    "paged_decode_attention_xla",
    "paged_decode_op_shape",
    "pack_weight",
    "packed_matmul",
    "select_impl",
    "sliding_window_attention",
    "sliding_window_attention_reference",
    "sliding_window_attention_xla",
]
