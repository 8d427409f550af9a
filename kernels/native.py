"""Building and registering the C++ kernels of this package (``*_cpu.cc``) for the XLA FFI.

A kernel is built on first use with the C++ compiler (``$CXX``, default ``c++``) against the FFI
headers of the installed jaxlib, ``-O3 -march=$AGENTRL_NATIVE_MARCH`` (default ``native``;
``x86-64-v3`` builds for any AVX2 machine, as ``make test-any-cpu`` does) plus its own flags,
into a cache folder (``$AGENTRL_KERNEL_CACHE``, default ``$XDG_CACHE_HOME/agentrl_jax/kernels`` or
``~/.cache/agentrl_jax/kernels``) under a name keyed by the source, the flags, the compiler,
jaxlib and the CPU's feature flags; later processes load the built library. Without a compiler
(or with ``AGENTRL_NATIVE_KERNELS=0``) ``load`` gives the reason instead, and the kernel's
callers keep their XLA path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jaxlib

FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def march() -> str:
    """The ``-march`` the kernels are built for: ``$AGENTRL_NATIVE_MARCH``, default ``native``.

    Raises:
      ValueError: the value is empty or holds characters a target name never has.
    """
    value = os.environ.get("AGENTRL_NATIVE_MARCH", "native")
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"AGENTRL_NATIVE_MARCH={value!r} is not a -march target name")
    return value


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


def build(compiler: str, source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The built library of ``source``, compiling it unless the cache holds it.

    Raises:
      RuntimeError: the compiler failed (its command and the end of its output).
      subprocess.CalledProcessError: ``compiler --version`` failed.
    """
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    flags = (*flags, f"-march={march()}")
    include = jax.ffi.include_dir()
    parts = [source.read_text(), " ".join(flags), version, include, jaxlib.__version__,
             _cpu_features()]  # fmt: skip
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    folder = cache_dir()
    lib = folder / f"lib{source.stem}-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)  # renamed into place: concurrent
    os.close(fd)  # builds (test workers) never load a half-written file
    try:
        cmd = [compiler, *flags, f"-I{include}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


def load(source: Path, target: str, symbol: str, build_fn: Callable[[str], Path]) -> str | None:
    """Builds (``build_fn(compiler)``) or finds the library of ``source`` and registers its
    handler ``symbol`` as FFI target ``target`` on the CPU platform; the reason the kernel is
    unavailable, or None. Callers cache the answer (once per process)."""
    if os.environ.get("AGENTRL_NATIVE_KERNELS", "1") == "0":
        return "disabled by AGENTRL_NATIVE_KERNELS=0"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH (set $CXX)"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build_fn(compiler)))
    except (OSError, RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        return f"building {source.name} failed: {e}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return None
