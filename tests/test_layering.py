"""The package's layering: no import cycle between files, no import against the layers.

Every ``import`` statement counts, at module level or inside a function: a lazy import still
ties the two files together. ``docs/architecture.md`` states the rules.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# package directory -> module prefix (kernels/ is installed as agentrl_jax.kernels)
PACKAGES = {"agentrl_jax": "agentrl_jax", "kernels": "agentrl_jax.kernels"}
# layer -> layers it must never import
FORBIDDEN = {
    "model": ("rl", "rollout", "train"),
    "kernels": ("rl", "rollout", "train"),
    "envs": ("rl", "rollout", "train"),
    "data": ("rl", "rollout", "train"),
    "rl": ("rollout", "train"),
    "rollout": ("rl", "train"),
    "hf": ("train",),
}


def _modules() -> dict[str, str]:
    """Module name -> file path of every project file."""
    out = {}
    for directory, prefix in PACKAGES.items():
        base = os.path.join(ROOT, directory)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                name = prefix if rel == "__init__" else f"{prefix}.{rel}"
                out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts ``a.b`` if a module)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & set(modules)
            # `from package import module` ties to the module (as `import package.module` does)
            found.update(subs or {base})
            if len(subs) < len(node.names):  # and names defined by the package itself
                found.add(base)
    out = set()
    for imp in found:
        while imp and imp not in modules:  # `import a.b.c` of a package ties to its module
            imp = imp.rpartition(".")[0]
        if imp and imp != name:
            out.add(imp)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycles():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_downward(layer):
    bad = sorted(
        f"{m} -> {dep}"
        for m, deps in _graph().items()
        if _layer(m) == layer
        for dep in deps
        if _layer(dep) in FORBIDDEN[layer]
    )
    assert bad == []


def test_the_checker_sees_cycles_and_edges(tmp_path):
    """The checks above can fail: a two-file cycle and a lazy relative import are found."""
    graph = {"agentrl_jax.a": {"agentrl_jax.b"}, "agentrl_jax.b": {"agentrl_jax.a"}}
    assert _cycles(graph) == [["agentrl_jax.a", "agentrl_jax.b"]]
    modules = {"agentrl_jax.model.x": "", "agentrl_jax.train.y": ""}
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from ..train import y\n")
    assert _imports("agentrl_jax.model.x", str(src), modules) == {"agentrl_jax.train.y"}
