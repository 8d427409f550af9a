"""benchmarks/decode_impls.py: the XLA and C++ paged decode kernels side by side."""

import pytest
from agentrl_jax.kernels import paged_decode_cpu

from benchmarks import script

decode_impls = script("decode_impls")

pytestmark = [
    pytest.mark.skipif(
        not paged_decode_cpu.available(), reason=str(paged_decode_cpu.unavailable_reason())
    ),
    pytest.mark.slow,  # compiles the rollout and the long-context models twice (about 30 s)
]


def test_rollout_and_sparse_rows_compare_both_impls_on_the_same_tokens():
    line = decode_impls.rollout_line("dense", 2, reps=1)
    assert line["variant"] == "rollout/dense/b2" and line["same_tokens"]
    assert line["xla_new_tokens_per_s"] > 0 and line["cpu_new_tokens_per_s"] > 0
    ratio = line["cpu_new_tokens_per_s"] / line["xla_new_tokens_per_s"]
    assert line["speedup_cpu_vs_xla"] == pytest.approx(ratio, rel=1e-2)
    line = decode_impls.sparse_line(256, reps=1, n_new=2)
    assert line["variant"] == "sparse/256" and line["same_tokens"]
    for impl in ("xla", "cpu"):
        ratio = line[f"{impl}_gather_tokens_per_s"] / line[f"{impl}_masked_tokens_per_s"]
        assert line[f"{impl}_sparse_vs_dense"] == pytest.approx(ratio, rel=1e-2)
