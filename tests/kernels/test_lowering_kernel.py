"""Every kernel the model can select lowers for TPU (Mosaic) and CUDA, checked from a CPU host.

``jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`` runs the Pallas lowering
without the device: for ``tpu`` the Pallas -> Mosaic lowering (block-shape rules, scalar
prefetch index maps, every op's Mosaic rule; Mosaic's own passes run only in libtpu), for
``cuda`` the Pallas -> Triton IR lowering (Triton's compile to PTX runs on the GPU host) and
the cuDNN attention custom call. Nothing is compiled. Shapes are the model's: T 2048, head_dim
128, bf16, GQA 4:1, window 512, 8-token sparse blocks, 16-token pages.

The backend the kernels see is patched (``jax.default_backend``); for ``tpu`` the device kind
the lowering asks for is patched to a TPU v5e, for cuDNN the cuDNN version / compute
capability checks to cuDNN 9.10 on a Hopper GPU (private JAX APIs: skipped with the reason if
they moved).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from agentrl_jax.kernels import sliding_window_pallas

from agentrl_jax import kernels

T, H, NQ, NKV, WINDOW, BS, N_SEL = 2048, 128, 16, 4, 512, 8, 64
Q = jax.ShapeDtypeStruct((1, T, NQ, H), jnp.bfloat16)
KV = jax.ShapeDtypeStruct((1, T, NKV, H), jnp.bfloat16)
IDX = jnp.zeros((1, T, NKV, N_SEL), jnp.int32)
B_DEC, PAGE, MAX_PAGES, POOL = 8, 16, 128, 1024


@pytest.fixture(params=["tpu", "cuda"])
def platform(request, monkeypatch):
    backend = "tpu" if request.param == "tpu" else "gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    if backend == "tpu":
        info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
        if not hasattr(info, "get_device_kind") or not hasattr(info, "get_num_device_cores"):
            pytest.skip("jax moved the TPU device-kind lookup (jax._src.pallas.mosaic.tpu_info)")
        monkeypatch.setattr(info, "get_device_kind", lambda: "TPU v5e")
        monkeypatch.setattr(info, "get_num_device_cores", lambda: 1)
        if hasattr(info.get_tpu_info, "cache_clear"):
            info.get_tpu_info.cache_clear()
    else:
        pytest.importorskip("jax.experimental.pallas.triton", reason="no Triton lowering")
        fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
        names = ("check_cudnn_version", "check_compute_capability")
        if not all(hasattr(fa, n) for n in names + ("is_cuda_compute_capability_equal",)):
            pytest.skip("jax moved the cuDNN version checks (jax._src.cudnn)")
        monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
        monkeypatch.setattr(fa, "check_compute_capability", lambda cap: True)
        monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda cap: False)
    jax.clear_caches()  # no trace cached for another backend's choice
    yield request.param
    jax.clear_caches()


def _lower(platform, f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _calls(text):
    """Custom calls in the lowered module: the kernels that made it in."""
    return set(re.findall(r"custom_call @([\w$.]+)", text))


def _grad(f):
    return jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


KERNEL = {"pallas": ("triton", "tpu_custom_call"), "pallas_tpu": ("tpu_custom_call",)}
KERNEL["cudnn"] = ("cudnn",)


def _check(platform, impl, text):
    calls = " ".join(_calls(text))
    if impl == "xla":
        assert "triton" not in calls and "tpu_custom_call" not in calls and "cudnn" not in calls
    else:
        assert any(name in calls for name in KERNEL[impl]), calls


@pytest.mark.parametrize("window", [WINDOW, T], ids=["swa", "dense"])
def test_sliding_window_auto(platform, window):
    """The model's S (window 512) and D (window >= T) layers, forward and backward."""
    shape = kernels.sliding_window.op_shape(jnp.zeros(Q.shape, Q.dtype), jnp.zeros(KV.shape))
    impl = kernels.select_impl("sliding_window", "auto", shape)
    assert impl == {"tpu": "xla", "cuda": "cudnn"}[platform]
    f = lambda q, k, v: kernels.sliding_window_attention(q, k, v, window=window)
    _check(platform, impl, _lower(platform, f, Q, KV, KV))
    _check(platform, impl, _lower(platform, _grad(f), Q, KV, KV))


@pytest.mark.parametrize("window", [WINDOW, T], ids=["swa", "dense"])
def test_sliding_window_triton(platform, window):
    """The Triton kernels (what 'auto' takes on GPU where cuDNN does not apply); on TPU the
    generic kernel fails Mosaic lowering, which is why the rule sends TPU to XLA."""
    f = lambda q, k, v: sliding_window_pallas.sliding_window_attention_pallas(
        q, k, v, window=window
    )
    if platform == "tpu":
        with pytest.raises(Exception):  # noqa: B017 - any Mosaic lowering error
            _lower(platform, f, Q, KV, KV)
        return
    _check(platform, "pallas", _lower(platform, f, Q, KV, KV))
    _check(platform, "pallas", _lower(platform, _grad(f), Q, KV, KV))


@pytest.mark.parametrize("query_block", [1, 8])
def test_block_sparse_auto(platform, query_block):
    """The model's F layers (per-token selection, query_block 1) and a shared selection per
    8 tokens, forward and backward."""
    f = lambda q, k, v: kernels.block_sparse_attention(
        q, k, v, IDX, block_size=BS, query_block=query_block
    )
    shape = kernels.block_sparse.op_shape(jnp.zeros(Q.shape, Q.dtype), KV, IDX, BS, query_block)
    impl = kernels.select_impl("block_sparse", "auto", shape)
    want = {("tpu", 1): "xla", ("tpu", 8): "pallas_tpu"}.get((platform, query_block), "pallas")
    assert impl == want
    _check(platform, impl, _lower(platform, f, Q, KV, KV))
    _check(platform, impl, _lower(platform, _grad(f), Q, KV, KV))


def _pages(dtype):
    return jax.ShapeDtypeStruct((POOL, PAGE, NKV, H), dtype)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_paged_decode_auto(platform, int8, window):
    dtype = jnp.int8 if int8 else jnp.bfloat16
    scales = dict(k_scales=jnp.ones((POOL, NKV)), v_scales=jnp.ones((POOL, NKV))) if int8 else {}
    tables = jnp.zeros((B_DEC, MAX_PAGES), jnp.int32)
    lengths = jnp.ones((B_DEC,), jnp.int32)
    f = lambda q, kp, vp: kernels.paged_decode_attention(
        q, kp, vp, tables, lengths, window=window, **scales
    )
    q = jax.ShapeDtypeStruct((B_DEC, NQ, H), jnp.bfloat16)
    impl = {"tpu": "pallas_tpu", "cuda": "pallas"}[platform]
    _check(platform, impl, _lower(platform, f, q, _pages(dtype), _pages(dtype)))


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_paged_decode_kv_mask_and_lse(platform, int8):
    """The per-token key mask and the log-sum-exp output (a float-pool or int8-pool call of
    the rollout's two-pool decode), windowed."""
    dtype = jnp.int8 if int8 else jnp.bfloat16
    scales = dict(k_scales=jnp.ones((POOL, NKV)), v_scales=jnp.ones((POOL, NKV))) if int8 else {}
    tables = jnp.zeros((B_DEC, MAX_PAGES), jnp.int32)
    lengths = jnp.ones((B_DEC,), jnp.int32)
    mask = jnp.ones((B_DEC, MAX_PAGES * PAGE), bool)
    f = lambda q, kp, vp: kernels.paged_decode_attention(
        q, kp, vp, tables, lengths, window=WINDOW, kv_mask=mask, return_lse=True, **scales
    )
    q = jax.ShapeDtypeStruct((B_DEC, NQ, H), jnp.bfloat16)
    impl = {"tpu": "pallas_tpu", "cuda": "pallas"}[platform]
    _check(platform, impl, _lower(platform, f, q, _pages(dtype), _pages(dtype)))


def test_paged_decode_vmapped_over_kv_heads(platform):
    """As the rollout's sparse decode calls it: per-head pools of 8-token blocks, tables and
    lengths (pages of one kv head each)."""
    pool = jax.ShapeDtypeStruct((POOL * 2, BS, NKV, H), jnp.bfloat16)
    tables = jnp.zeros((B_DEC, NKV, N_SEL), jnp.int32)
    lengths = jnp.ones((B_DEC, NKV), jnp.int32)

    def f(q, kp, vp):
        one = lambda q, k, v, t, n: kernels.paged_decode_attention(
            q, k[:, :, None], v[:, :, None], t, n
        )
        return jax.vmap(one, in_axes=(1, 2, 2, 1, 1), out_axes=1)(q, kp, vp, tables, lengths)

    q = jax.ShapeDtypeStruct((B_DEC, NKV, NQ // NKV, H), jnp.bfloat16)
    impl = {"tpu": "pallas_tpu", "cuda": "pallas"}[platform]
    _check(platform, impl, _lower(platform, f, q, pool, pool))
