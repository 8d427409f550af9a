"""Which implementation of an attention op runs: the one rule for ``impl='auto'``.

``select_impl(op, impl, ...)`` maps a requested impl to a concrete one from the op, the backend,
the static shapes and the dtype. 'auto' only returns an impl that lowers on that backend at those
shapes (checked by ``tests/kernels/test_lowering_kernel.py``, which lowers every choice for
``tpu`` and ``cuda`` from a CPU host); an explicit impl is returned as asked (after checking it
exists for the op), so a caller can still force a kernel and see its error.

The rule, per backend:

* ``cpu``: paged decode: 'cpu' (the C++ kernel of ``paged_decode_cpu``, read in place from the
  page pool) when it builds here and no multi-device mesh is set (it has no SPMD partitioning
  rule), else 'xla'; the other ops: 'xla' (Pallas runs there only in interpret mode, which is
  for testing).
* ``gpu``: sliding-window / dense causal attention: 'cudnn' (``jax.nn.dot_product_attention``
  with its sliding-window mask) for bf16/fp16 inputs with head_dim a multiple of 8 up to 128,
  else the Triton kernel ('pallas') where Triton can tile it (head_dim a power of two >= 16),
  else 'xla'. Block-sparse and paged decode: the Triton kernels where they tile (head_dim a
  power of two >= 16; block / page size a power of two), else 'xla'.
* ``tpu``: block-sparse and paged decode: the scalar-prefetch Mosaic kernels ('pallas_tpu')
  when their blocks are legal TPU tiles (multiples of 8 rows or the full dim) and the
  prefetched index tables fit in SMEM, else 'xla'. Sliding-window: 'xla' (the generic Pallas
  kernel slices K/V with dynamic offsets that Mosaic TPU rejects).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from agentrl_jax.kernels import paged_decode_cpu

OPS = ("sliding_window", "block_sparse", "paged_decode")
IMPLS = ("auto", "xla", "pallas", "pallas_tpu", "cudnn", "cpu")
# Concrete impls each op has ('auto' resolves to one of them).
OP_IMPLS = {
    "sliding_window": ("xla", "pallas", "cudnn"),
    "block_sparse": ("xla", "pallas", "pallas_tpu"),
    "paged_decode": ("xla", "pallas", "pallas_tpu", "cpu"),
}
# Prefetched scalar tables of the TPU kernels share SMEM (1 MiB per core from TPU v4 on) with
# the kernel's own scalars: keep them to three quarters of it.
TPU_SMEM_TABLE_BYTES = 768 * 1024


@dataclasses.dataclass(frozen=True)
class OpShape:
    """Static facts about one call that decide which kernel can run it.

    Attributes:
      head_dim: H, the per-head dimension.
      group: G, query heads per kv head.
      dtype: input (query) dtype name, e.g. 'bfloat16'.
      seq_len: T (sliding-window, block-sparse).
      batch: B.
      kv_heads: K.
      block_size: key block size (block-sparse).
      query_block: tokens sharing one selection (block-sparse).
      n_sel: selection slots per query group (block-sparse).
      page_size: tokens per page (paged decode).
      max_pages: block-table width (paged decode).
    """

    head_dim: int
    group: int = 1
    dtype: str = "float32"
    seq_len: int = 0
    batch: int = 1
    kv_heads: int = 1
    block_size: int = 1
    query_block: int = 1
    n_sel: int = 1
    page_size: int = 1
    max_pages: int = 1


def current_backend() -> str:
    """The backend the ops compile for: ``jax.default_backend()`` ('cpu', 'gpu' or 'tpu')."""
    return jax.default_backend()


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def _triton_tiles_ok(op: str, s: OpShape) -> bool:
    """Triton tensors have power-of-two dims; dots need >= 16 in each."""
    if not (_pow2(s.head_dim) and s.head_dim >= 16):
        return False
    if op == "block_sparse":
        return _pow2(s.block_size)
    if op == "paged_decode":
        return _pow2(s.page_size)
    return True


def _cudnn_ok(s: OpShape) -> bool:
    return s.dtype in ("bfloat16", "float16") and s.head_dim % 8 == 0 and s.head_dim <= 128


def tpu_block_sparse_ok(s: OpShape) -> bool:
    """Whether the compiled Mosaic block-sparse kernel can take these shapes.

    The q tile is ``[query_block * G, D]`` of ``[groups * query_block * G, D]`` and the K/V
    block ``[block_size, D]`` of ``[S, D]``: both need a multiple of 8 rows unless they are the
    whole dim; the prefetched selection (``B * K * groups * n_sel`` int32) must fit in SMEM.
    """
    groups = -(-max(s.seq_len, 1) // s.query_block)
    nblk = -(-max(s.seq_len, 1) // s.block_size)
    rows = s.query_block * s.group
    tiles = (rows % 8 == 0 or groups == 1) and (s.block_size % 8 == 0 or nblk == 1)
    table = 4 * s.batch * s.kv_heads * groups * (s.n_sel + 1)
    return tiles and table <= TPU_SMEM_TABLE_BYTES


def tpu_paged_decode_ok(s: OpShape) -> bool:
    """Whether the compiled Mosaic paged-decode kernel's block table (B * max_pages int32) and
    lengths fit in SMEM; its page blocks are whole pages, legal at every size."""
    return 4 * s.batch * (s.max_pages + 1) <= TPU_SMEM_TABLE_BYTES


def on_multi_device_mesh() -> bool:
    """Whether an ambient mesh (``jax.set_mesh``; also while tracing under it) has several
    devices: the C++ kernel has no SPMD partitioning rule, so XLA would gather a sharded page
    pool whole onto every device for it."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def select_impl(
    op: str, impl: str = "auto", shape: OpShape | None = None, backend: str | None = None
) -> str:
    """Resolves ``impl`` for ``op`` on ``backend`` (default: the current one).

    Args:
      op: one of ``OPS``.
      impl: 'auto' or one of ``OP_IMPLS[op]``.
      shape: the call's static facts; required for 'auto' off CPU.
      backend: 'cpu', 'gpu' or 'tpu'; default ``current_backend()``.

    Returns:
      A concrete impl of ``OP_IMPLS[op]``.

    Raises:
      ValueError: for an unknown op, an impl the op does not have, or 'auto' without a shape
        on an accelerator.
    """
    if op not in OP_IMPLS:
        raise ValueError(f"op={op!r}; allowed: {', '.join(repr(o) for o in OPS)}")
    allowed = ("auto",) + OP_IMPLS[op]
    if impl not in allowed:
        raise ValueError(f"impl={impl!r} for {op}; allowed: {', '.join(repr(i) for i in allowed)}")
    if impl != "auto":
        return impl
    backend = backend or current_backend()
    if backend not in ("gpu", "tpu"):
        native = op == "paged_decode" and not on_multi_device_mesh()
        return "cpu" if native and paged_decode_cpu.available() else "xla"
    if shape is None:
        raise ValueError(f"impl='auto' for {op} on {backend} needs the call's OpShape")
    if backend == "gpu":
        if op == "sliding_window" and _cudnn_ok(shape):
            return "cudnn"
        return "pallas" if _triton_tiles_ok(op, shape) else "xla"
    if op == "block_sparse" and tpu_block_sparse_ok(shape):
        return "pallas_tpu"
    if op == "paged_decode" and tpu_paged_decode_ok(shape):
        return "pallas_tpu"
    return "xla"


def dtype_name(x: jax.Array) -> str:
    """The dtype name ``OpShape.dtype`` expects."""
    return jnp.dtype(x.dtype).name
