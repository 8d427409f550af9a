"""Sweeps: the vmapped learner against per-point ``make_update_fn`` (the reference), and the
sweep driver (directories, crash reporting, resume, table, CSV, plot) with a stub run function."""

import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import cli
from agentrl_jax.metrics import MetricsWriter
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.losses import LossConfig
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.train import sweep, sweep_vmap

B, T = 4, 12
CFG = ModelConfig(
    vocab_size=48,
    d_model=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=8,
    layer_pattern="D",
    window=4,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    d_ff=32,
    init_std=0.3,
)


def _batch(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[2, 9:] = False
    action = (rng.random((B, T)) < 0.6) & valid
    action[:, :2] = False
    return {
        "tokens": tokens,
        "valid": valid,
        "action_mask": action,
        "advantages": np.where(action, rng.normal(size=(B, T)), 0.0).astype(np.float32),
        "rollout_logprobs": np.where(action, -rng.random((B, T)) * 3, 0.0).astype(np.float32),
    }


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_vmapped_update_matches_per_point_update_fn():
    """P=2 points (lr, weight decay, clip bounds swept) x 2 steps on fixed batches: jax.vmap of
    the one update over stacked point states equals two separate jitted ``make_update_fn``
    learners (warmup schedule, AdamW decay, clipping)."""
    model = Transformer(CFG, get_policy("fp32"))
    params = init_params(model, jax.random.key(0))
    base = RLConfig(lr=1e-2, warmup_steps=2, weight_decay=0.0, grad_clip=0.5, micro_batch=2)
    points = [
        base.replace(lr=3e-2, weight_decay=0.1),
        base.replace(lr=3e-3, weight_decay=0.01, loss=LossConfig(clip_low=0.3, clip_high=0.2)),
    ]
    batches = [_batch(1), _batch(2)]
    sweep_vmap.check_vectorizable(points, {"rl.lr", "rl.weight_decay", "rl.loss.clip_low"})
    update_fn = sweep_vmap.make_vmapped_update(model, base)
    fresh = lambda c: init_train_state(jax.tree.map(jnp.copy, params), c, jax.random.key(1))
    vstate = sweep_vmap.stack([sweep_vmap.with_hparams(fresh(c), c) for c in points])
    for b in batches:
        vstate, vm = update_fn(vstate, sweep_vmap.stack([b] * len(points)))
    for p, rl_cfg in enumerate(points):
        fn = make_update_fn(model, rl_cfg)
        state = fresh(rl_cfg)
        for b in batches:
            state, m = fn(state, b)
        for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(vstate.params)):
            np.testing.assert_allclose(np.asarray(y[p]), np.asarray(x), rtol=2e-5, atol=2e-6)
        for key in ("loss", "entropy", "grad_norm", "mismatch/kl_k3"):
            np.testing.assert_allclose(float(vm[key][p]), float(m[key]), rtol=1e-4, atol=1e-6)
    # different points really did move differently
    leaf = jax.tree.leaves(vstate.params)[0]
    assert not np.allclose(np.asarray(leaf[0]), np.asarray(leaf[1]))


def test_vectorizable_checks():
    base = RLConfig()
    # the loss's own declaration decides which of its fields a group may trace
    assert sweep_vmap.vmap_keys("ppo") == (
        "rl.lr",
        "rl.weight_decay",
        "seed",
        "rl.loss.clip_high",
        "rl.loss.clip_low",
    )
    with pytest.raises(ValueError, match="cannot vectorise"):
        sweep_vmap.check_vectorizable([base], {"rl.loss.entropy_coef"})
    with pytest.raises(ValueError, match=r"cannot vectorise \['rl.loss.dual_clip'\]"):
        sweep_vmap.check_vectorizable([base], {"rl.loss.dual_clip", "rl.loss.clip_low"})
    with pytest.raises(ValueError, match="not traced"):
        sweep_vmap.check_vectorizable([base, base.replace(micro_batch=2)], {"rl.lr"})
    with pytest.raises(ValueError, match="ppo_epochs"):
        sweep_vmap.make_vmapped_update(None, base.replace(ppo_epochs=2))


EXPERIMENT = """
from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config

def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "toy"
    cfg.workdir = {workdir!r}
    return cfg

def sweep(add):
    for lr in (1e-4, 3e-4, 1e-3):
        add(**{{"rl.lr": lr}})
"""


class StubRun:
    """Writes what train.main.run writes (metrics.jsonl, summary.json); crashes where told."""

    def __init__(self, crash_lr=None):
        self.crash_lr = crash_lr
        self.calls = []

    def __call__(self, cfg, resume_dir, progress=None):
        self.calls.append((cfg.rl.lr, resume_dir))
        assert os.path.isfile(os.path.join(resume_dir, "config.json"))
        w = MetricsWriter(resume_dir, tensorboard=False)
        for step in range(1, 4):
            w.write(step, {"reward": cfg.rl.lr * 1000 * step, "entropy": 2.0 / step}, prefix="rl")
            if cfg.rl.lr == self.crash_lr and step == 2:
                w.close()
                raise RuntimeError("boom")
        w.close()
        summary = {"heldout_success_after_rl": cfg.rl.lr * 100, "entropy_end": 2.0 / 3}
        with open(os.path.join(resume_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
        return summary


def test_sweep_driver_crash_resume_table(tmp_path):
    exp = tmp_path / "toy.py"
    exp.write_text(EXPERIMENT.format(workdir=str(tmp_path / "runs")))
    stub = StubRun(crash_lr=3e-4)
    res = sweep.run_sweep(str(exp), ["seed=3"], run_fn=stub)
    assert os.path.basename(res.sweep_dir).startswith("toy-sweep-")
    assert [c[0] for c in stub.calls] == [1e-4, 3e-4, 1e-3]  # continued after the crash
    dirs = [c[1] for c in stub.calls]
    assert len(set(dirs)) == 3 and all(os.path.dirname(d) == res.sweep_dir for d in dirs)
    status = [r["status"] for r in res.rows]
    assert status[0] == status[2] == "done" and status[1].startswith("failed: RuntimeError")
    assert "boom" in open(os.path.join(dirs[1], "error.txt")).read()
    rows = list(csv.DictReader(open(os.path.join(res.sweep_dir, sweep.TABLE_FILE))))
    assert [r["point"] for r in rows] == ["p00", "p01", "p02"]
    assert float(rows[2]["reward"]) == pytest.approx(3.0)  # last logged rl/reward
    assert float(rows[0]["heldout_success"]) == pytest.approx(0.01)
    assert any(p.endswith("curves_rl_reward.png") for p in res.plots)
    assert all(os.path.getsize(p) > 1000 for p in res.plots)
    assert "p02" in res.table and "rl.lr=0.001" in res.table

    # re-run the same sweep directory: only the failed point runs, in its own directory
    stub2 = StubRun()
    res2 = sweep.run_sweep(None, sweep_dir=res.sweep_dir, run_fn=stub2)
    assert stub2.calls == [(3e-4, dirs[1])]
    assert all(r["status"] == "done" for r in res2.rows)
    assert json.load(open(os.path.join(dirs[1], "config.json")))["seed"] == 3
    with pytest.raises(ValueError, match="ran"):
        sweep.run_sweep(str(tmp_path / "other.py"), sweep_dir=res.sweep_dir, run_fn=stub2)
    # a fresh sweep never reuses a directory
    res3 = sweep.run_sweep(str(exp), run_fn=StubRun())
    assert res3.sweep_dir != res.sweep_dir


def test_cli_sweep_resumes_directory(tmp_path, monkeypatch, capsys):
    exp = tmp_path / "toy.py"
    exp.write_text(EXPERIMENT.format(workdir=str(tmp_path / "runs")))
    res = sweep.run_sweep(str(exp), run_fn=StubRun(crash_lr=1e-3))
    monkeypatch.setattr("agentrl_jax.train.main.run", StubRun())
    assert cli.main(["sweep", res.sweep_dir]) == 0
    out = capsys.readouterr().out
    assert res.sweep_dir in out and "p02" in out
    plain = tmp_path / "plain.py"
    plain.write_text(EXPERIMENT.split("def sweep")[0].format(workdir=str(tmp_path / "runs")))
    with pytest.raises(ValueError, match="no sweep"):
        sweep.run_sweep(str(plain))
