"""kernels/ imports: no file-level cycle, nothing above the layer, importable on a bare image.

The device image has jax but not grain or ml_collections; ``agentrl_jax.kernels`` and
``benchmarks/kernels.py`` must import there.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"
PACKAGE = "agentrl_jax.kernels"
# What kernel modules may import besides each other and the standard library.
ALLOWED_TOP = {"jax", "jaxlib", "numpy", "agentrl_jax"}


def _imports(path: Path) -> set[str]:
    """Absolute module names a file imports, at any depth (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    mods = {f"{PACKAGE}.{p.stem}": p for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    return {m: {i for i in _imports(p) if i in mods} - {m} for m, p in mods.items()}


def test_no_import_cycle_in_kernels():
    graph = _graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, dep]))
            if dep not in state:
                visit(dep, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_kernels_import_only_jax_numpy_and_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    for path in KERNELS.glob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top in ALLOWED_TOP | stdlib, f"{path.name} imports {name}"
            if top == "agentrl_jax":
                assert name.startswith(PACKAGE), f"{path.name} imports {name} (above kernels)"


def test_importable_without_grain_and_ml_collections():
    """A fresh interpreter where grain, ml_collections, flax and optax cannot be imported."""
    code = (
        "import sys, runpy\n"
        "for m in ('grain', 'ml_collections', 'flax', 'optax'): sys.modules[m] = None\n"
        "import agentrl_jax.kernels\n"
        "sys.argv = ['kernels.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('benchmarks/kernels.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
