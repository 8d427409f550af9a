"""benchmarks/rollout_ab.py: a sampler switch off and on in one process."""

import pytest

from agentrl_jax.rollout import sampler
from benchmarks import script

rollout_ab = script("rollout_ab")


def test_an_unknown_switch_is_refused():
    with pytest.raises(ValueError, match="unknown switch 'UNSTACK'"):
        rollout_ab.ab_line("UNSTACK", "dense", 2, reps=1)
    # the switches are options of a run (policy and RolloutConfig fields), no module state
    assert not any(hasattr(sampler, s) for s in rollout_ab.SWITCHES)


@pytest.mark.slow  # compiles the benchmark rollout twice (about 20 s)
def test_line_times_both_sides():
    line = rollout_ab.ab_line("PACK_WEIGHTS", "dense", 2, reps=2)
    assert line["variant"] == "dense/D/b2/PACK_WEIGHTS" and line["same_tokens"]
    assert line["off_ms"] > 0 and line["on_ms"] > 0
    assert line["ratio"] == pytest.approx(line["on_ms"] / line["off_ms"])
    assert line["off_ms_min"] <= line["off_ms"] <= line["off_ms_max"]
