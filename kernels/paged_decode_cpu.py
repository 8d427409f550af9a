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

Built on first use with the C++ compiler (``$CXX``, default ``c++``) against the FFI headers of
the installed jaxlib, ``-O3 -march=native``, into a cache folder
(``$AGENTRL_KERNEL_CACHE``, default ``$XDG_CACHE_HOME/agentrl_jax/kernels`` or
``~/.cache/agentrl_jax/kernels``) under a name keyed by the source, the flags, the compiler,
jaxlib and the CPU's feature flags; later processes load the built library. Without a compiler
(or with ``AGENTRL_NATIVE_KERNELS=0``) :func:`available` is false and ``impl='auto'`` keeps the
XLA path; asking for ``impl='cpu'`` then raises with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCE = Path(__file__).with_name("paged_decode_cpu.cc")
TARGET = "agentrl_paged_decode_cpu"
SYMBOL = "AgentrlPagedDecodeCpu"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared",
         "-fPIC")  # fmt: skip
PAGE_DTYPES = ("float32", "bfloat16", "int8")
MAX_GROUP, MAX_HEAD_DIM = 64, 512  # kMaxGroup, kMaxHeadDim of the source


def cache_dir() -> Path:
    """Where built kernels are kept (module docstring)."""
    if os.environ.get("AGENTRL_KERNEL_CACHE"):
        return Path(os.environ["AGENTRL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "agentrl_jax" / "kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """The built library's path, compiling it unless the cache holds it."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    include = jax.ffi.include_dir()
    key = hashlib.sha256(
        "\n".join(
            [
                SOURCE.read_text(),
                " ".join(FLAGS),
                version,
                include,
                jaxlib.__version__,
                _cpu_features(),
            ]
        ).encode()  # fmt: skip
    ).hexdigest()[:16]
    folder = cache_dir()
    lib = folder / f"libpaged_decode_cpu-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)  # renamed into place: concurrent
    os.close(fd)  # builds (test workers) never load a half-written file
    try:
        cmd = [compiler, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


@functools.cache
def _load() -> str | None:
    """Builds (or finds) and registers the kernel once per process; the reason it is
    unavailable, or None."""
    if os.environ.get("AGENTRL_NATIVE_KERNELS", "1") == "0":
        return "disabled by AGENTRL_NATIVE_KERNELS=0"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH (set $CXX)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        return f"building {SOURCE.name} failed: {e}"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
    return None


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
