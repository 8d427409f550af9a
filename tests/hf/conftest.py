"""Tiny HF models of each family, built once per test module by ``transformers`` itself."""

import importlib.machinery
import importlib.util
import os
import sys

import pytest
import torch

from agentrl_jax.hf.tiny import FAMILY_NAMES, make_tiny_hf


def _import_installed_kernels() -> None:
    """Imports the PyPI package ``kernels`` (a dependency of ``transformers``) from the
    environment. ``python -m pytest`` puts the repository root first on ``sys.path``, where this
    project's ``kernels/`` (installed as ``agentrl_jax.kernels``) would shadow it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "kernels" in sys.modules:
        return
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", paths)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


_import_installed_kernels()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``{family: (directory, transformers model)}`` for qwen3, qwen3_moe and gpt_oss."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, family in enumerate(FAMILY_NAMES):
        path = str(root / family)
        out[family] = (path, make_tiny_hf(family, path, seed=i))
    return out
