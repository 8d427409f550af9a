"""Benchmark scripts (run as ``python benchmarks/<name>.py``) and what they share."""

import ast
import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str):
    """``benchmarks/<name>.py`` imported as the module ``benchmarks.<name>`` (tests, notebooks).

    A script imports its siblings by bare name (``from common import ...``), as it runs from
    this directory; each sibling it imports is first imported the same way and registered
    under its bare name (unless a module of that name is loaded already). Dotted imports
    (``kernels.paged_decode``) are packages, not siblings.
    """
    module = f"benchmarks.{name}"
    if module not in sys.modules:
        with open(os.path.join(_HERE, f"{name}.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                deps = [node.module]
            else:
                continue
            for dep in deps:
                if "." not in dep and dep != name and os.path.isfile(f"{_HERE}/{dep}.py"):
                    sys.modules.setdefault(dep, script(dep))
    return importlib.import_module(module)
