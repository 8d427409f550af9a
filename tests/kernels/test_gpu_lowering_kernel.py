"""The Pallas kernels lower for CUDA through Triton (checked on CPU: lowering, not compiling).

jit(...).trace(...).lower(lowering_platforms=('cuda',)) builds the Triton IR without a GPU, so
a kernel that uses something the GPU lowering rejects fails here. The GPU-only choices (Triton
compiler params, power-of-two group padding) are switched on by patching the backend check.
"""

import jax
import jax.numpy as jnp
import pytest
from agentrl_jax.kernels import (
    attention_math,
    block_sparse_pallas,
    paged_decode_pallas,
    sliding_window_pallas,
)

pltriton = pytest.importorskip("jax.experimental.pallas.triton")


@pytest.fixture(autouse=True)
def _as_if_on_gpu(monkeypatch):
    monkeypatch.setattr(attention_math.jax, "default_backend", lambda: "gpu")
    yield


def _lowers(f, *args):
    # Lowering alone (no compile); interpret=False so the GPU path is taken.
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def _grad(f):
    return jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


Q = jax.ShapeDtypeStruct((1, 96, 12, 64), jnp.bfloat16)  # G = 6: padded to 8 on GPU
KV = jax.ShapeDtypeStruct((1, 96, 2, 64), jnp.bfloat16)


def test_sliding_window_lowers_with_gradient():
    f = lambda q, k, v: sliding_window_pallas.sliding_window_attention_pallas(q, k, v, window=40)
    _lowers(_grad(f), Q, KV, KV)


@pytest.mark.parametrize("query_block", [1, 32])
def test_block_sparse_lowers_with_gradient(query_block):
    idx = jnp.zeros((1, 96, 2, 3), jnp.int32)
    f = lambda q, k, v: block_sparse_pallas.block_sparse_attention_pallas(
        q, k, v, idx, block_size=32, query_block=query_block
    )
    _lowers(_grad(f), Q, KV, KV)


def test_paged_decode_int8_lowers():
    pages = jax.ShapeDtypeStruct((16, 16, 2, 64), jnp.int8)
    scales = jnp.ones((16, 2), jnp.float32)
    tables, lengths = jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32)
    f = lambda q, kp, vp: paged_decode_pallas.paged_decode_attention_pallas(
        q,
        kp,
        vp,
        tables,
        lengths,
        window=20,
        k_scales=scales,
        v_scales=scales,
        block_sizes=paged_decode_pallas.BlockSizes(pages_per_block=2),
    )
    _lowers(f, jax.ShapeDtypeStruct((4, 12, 64), jnp.bfloat16), pages, pages)
