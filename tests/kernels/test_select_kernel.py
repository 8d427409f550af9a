"""select_impl: the rule behind impl='auto', per op, backend, shapes and dtype."""

import pytest
from agentrl_jax.kernels import OP_IMPLS, OpShape, paged_decode_cpu, select_impl

BF16 = dict(head_dim=128, group=4, dtype="bfloat16", seq_len=2048, batch=1, kv_heads=4)


def test_cpu_is_xla_but_paged_decode_and_explicit_impls_pass_through():
    for op in OP_IMPLS:
        native = op == "paged_decode" and paged_decode_cpu.available()  # the C++ kernel
        assert select_impl(op, "auto", backend="cpu") == ("cpu" if native else "xla")
        for impl in OP_IMPLS[op]:
            assert select_impl(op, impl, backend="tpu") == impl  # explicit: as asked


def test_unknown_op_or_impl_raises():
    with pytest.raises(ValueError, match="op='conv'"):
        select_impl("conv")
    with pytest.raises(ValueError, match="impl='pallas_tpu' for sliding_window"):
        select_impl("sliding_window", "pallas_tpu")
    with pytest.raises(ValueError, match="impl='cudnn' for paged_decode"):
        select_impl("paged_decode", "cudnn")
    with pytest.raises(ValueError, match="needs the call's OpShape"):
        select_impl("block_sparse", "auto", backend="gpu")


def test_gpu_sliding_window():
    assert select_impl("sliding_window", shape=OpShape(**BF16), backend="gpu") == "cudnn"
    f32 = OpShape(**{**BF16, "dtype": "float32"})
    assert select_impl("sliding_window", shape=f32, backend="gpu") == "pallas"  # Triton
    odd = OpShape(**{**BF16, "dtype": "float32", "head_dim": 96})  # not a Triton tile
    assert select_impl("sliding_window", shape=odd, backend="gpu") == "xla"
    wide = OpShape(**{**BF16, "head_dim": 256})  # beyond cuDNN's 128, a Triton tile
    assert select_impl("sliding_window", shape=wide, backend="gpu") == "pallas"


def test_tpu_sliding_window_never_takes_the_generic_kernel():
    for h in (64, 128, 256):
        for t in (512, 1024, 2048):
            shape = OpShape(**{**BF16, "head_dim": h, "seq_len": t})
            assert select_impl("sliding_window", shape=shape, backend="tpu") == "xla"


@pytest.mark.parametrize(
    "qb,bs,backend,want",
    [
        (1, 8, "gpu", "pallas"),
        (1, 12, "gpu", "xla"),  # a 12-token block is no Triton tile
        (8, 8, "tpu", "pallas_tpu"),  # 8 tokens x G=4 = 32 rows
        (1, 8, "tpu", "xla"),  # 4 rows: not a TPU tile
        (8, 4, "tpu", "xla"),  # 4-row key blocks
    ],
)
def test_block_sparse(qb, bs, backend, want):
    shape = OpShape(**BF16, block_size=bs, query_block=qb, n_sel=64)
    assert select_impl("block_sparse", shape=shape, backend=backend) == want


def test_tpu_block_sparse_selection_must_fit_smem():
    # 8 x 4 heads x 4096 groups x 65 int32 = 34 MB of prefetched selection: not in SMEM.
    shape = OpShape(**{**BF16, "batch": 8, "seq_len": 32768}, block_size=8, query_block=8, n_sel=64)
    assert select_impl("block_sparse", shape=shape, backend="tpu") == "xla"


@pytest.mark.parametrize(
    "page,batch,max_pages,backend,want",
    [
        (16, 64, 2048, "gpu", "pallas"),
        (12, 64, 2048, "gpu", "xla"),
        (16, 64, 2048, "tpu", "pallas_tpu"),  # 512 KiB block table
        (16, 64, 4096, "tpu", "xla"),  # 1 MiB block table: split the batch
    ],
)
def test_paged_decode(page, batch, max_pages, backend, want):
    shape = OpShape(head_dim=128, group=4, dtype="bfloat16", batch=batch, kv_heads=8)
    shape = OpShape(**{**shape.__dict__, "page_size": page, "max_pages": max_pages})
    assert select_impl("paged_decode", shape=shape, backend=backend) == want
