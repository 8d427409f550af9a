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
import pytest  # noqa: E402

jax.config.update(
    "jax_compilation_cache_dir", os.environ.get("JAX_COMPILATION_CACHE_DIR", ".jax_cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# Test files that start before all others under `pytest -n 2 --dist loadfile` (``make test``):
# the two-process run keeps a third process busy for a minute or more, and started last it
# would be the run's tail.
FIRST_FILES = ("tests/train/test_multiprocess.py",)


@pytest.hookimpl(trylast=True)  # after `-m` deselection: counts of the tests that run
def pytest_collection_modifyitems(config, items):
    """Orders files as pytest-xdist's loadscope reordering does (more tests first; ``make
    test`` turns xdist's own reordering off with ``--no-loadscope-reorder``), after the files
    in ``FIRST_FILES``."""
    counts: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        counts[path] = counts.get(path, 0) + 1

    def key(item):
        path = item.nodeid.split("::")[0]
        return (path not in FIRST_FILES, -counts[path])

    items.sort(key=key)  # stable: tests keep their order within a file
