"""A matmul of a few rows against a packed weight on the CPU backend: a C++ kernel
(``skinny_matmul_cpu.cc``) called through the XLA FFI.

At one row per sequence a decode step's weight matmuls are [B, K] x [K, N] with B of 1-32: a
stream over the weight, which the step reads whole every step. XLA's CPU matmul streams a
[K, N] weight at about 16 GB/s on the 2-core development CPU, one core, while a plain sum over
memory reads at 30-50 GB/s (``benchmarks/decode_profile.py``, the memory floor). ``pack`` lays
the weight out once as column panels [ceil(N / P), K, P] (``PANEL`` columns each, zero-padded),
so each panel is one contiguous run; the kernel reads each panel once for all rows, prefetching
ahead, with the panels spread over XLA's intra-op threads.

``skinny_matmul(x [..., K] f32, packed, n) -> [..., n] f32`` (or x [G, M, K] against G packed
weights [G, Np, K, P]: a MoE layer's experts); ``skinny_matmul_reference`` is the same product in
jnp. Products are float32 sums over k in order (with fused multiply-adds), so
they differ from XLA's matmul in the last bits, not more. The kernel is built on first use
(``native``); :func:`available` says whether it is, :func:`unavailable_reason` why not. It has
no SPMD partitioning rule and no gradient: the one-row decode's fast path calls it
(``decode_params.pack_weights``), only on the CPU backend, not on a multi-device mesh.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from agentrl_jax.kernels import native

SOURCE = Path(__file__).with_name("skinny_matmul_cpu.cc")
TARGET = "agentrl_skinny_matmul_cpu"
SYMBOL = "AgentrlSkinnyMatmulCpu"
PANEL = 32  # kPanel of the source
# fused multiply-adds: -std=c++17 alone turns contraction off
FLAGS = (*native.FLAGS, "-ffp-contract=fast")


def _build(compiler: str) -> Path:
    """The built library's path, compiling it unless the cache holds it (``native.build``)."""
    return native.build(compiler, SOURCE, FLAGS)


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


def pack(w: jax.Array) -> jax.Array:
    """A [..., K, N] weight as column panels [..., ceil(N / PANEL), K, PANEL], zero-padded past
    N (leading axes kept): panel p holds columns p * PANEL .. p * PANEL + PANEL - 1, row after
    row."""
    if w.ndim < 2:
        raise ValueError(f"pack takes a [..., K, N] weight; got shape {w.shape}")
    *lead, k, n = w.shape
    panels = -(-n // PANEL)
    w = jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, panels * PANEL - n)])
    return jnp.swapaxes(w.reshape(*lead, k, panels, PANEL), -3, -2)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """The [..., K, n] weight ``pack`` laid out as ``packed``."""
    *lead, panels, k, p = packed.shape
    return jnp.swapaxes(packed, -3, -2).reshape(*lead, k, panels * p)[..., :n]


def _check(x: jax.Array, packed: jax.Array, n: int) -> None:
    grouped = packed.ndim == 4
    if (
        packed.ndim not in (3, 4)
        or packed.shape[-1] != PANEL
        or x.shape[-1:] != packed.shape[-2:-1]
        or (grouped and (x.ndim != 3 or x.shape[0] != packed.shape[0]))
    ):
        raise ValueError(f"x must be [..., K] and packed [Np, K, {PANEL}], or x [G, M, K] and "
                         f"packed [G, Np, K, {PANEL}] (``pack``); got {x.shape=} "
                         f"{packed.shape=}")  # fmt: skip
    panels = packed.shape[-3]
    if not (panels - 1) * PANEL < n <= panels * PANEL:
        raise ValueError(f"n={n} columns do not fill {panels} panels of {PANEL}")


def skinny_matmul_reference(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """``x @ unpack(packed, n)`` in float32 (jnp, HIGHEST precision): [..., K] rows against one
    weight, or [G, M, K] against G weights."""
    _check(x, packed, n)
    w = unpack(packed, n).astype(jnp.float32)
    return jnp.matmul(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


def skinny_matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """``x @ W`` for ``packed = pack(W)``, float32, through the C++ kernel: x [..., K] against
    one weight W [K, n] (packed [Np, K, P]) -> [..., n], or x [G, M, K] against G weights
    W [G, K, n] (packed [G, Np, K, P], a MoE layer's experts) -> [G, M, n].

    Raises:
      RuntimeError: the kernel is not available (the reason: no compiler, a failed build).
      ValueError: inconsistent shapes, or dtypes other than float32.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"skinny_matmul: the C++ kernel is unavailable: {reason}")
    _check(x, packed, n)
    if x.dtype != jnp.float32 or packed.dtype != jnp.float32:
        raise ValueError(f"skinny_matmul takes float32; got {x.dtype=} {packed.dtype=}")
    if packed.ndim == 4:
        rows, panels = x, packed
    else:
        rows, panels = x.reshape(1, -1, x.shape[-1]), packed[None]
    out = jax.ShapeDtypeStruct((*rows.shape[:2], n), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(rows, panels)
    return y if packed.ndim == 4 else y.reshape(*x.shape[:-1], n)
