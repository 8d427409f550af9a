"""Which implementation of a kernel op runs: one table per op, one rule for ``impl='auto'``.

``TABLE[op]`` lists every implementation of the op, in the order 'auto' tries them, each with
the backends 'auto' may pick it on and the shape/dtype condition it needs there. ``select_impl(op,
impl, shape, backend)`` returns an explicit ``impl`` as asked (after checking that the op has
it, so a caller can force a kernel and see its error); for 'auto' it returns the first row whose
backends hold ``backend`` and whose condition holds for ``shape``. 'auto' only returns an impl
that lowers on that backend at those shapes (``tests/kernels/test_lowering_kernel.py`` lowers
every choice for ``tpu`` and ``cuda`` from a CPU host). Rows with no backend ('reference',
'xla_gather') run only when asked for by name.

======================  ===========  =======  =================================================
op                      impl         auto on  condition (and what it is)
======================  ===========  =======  =================================================
sliding_window          cudnn        gpu      bf16/fp16, head_dim % 8 == 0 and <= 128
                                              (``jax.nn.dot_product_attention``, cuDNN)
                        pallas       gpu      head_dim a power of two >= 16 (generic Pallas:
                                              Triton on GPU, interpret mode on CPU)
                        xla          all      (blocked XLA: chunked causal / banded; TPU too:
                                              the generic kernel's dynamic K/V slices fail
                                              Mosaic lowering)
                        reference    -        (dense fp32 band mask)
block_sparse            pallas       gpu      head_dim and block_size powers of two (Triton)
                        pallas_tpu   tpu      ``query_block * G`` and ``block_size`` multiples
                                              of 8 (or whole dims), the prefetched selection
                                              in SMEM (scalar-prefetch Mosaic forward)
                        xla          all      (dense masked logits at short sequences, else
                                              gathered blocks: ``block_sparse_xla.uses_dense_form``)
                        xla_gather   -        (gathered blocks at every length)
                        reference    -        (dense fp32 mask)
paged_decode            cpu          cpu      the C++ kernel builds here and no multi-device
                                              mesh is set (it has no SPMD partitioning rule)
                        pallas       gpu      head_dim and page_size powers of two (Triton)
                        pallas_tpu   tpu      block table and lengths fit in SMEM (Mosaic)
                        xla          all      (pages gathered, one batched matmul)
                        reference    -        (fp32, per-token gather)
decode_matmul           cpu          cpu      float32 operands and accumulation, the C++
                                              kernel builds, no multi-device mesh (a one-row
                                              decode's weight matmuls against weights packed
                                              in column panels: ``skinny_matmul_cpu``)
                        xla          all      (the stored weights, ``DTypePolicy.einsum``)
                        reference    -        (packed weights, a jnp matmul)
======================  ===========  =======  =================================================

The model never calls this with its own rule: ``agentrl_jax.model.dispatch`` resolves each op
from the run's per-op choice (``DTypePolicy.kernel_choice``) through :func:`select_impl`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from agentrl_jax.kernels import paged_decode_cpu, skinny_matmul_cpu

# Prefetched scalar tables of the TPU kernels share SMEM (1 MiB per core from TPU v4 on) with
# the kernel's own scalars: keep them to three quarters of it.
TPU_SMEM_TABLE_BYTES = 768 * 1024
ACCELERATORS = ("gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class OpShape:
    """Static facts about one call that decide which kernel can run it.

    Attributes:
      head_dim: H, the per-head dimension (decode_matmul: the contracted size K).
      group: G, query heads per kv head.
      dtype: input (query, or matmul operand) dtype name, e.g. 'bfloat16'.
      seq_len: T (sliding-window, block-sparse).
      batch: B.
      kv_heads: K.
      block_size: key block size (block-sparse).
      query_block: tokens sharing one selection (block-sparse).
      n_sel: selection slots per query group (block-sparse).
      page_size: tokens per page (paged decode).
      max_pages: block-table width (paged decode).
      accum: accumulation dtype name (decode_matmul).
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
    accum: str = "float32"


def current_backend() -> str:
    """The backend the ops compile for: ``jax.default_backend()`` ('cpu', 'gpu' or 'tpu')."""
    return jax.default_backend()


def _pow2(x: int) -> bool:
    return x >= 1 and x & (x - 1) == 0


def triton_tiles_ok(s: OpShape, tile: int | None = None) -> bool:
    """Triton tensors have power-of-two dims; dots need >= 16 in each (``tile``: the block or
    page size, also a power of two)."""
    return _pow2(s.head_dim) and s.head_dim >= 16 and (tile is None or _pow2(tile))


def cudnn_ok(s: OpShape) -> bool:
    """cuDNN flash attention's limits: bf16/fp16 inputs, head_dim a multiple of 8 up to 128."""
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
    devices: the C++ kernels have no SPMD partitioning rule, so XLA would gather a sharded
    operand whole onto every device for them."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def native_paged_decode_ok(s: OpShape | None) -> bool:
    """The C++ paged decode kernel: built here, no multi-device mesh."""
    return paged_decode_cpu.available() and not on_multi_device_mesh()


def native_matmul_ok(s: OpShape | None) -> bool:
    """The C++ skinny matmul: float32 operands and accumulation (``s`` None: not known, so
    not taken), built here, no multi-device mesh."""
    f32 = s is not None and s.dtype == "float32" and s.accum == "float32"
    return f32 and skinny_matmul_cpu.available() and not on_multi_device_mesh()


@dataclasses.dataclass(frozen=True)
class Impl:
    """One row of an op's table.

    Attributes:
      name: the impl's name (``impl=`` of the op).
      backends: where 'auto' may pick it ('cpu', 'gpu', 'tpu'); () = only when asked for.
      ok: ``ok(shape) -> bool``: the shape/dtype condition 'auto' checks (None: always).
      needs_shape: 'auto' needs the call's ``OpShape`` to check ``ok``.
    """

    name: str
    backends: tuple[str, ...] = ()
    ok: Callable[[OpShape | None], bool] | None = None
    needs_shape: bool = True


ALL = ("cpu", "gpu", "tpu")
TABLE: dict[str, tuple[Impl, ...]] = {
    "sliding_window": (
        Impl("cudnn", ("gpu",), cudnn_ok),
        Impl("pallas", ("gpu",), triton_tiles_ok),
        Impl("xla", ALL),
        Impl("reference"),
    ),
    "block_sparse": (
        Impl("pallas", ("gpu",), lambda s: triton_tiles_ok(s, s.block_size)),
        Impl("pallas_tpu", ("tpu",), tpu_block_sparse_ok),
        Impl("xla", ALL),
        Impl("xla_gather"),
        Impl("reference"),
    ),
    "paged_decode": (
        Impl("cpu", ("cpu",), native_paged_decode_ok, needs_shape=False),
        Impl("pallas", ("gpu",), lambda s: triton_tiles_ok(s, s.page_size)),
        Impl("pallas_tpu", ("tpu",), tpu_paged_decode_ok),
        Impl("xla", ALL),
        Impl("reference"),
    ),
    "decode_matmul": (
        Impl("cpu", ("cpu",), native_matmul_ok, needs_shape=False),
        Impl("xla", ALL),
        Impl("reference"),
    ),
}
OPS = tuple(TABLE)
ATTENTION_OPS = ("sliding_window", "block_sparse", "paged_decode")
# Concrete impls each op has ('auto' resolves to one of them).
OP_IMPLS = {op: tuple(row.name for row in rows) for op, rows in TABLE.items()}
IMPLS = ("auto", *dict.fromkeys(name for names in OP_IMPLS.values() for name in names))


def check_impl(op: str, impl: str) -> None:
    """Raises ValueError unless ``op`` is one of ``OPS`` and ``impl`` 'auto' or one of its."""
    if op not in TABLE:
        raise ValueError(f"op={op!r}; allowed: {', '.join(repr(o) for o in OPS)}")
    allowed = ("auto",) + OP_IMPLS[op]
    if impl not in allowed:
        raise ValueError(f"impl={impl!r} for {op}; allowed: {', '.join(repr(i) for i in allowed)}")


def select_impl(
    op: str, impl: str = "auto", shape: OpShape | None = None, backend: str | None = None
) -> str:
    """Resolves ``impl`` for ``op`` on ``backend`` (default: the current one) by ``TABLE``.

    Args:
      op: one of ``OPS``.
      impl: 'auto' or one of ``OP_IMPLS[op]``.
      shape: the call's static facts; required for 'auto' where a row's condition reads them
        (every accelerator row).
      backend: 'cpu', 'gpu' or 'tpu'; default ``current_backend()`` (others count as 'cpu').

    Returns:
      A concrete impl of ``OP_IMPLS[op]``.

    Raises:
      ValueError: for an unknown op, an impl the op does not have, or 'auto' without a shape
        where the rule needs one.
    """
    check_impl(op, impl)
    if impl != "auto":
        return impl
    backend = backend or current_backend()
    backend = backend if backend in ACCELERATORS else "cpu"
    for row in TABLE[op]:
        if backend not in row.backends:
            continue
        if row.ok is None:
            return row.name
        if shape is None and row.needs_shape:
            raise ValueError(f"impl='auto' for {op} on {backend} needs the call's OpShape")
        if row.ok(shape):
            return row.name
    raise AssertionError(f"TABLE[{op!r}] has no row for {backend}")  # every op has 'xla'


def dtype_name(x: jax.Array) -> str:
    """The dtype name ``OpShape.dtype`` expects."""
    return jnp.dtype(x.dtype).name
