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

# The longest test files first: `make test` hands whole files to its two xdist workers in
# collection order (`--dist loadfile`), and a long file handed out last leaves the other
# worker idle at the end. Measured with `pytest --durations=0`; the rest keep their order.
LONGEST_FIRST = (
    "tests/model/test_transformer.py",
    "tests/train/test_rl_loop.py",
    "tests/train/test_mesh.py",
    "tests/kernels/test_paged_decode_kernel.py",
    "tests/train/test_async_rl.py",
    "tests/rollout/test_decode_kernel.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
