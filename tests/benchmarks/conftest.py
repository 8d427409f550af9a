"""Puts the repository root on ``sys.path`` so tests import ``benchmarks.<script>``."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after site-packages: the PyPI package `kernels` stays first
