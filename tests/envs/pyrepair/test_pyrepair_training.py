"""The main job on the Python repair environment: SFT from the expert's demonstrations, RL and
evaluation run on it unchanged (``experiments/pyrepair.py:smoke=True``, a tiny model)."""

import json
import os

import pytest

from agentrl_jax.config import load_config
from agentrl_jax.train.main import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMOKE = os.path.join(ROOT, "experiments", "pyrepair.py") + ":smoke=True"


@pytest.mark.slow
def test_pyrepair_sft_rl_smoke(tmp_path):
    cfg = load_config(
        SMOKE,
        [
            f"workdir={tmp_path}",
            "train.eval_before=False",
            "eval.n_episodes=1",
            "eval.modes=('greedy',)",
            "mesh.devices=1",  # one device: the 8 fake devices are the mesh tests'
        ],
    )
    summary = run(cfg, progress=False)
    assert summary["nonfinite_steps"] == 0 and summary["rl_steps"] == 1
    lines = [json.loads(x) for x in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    keys = set().union(*lines)
    assert "sft/loss" in keys and "rl/episode_tokens" in keys and "eval/heldout_success" in keys
    rl = next(x for x in lines if "rl/episode_tokens" in x)
    assert rl["rl/episode_tokens"] > 1000  # byte-level prompts of a real Python file
    calls = [json.loads(x) for x in open(os.path.join(summary["run_dir"], "tool_calls.jsonl"))]
    assert calls and all("error" in c for c in calls)  # an untrained model's calls, answered
