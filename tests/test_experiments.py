"""Every experiment module loads in smoke mode and its model config validates; plan runs."""

import glob
import json
import os
import subprocess
import sys

import pytest

from agentrl_jax.config import apply_overrides, load_config, parse_arg, sweep_points, to_dataclass
from agentrl_jax.experiment import base_config, build, from_saved
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.rl.state import RLConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=os.path.basename)
def test_experiment_loads_in_smoke_mode(path):
    cfg = load_config(path + ":smoke=True")
    assert cfg.smoke is True
    to_dataclass(cfg.model, ModelConfig)
    for point in sweep_points(path):
        apply_overrides(cfg, point)


def test_overrides_errors_name_the_key():
    path = os.path.join(ROOT, "experiments", "toy.py")
    cfg = load_config(path, ["model.n_layers=8", "policy=fp32"])
    assert cfg.model.n_layers == 8 and cfg.policy == "fp32"
    with pytest.raises(ValueError, match="model.n_layrs"):
        load_config(path, ["model.n_layrs=8"])
    with pytest.raises(ValueError, match="model.n_layers"):
        load_config(path, ["model.n_layers=abc"])
    with pytest.raises(ValueError, match="smoke"):
        load_config(path + ":smoke=maybe")
    with pytest.raises(ValueError, match="unknown experiment argument"):
        load_config(path + ":size=huge")
    with pytest.raises(ValueError, match="does not exist"):
        load_config("experiments/nope.py")
    with pytest.raises(ValueError, match="is a section"):
        load_config(path, ['model={"d_model": 8}'])
    kw = load_config(path, ['rl.advantage_kwargs={"eps": 0.001}']).rl.advantage_kwargs
    assert kw.to_dict() == {"eps": 0.001}
    with pytest.raises(ValueError, match="n_heads"):
        to_dataclass(apply_overrides(cfg, ["model.n_heads=3"]).model, ModelConfig)


def test_moved_keys_name_the_new_key(tmp_path):
    """``train.advantage`` / ``train.advantage_kwargs`` live in ``rl``: setting the old key in an
    override, an experiment module or a config built in code is an error naming the new key; a
    saved run's config that predates the move reads under the new names."""
    path = os.path.join(ROOT, "experiments", "toy.py")
    moved = "config key 'train.advantage' moved to 'rl.advantage'"
    with pytest.raises(ValueError, match=moved):
        load_config(path, ["train.advantage=rloo"])
    module = tmp_path / "old_keys.py"
    module.write_text(
        "from agentrl_jax.experiment import base_config\n"
        "def get_config(arg=None):\n"
        "    cfg = base_config()\n"
        "    cfg.train.advantage_kwargs = {'eps': 0.1}\n"
        "    return cfg\n"
    )
    with pytest.raises(ValueError, match="'train.advantage_kwargs' moved to 'rl.advantage_kwargs'"):
        load_config(str(module))
    cfg = base_config()
    cfg.train.advantage = "rloo"
    with pytest.raises(ValueError, match=moved):
        build(cfg)
    saved = base_config().to_dict()
    saved["train"] |= {"advantage": "rloo", "advantage_kwargs": {"eps": 0.1}}
    del saved["rl"]["advantage"], saved["rl"]["advantage_kwargs"]
    cfg = from_saved(saved)
    assert cfg.rl.advantage == "rloo" and cfg.rl.advantage_kwargs.to_dict() == {"eps": 0.1}
    assert "advantage" not in cfg.train
    with pytest.raises(ValueError, match="RLConfig.advantage='nope' is not registered"):
        RLConfig(advantage="nope")


def test_parse_arg_literals():
    arg = parse_arg("smoke=True,lr=0.1,name=x", smoke=False, lr=1.0, name="")
    assert arg.smoke is True and arg.lr == 0.1 and arg.name == "x"


def test_plan_reference_architecture():
    """`agentrl plan` sizes the ~100B, 96-layer reference MoE with eval_shape only."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl_jax.cli",
            "plan",
            os.path.join(ROOT, "experiments", "seed_moe_100l.py"),
            "--devices",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["n_layers"] == 96
    assert 90e9 < plan["total_params"] < 115e9
    assert plan["active_params_per_token"] < plan["total_params"] / 5
    assert plan["kv_bytes_per_seq_1m_ring"] < plan["kv_bytes_per_seq_1m_dense"] / 3
    assert (
        plan["mesh"]["expert"]
        * plan["mesh"]["fsdp"]
        * plan["mesh"]["data"]
        * plan["mesh"]["tensor"]
        == 256
    )
    assert plan["decode_flops_per_token"] > 2 * plan["active_params_per_token"]
