"""A pretrained chat model as the trainer's starting point (``init.hf_path``): the model comes
from the directory, the environment is played through its chat template, SFT demonstrations are
the expert's calls in the family's format, and the main job runs on it unchanged."""

import json
import os

import numpy as np
import pytest

from agentrl_jax.config import load_config
from agentrl_jax.experiment import build
from agentrl_jax.hf import load_pretrained
from agentrl_jax.hf.chat_env import ChatEnv
from agentrl_jax.train.demos import demo_episode
from agentrl_jax.train.main import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _smoke(family):
    return os.path.join(ROOT, "experiments", f"{family}_rl.py") + ":smoke=True"


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_sections_come_from_the_hf_directory(family):
    cfg = load_config(_smoke(family))
    s = build(cfg)
    model_cfg, _ = load_pretrained(cfg.init.hf_path)
    assert s.model == model_cfg  # the checkpoint decides the architecture
    tok = s.env.tokenizer()
    assert tok.vocab_size <= s.model.vocab_size
    env = s.env.env(tok)
    assert isinstance(env, ChatEnv)
    # an SFT demonstration: the expert's calls in the family's format, token in, token out
    demo = demo_episode({"seed": 3, "difficulty": 0, "bug_types": ("logic",)}, tok, env=s.env)
    assert demo["success"]
    actions = np.asarray(demo["tokens"])[np.asarray(demo["action_mask"])]
    text = tok.decode(actions.tolist())
    assert (tok.fmt.name == "qwen") == ("<tool_call>" in text)
    assert "submit" in text and demo["fix_mask"].any()
    with pytest.raises(ValueError, match="model.d_model is decided by init.hf_path"):
        build(load_config(_smoke(family), ["model.d_model=64"]))
    build(load_config(_smoke(family), ["model.remat=full"]))  # a training choice may be set


@pytest.mark.slow
def test_qwen3_smoke_runs_the_main_job(tmp_path):
    over = [f"workdir={tmp_path}", "train.eval_before=False", "mesh.devices=1"]  # one device
    cfg = load_config(_smoke("qwen3"), over)
    summary = run(cfg, progress=False)
    assert summary["nonfinite_steps"] == 0 and summary["rl_steps"] == 1
    lines = [json.loads(x) for x in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert any("sft/loss" in x for x in lines) and any("rl/reward" in x for x in lines)


def test_chat_experiments_need_a_directory():
    with pytest.raises(ValueError, match="needs hf_path=DIR"):
        load_config(os.path.join(ROOT, "experiments", "qwen3_rl.py"))
