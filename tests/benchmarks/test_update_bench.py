"""benchmarks/update.py: the micro-batched update step (``--micro-batch``) and the MoE expert
matmul forms (``--expert-matmul``)."""

import json

import pytest

from benchmarks import script

update = script("update")


@pytest.mark.parametrize("bad", ["3", "0", "16"])
def test_micro_batch_must_divide_the_batch(bad, capsys):
    with pytest.raises(SystemExit):
        update.main(["--micro-batch", bad])
    assert "must divide the batch of 8" in capsys.readouterr().err


def test_unknown_expert_matmul_form_is_refused(capsys):
    with pytest.raises(SystemExit):
        update.main(["--expert-matmul", "per-expert,grouped"])
    assert "--expert-matmul ['grouped']" in capsys.readouterr().err


@pytest.mark.slow  # compiles the benchmark update twice (about 20 s)
def test_micro_batched_step_takes_the_whole_batch_step(capsys):
    """Two micro-batches of 4: the line says so, and one step leaves the parameters where the
    whole-batch step does (gradient accumulation; float rounding apart)."""
    import jax
    import numpy as np

    update.main(
        ["--only", "dense-DDDD", "--iteration", "none", "--reps", "1", "--micro-batch", "4"]
    )
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["micro_batch"] == 4 and line["loss_finite"]
    whole, micro = (
        update.build_step("dense", "DDDD", "fp32", np.random.default_rng(0), m) for m in (None, 4)
    )
    m_whole, m_micro = whole(), micro()
    np.testing.assert_allclose(m_micro["loss"], m_whole["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(micro.state.params), jax.tree.leaves(whole.state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # and the step moved them: the comparison is not between two untouched copies
    moved = [
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(whole.state.params), jax.tree.leaves(whole.params))
    ]
    assert max(moved) > 1e-7
