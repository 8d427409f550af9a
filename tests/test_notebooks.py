"""Both research notebooks execute end to end in smoke mode (``SMOKE=1``); a failing cell fails.

Compiled programs go to the persistent JAX cache (``JAX_COMPILATION_CACHE_DIR``, default
``<repo>/.jax_cache`` as in the Makefile), so reruns mostly skip XLA compilation.
"""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("credit_assignment.ipynb", "mismatch.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_smoke_mode(name, monkeypatch):
    path = os.path.join(ROOT, "notebooks", name)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # outputs are cleared in git
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, name
    monkeypatch.setenv("SMOKE", "1")
    monkeypatch.setenv(
        "JAX_COMPILATION_CACHE_DIR",
        os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".jax_cache")),
    )
    monkeypatch.setenv("AGENTRL_NO_PROGRESS", "1")
    # the kernel must not inherit the test process's 8 fake CPU devices
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    monkeypatch.setenv("XLA_FLAGS", flags.strip())
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "display_data" for o in outputs), "no plot was drawn"
