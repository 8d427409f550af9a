"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Tests share the benchmarks' model presets and timing helper (benchmarks/common.py): the
# repository root goes after site-packages, so the PyPI package `kernels` stays first.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import jax  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR", ".jax_cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
