"""Paged decode attention on the CPU backend: a C++ kernel (``paged_decode_cpu.cc``) called
through the XLA FFI.

The XLA path gathers a call's pages into a dense copy and then multiplies it; on CPU the gather
is an element loop that costs about as much as the attention, and the copy is read again. This
kernel reads each key and value row in place from the page pool: per (sequence, kv head) one
pass scores the visible keys, a second adds up the probability-weighted values (float32
arithmetic for float32, bfloat16 and int8 pages), with the next pages prefetched and the rows
spread over XLA's intra-op threads. It also takes a block table per kv head (``block_tables``
[B, K, J]), so sparse attention whose heads select different blocks is one call, not one per
head.

Built on first use (``native``: the C++ compiler, a cache folder keyed by the source, flags,
compiler, jaxlib and CPU). Without a compiler (or with ``AGENTRL_NATIVE_KERNELS=0``)
:func:`available` is false and ``impl='auto'`` keeps the XLA path; asking for ``impl='cpu'``
then raises with the reason.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from agentrl_jax.kernels import native

SOURCE = Path(__file__).with_name("paged_decode_cpu.cc")
TARGET = "agentrl_paged_decode_cpu"
SYMBOL = "AgentrlPagedDecodeCpu"
PAGE_DTYPES = ("float32", "bfloat16", "int8")
MAX_GROUP, MAX_HEAD_DIM = 64, 512  # kMaxGroup, kMaxHeadDim of the source


def _build(compiler: str) -> Path:
    """The built library's path, compiling it unless the cache holds it (``native.build``)."""
    return native.build(compiler, SOURCE)


@functools.cache
def _load() -> str | None:
    """Builds (or finds) and registers the kernel once per process; the reason it is
    unavailable, or None."""
    return native.load(SOURCE, TARGET, SYMBOL, _build)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or None."""
    return _load()


def _per_head(x: jax.Array, rank: int, name: str, want: tuple[int, ...], kv_heads: int):
    """``x`` shared by every kv head (rank ``rank``) or given per kv head (one more dim of
    size K after the batch), as [B, K or 1, ...]."""
    if x.ndim == rank:
        x = x[:, None]
    if (
        x.ndim != rank + 1
        or x.shape[1] not in (1, kv_heads)
        or x.shape[2:] != want[1:]
        or (x.shape[0] != want[0])
    ):
        per = (want[0], kv_heads, *want[1:])
        raise ValueError(f"{name} must be {list(want)} or per kv head {list(per)}; got {x.shape}")
    return x


def paged_decode_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    kv_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The C++ kernel; arguments and results as ``paged_decode_attention_reference``, and:

    Args:
      block_tables: int32 [B, J], or [B, K, J]: a table per kv head.
      lengths: int32 [B], or [B, K]: per kv head (keys of that head's table).
      kv_mask: optional bool [B, J * page_size], or [B, K, J * page_size].

    Raises:
      RuntimeError: the kernel is not available (the reason: no compiler, a failed build).
      ValueError: on inconsistent shapes or dtypes.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"impl='cpu' (paged decode): the C++ kernel is unavailable: {reason}")
    if q.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"q must be [B, Hq, D], pages [P, page_size, Hkv, D]; got {q.shape=} "
                         f"{k_pages.shape=} {v_pages.shape=}")  # fmt: skip
    b, n, h = q.shape
    p, ps, kh, hd = k_pages.shape
    dtype = jnp.dtype(k_pages.dtype).name
    if (
        hd != h
        or n % kh
        or dtype not in PAGE_DTYPES
        or v_pages.dtype != k_pages.dtype
        or (n // kh > MAX_GROUP or h > MAX_HEAD_DIM)
    ):
        raise ValueError(f"impl='cpu' needs head dims equal (<= {MAX_HEAD_DIM}), Hq a "
                         f"multiple of Hkv (<= {MAX_GROUP} times) and pages of one of "
                         f"{PAGE_DTYPES}; got {q.shape=} {k_pages.shape=} {k_pages.dtype=} "
                         f"{v_pages.dtype=}")  # fmt: skip
    if window is not None and window < 1:
        raise ValueError(f"{window=} must be None or an int >= 1")
    j = block_tables.shape[-1]
    tables = _per_head(block_tables, 2, "block_tables", (b, j), kh).astype(jnp.int32)
    lens = _per_head(lengths, 1, "lengths", (b,), kh)
    if (dtype == "int8") != (k_scales is not None and v_scales is not None):
        raise ValueError("int8 pages need k_scales and v_scales [P, Hkv]; float pages none")
    if dtype == "int8":
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s.shape != (p, kh):
                raise ValueError(f"{name} must be [P={p}, Hkv={kh}]; got {s.shape}")
        scales = (k_scales.astype(jnp.float32), v_scales.astype(jnp.float32))
    else:
        scales = (jnp.zeros((1, 1), jnp.float32),) * 2
    if kv_mask is None:
        mask = jnp.zeros((1, 1, 1), jnp.bool_)
    else:
        mask = _per_head(kv_mask, 2, "kv_mask", (b, j * ps), kh)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"kv_mask must be bool; got {kv_mask.dtype}")
    scale = 1.0 / float(np.sqrt(h)) if softmax_scale is None else float(softmax_scale)
    f32 = jnp.float32
    shapes = (jax.ShapeDtypeStruct((b, n, h), f32), jax.ShapeDtypeStruct((b, n), f32))
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential")
    out, lse = call(
        q.astype(jnp.float32), k_pages, v_pages, *scales, tables, lens.astype(jnp.int32), mask,
        scale=np.float32(scale), window=np.int64(window or 0), use_mask=kv_mask is not None,
    )  # fmt: skip
    return (out, lse) if return_lse else out.astype(q.dtype)
