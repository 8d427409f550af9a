"""The pallas_tpu kernels lower to Mosaic TPU (checked on CPU: lowering, not compiling).

jit(...).trace(...).lower(lowering_platforms=('tpu',)) runs the Pallas -> Mosaic lowering
without a TPU: the block-shape rules (last two block dims multiples of (8, 128) or the full
dims), the scalar-prefetch index maps and every op's Mosaic lowering rule are checked. Mosaic's
own compiler passes (layout inference, VMEM budget) run only in libtpu on a real TPU. The
device kind the lowering asks for is patched to a TPU v5e (private JAX API: skipped if moved).
"""

import jax
import jax.numpy as jnp
import pytest
from agentrl_jax.kernels import attention_math, block_sparse_tpu, paged_decode_tpu

tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
if not hasattr(tpu_info, "get_device_kind") or not hasattr(tpu_info, "get_num_device_cores"):
    pytest.skip("jax moved the TPU device-kind lookup", allow_module_level=True)


@pytest.fixture(autouse=True)
def _as_if_on_tpu(monkeypatch):
    monkeypatch.setattr(attention_math.jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5e")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    yield
    if hasattr(tpu_info.get_tpu_info, "cache_clear"):
        tpu_info.get_tpu_info.cache_clear()


def _lowers(f, *args):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("int8", [False, True])
def test_paged_decode_lowers(int8):
    dtype = jnp.int8 if int8 else jnp.bfloat16
    pages = jax.ShapeDtypeStruct((64, 16, 8, 128), dtype)  # Hkv = 8, page_size 16
    sc = dict(k_scales=jnp.ones((64, 8)), v_scales=jnp.ones((64, 8))) if int8 else {}
    tables, lengths = jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32)
    f = lambda q, kp, vp: paged_decode_tpu.paged_decode_attention_pallas_tpu(
        q,
        kp,
        vp,
        tables,
        lengths,
        window=40,
        block_sizes=paged_decode_tpu.BlockSizes(pages_per_block=2),
        **sc,
    )
    _lowers(f, jax.ShapeDtypeStruct((4, 32, 128), jnp.bfloat16), pages, pages)


def test_paged_decode_vmapped_over_kv_heads_lowers():
    """As the rollout's sparse decode calls it: per-head pages, tables and lengths."""
    pages = jax.ShapeDtypeStruct((64, 16, 4, 128), jnp.bfloat16)
    tables, lengths = jnp.zeros((2, 4, 8), jnp.int32), jnp.ones((2, 4), jnp.int32)

    def f(q, kp, vp):
        one = lambda q, k, v, t, n: paged_decode_tpu.paged_decode_attention_pallas_tpu(
            q, k[:, :, None], v[:, :, None], t, n
        )
        return jax.vmap(one, in_axes=(1, 2, 2, 1, 1), out_axes=1)(q, kp, vp, tables, lengths)

    _lowers(f, jax.ShapeDtypeStruct((2, 4, 8, 128), jnp.bfloat16), pages, pages)


@pytest.mark.parametrize("query_block", [2, 8])
def test_block_sparse_lowers_with_gradient(query_block):
    q = jax.ShapeDtypeStruct((1, 512, 16, 128), jnp.bfloat16)  # G = 4: rows 8 or 32
    kv = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    idx = jnp.zeros((1, 512, 4, 3), jnp.int32)

    def f(q, k, v):
        out = block_sparse_tpu.block_sparse_attention_pallas_tpu(
            q, k, v, idx, block_size=128, query_block=query_block
        )
        return out.astype(jnp.float32).sum()

    _lowers(jax.grad(f, argnums=(0, 1, 2)), q, kv, kv)


def test_block_sparse_rejects_tiles_tpu_cannot_block():
    q = jnp.zeros((1, 32, 4, 128), jnp.bfloat16)
    kv = jnp.zeros((1, 32, 2, 128), jnp.bfloat16)
    idx = jnp.zeros((1, 32, 2, 2), jnp.int32)
    f = block_sparse_tpu.block_sparse_attention_pallas_tpu
    with pytest.raises(ValueError, match="query_block"):
        f(q, kv, kv, idx, block_size=8, query_block=1)  # 1 token x G=2 rows
    with pytest.raises(ValueError, match="block_size=4"):
        f(q, kv, kv, idx, block_size=4, query_block=4)


def test_block_sparse_auto_picks_tpu_kernel_only_for_tileable_shapes():
    from agentrl_jax.kernels import block_sparse_attention

    idx = jnp.zeros((1, 256, 2, 2), jnp.int32)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    for query_block, want_kernel in [(8, True), (1, False)]:  # rows = 8 * G = 32 vs G = 4
        f = lambda q, k, v, qb=query_block: block_sparse_attention(
            q, k, v, idx, block_size=64, query_block=qb
        )
        q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
        text = jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
        assert ("tpu_custom_call" in text) == want_kernel
