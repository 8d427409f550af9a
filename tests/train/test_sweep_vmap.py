"""``agentrl sweep`` with ``sweep_vectorized=True`` end to end on the smoke experiment.

Three points (lr x seed: p00 = (1e-3, 0), p01 = (3e-3, 0), p02 = (1e-3, 1)); p01 is made to crash
in its second rollout, after the first vmapped update, so the group drops a row mid-run. Checked:
run directories, CSV and PNGs, the crash report, that re-running the sweep runs only p01, and
that every point's metrics, final parameters and Adam moments equal a plain sequential
``train.main.run`` of that point alone (``make_update_fn``, no vmap) - the vectorised sweep is the
sequential sweep, computed with one compiled learner.

Tolerance (measured on the 2-core CPU, jax 0.10.2, fp32): metrics of the 3-point group are
bitwise equal to the sequential runs; the 1-point re-run group differs by <= 1.1e-7 relative
(loss, entropy). Parameters and Adam moments are not bitwise: the update's elementwise tail is
compiled differently inside the vmapped program (on tests/test_sweep.py's model the first update
already differs by 1 ulp with bitwise-equal gradients and Adam moments, also with XLA backend
optimisation off); after 2 steps the largest
difference in a leaf, relative to the leaf's largest magnitude, was 2.5e-7 (3-point group) and
2.1e-6 (1-point group). The bounds below are 10x those: METRIC_RTOL 1e-6, LEAF_TOL 2e-5. A wrong
point (other lr or seed, a missed or doubled update) moves parameters by ~lr = 1e-3, 100x more.
"""

import csv
import json
import os

import jax
import numpy as np
import pytest

from agentrl_jax.config import apply_overrides, load_config, to_dataclass
from agentrl_jax.experiment import rl_config
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.report import load_series
from agentrl_jax.rl.state import rl_optimizer
from agentrl_jax.train import main, rl_loop, sweep
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir

SWEEP_LR = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "sweep_lr.py")
EXPERIMENT = """
from agentrl_jax.config import load_module

def get_config(arg=None):
    cfg = load_module({sweep_lr!r}).get_config("smoke=True,vmap=True")
    cfg.name = "vmap_toy"
    cfg.workdir = {workdir!r}
    cfg.mesh.devices = 1  # the test process's 8 fake devices are the mesh tests'
    cfg.train.eval_before = True
    # the smoke agent earns no reward: an entropy bonus gives every step a gradient
    cfg.rl.loss.entropy_coef = 0.01
    return cfg

def sweep(add):
    add(**{{"rl.lr": 1e-3, "seed": 0}})
    add(**{{"rl.lr": 3e-3, "seed": 0}})
    add(**{{"rl.lr": 1e-3, "seed": 1}})
"""
CRASH_LR = 3e-3
METRICS = ("rl/loss", "rl/entropy", "rl/grad_norm", "rl/reward", "rl/episode_tokens")
METRIC_RTOL = 1e-6
LEAF_TOL = 2e-5


def _restore(run_dir: str, cfg):
    """(params, opt_state, step) of the last RL checkpoint of ``run_dir``."""
    model = Transformer(to_dataclass(cfg.model, ModelConfig), get_policy(cfg.policy))
    template = init_params(model, jax.random.key(0))
    opt = rl_optimizer(rl_config(cfg.rl)).init(template)
    ckpt = Checkpointer(stage_dir(run_dir, "rl"), resume=True)
    out = ckpt.restore(params=template, opt_state=opt)
    ckpt.close()
    return out["params"], out["opt_state"], out["step"]


def _assert_trees_close(a, b, what):
    """max |a - b| of every leaf <= LEAF_TOL * max |b| of that leaf."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        err = float(np.max(np.abs(x - y), initial=0.0))
        scale = float(np.max(np.abs(y), initial=0.0))
        assert err <= LEAF_TOL * scale, f"{what}{jax.tree_util.keystr(path)}: {err=} {scale=}"


@pytest.fixture
def crash_in_second_rollout(monkeypatch):
    collect = rl_loop.RLRun.collect

    def crashing(self, i):
        if self.rl_cfg.lr == CRASH_LR and i == 1:
            raise RuntimeError("boom: simulated environment crash")
        return collect(self, i)

    monkeypatch.setattr(rl_loop.RLRun, "collect", crashing)
    return monkeypatch


@pytest.mark.slow
def test_vectorised_sweep_equals_sequential_points(tmp_path, crash_in_second_rollout):
    exp = tmp_path / "vmap_toy.py"
    exp.write_text(EXPERIMENT.format(sweep_lr=os.path.abspath(SWEEP_LR), workdir=str(tmp_path)))
    spec = str(exp)

    # 1. vectorised sweep; p01 crashes in its second rollout, the others go on
    res = sweep.run_sweep(spec)
    state = json.load(open(os.path.join(res.sweep_dir, sweep.SWEEP_FILE)))
    assert state["vectorized"]
    entries = state["points"]
    assert [e["status"] for e in entries] == ["done", "failed", "done"]
    assert "boom" in entries[1]["error"]
    assert "boom" in open(os.path.join(entries[1]["run_dir"], "error.txt")).read()
    assert res.rows[1]["status"].startswith("failed: RuntimeError")
    first_dirs = [e["run_dir"] for e in entries]
    assert [os.path.basename(d) for d in first_dirs] == ["p00", "p01", "p02"]
    done_mtimes = {i: os.path.getmtime(os.path.join(first_dirs[i], "summary.json")) for i in (0, 2)}

    # 2. re-run the sweep directory (no crash now): only p01 runs, in a fresh directory
    crash_in_second_rollout.undo()
    res = sweep.run_sweep(None, sweep_dir=res.sweep_dir)
    entries = json.load(open(os.path.join(res.sweep_dir, sweep.SWEEP_FILE)))["points"]
    assert [e["status"] for e in entries] == ["done"] * 3
    dirs = [e["run_dir"] for e in entries]
    assert dirs[0] == first_dirs[0] and dirs[2] == first_dirs[2]
    assert os.path.basename(dirs[1]) == "p01.1"
    for i in (0, 2):  # finished points were skipped
        assert os.path.getmtime(os.path.join(dirs[i], "summary.json")) == done_mtimes[i]

    # 3. table and plots
    rows = list(csv.DictReader(open(os.path.join(res.sweep_dir, sweep.TABLE_FILE))))
    assert [r["point"] for r in rows] == ["p00", "p01", "p02"]
    assert [r["status"] for r in rows] == ["done"] * 3
    assert len(res.plots) == 3 and all(os.path.getsize(p) > 1000 for p in res.plots)
    series = [load_series(d) for d in dirs]
    for s in series:
        assert list(s["rl/loss"][0]) == [1, 2]
        assert list(s["eval/heldout_success"][0]) == [0, 2]  # before and after RL

    # 4. metrics differ where the swept value does: p01 only in lr (same rollouts at step 1,
    # different parameters after one update), p02 in the seed (other init, other rollouts).
    # The gradient norm, not the entropy: the initial policy is near uniform, where entropy moves
    # only to second order in the parameters.
    gn = [s["rl/grad_norm"][1] for s in series]
    assert gn[0][0] == pytest.approx(gn[1][0], rel=METRIC_RTOL)
    assert abs(gn[0][1] - gn[1][1]) > 100 * METRIC_RTOL * abs(gn[0][1])
    assert abs(gn[0][0] - gn[2][0]) > 100 * METRIC_RTOL * abs(gn[0][0])

    # 5. each point equals a sequential run of that point alone (same process, no vmap)
    for e, d, s in zip(entries, dirs, series):
        cfg = apply_overrides(load_config(spec), e["overrides"])
        summary = main.run(cfg)
        ref = summary["run_dir"]
        ref_series = load_series(ref)
        for key in METRICS:
            np.testing.assert_allclose(
                s[key][1], ref_series[key][1], rtol=METRIC_RTOL, atol=1e-7, err_msg=f"{d} {key}"
            )
        vec_summary = json.load(open(os.path.join(d, "summary.json")))
        for key in ("heldout_success_before_rl", "heldout_success_after_rl", "nonfinite_steps"):
            assert vec_summary[key] == summary[key], (d, key)
        params, opt, step = _restore(d, cfg)
        ref_params, ref_opt, ref_step = _restore(ref, cfg)
        assert step == ref_step == 2
        _assert_trees_close(params, ref_params, f"{d} params")
        _assert_trees_close(opt, ref_opt, f"{d} opt_state")


def test_vectorised_sweep_refuses_untraced_keys_before_running(tmp_path):
    exp = tmp_path / "bad.py"
    body = EXPERIMENT.split("def sweep")[0]
    exp.write_text(
        body.format(sweep_lr=os.path.abspath(SWEEP_LR), workdir=str(tmp_path / "runs"))
        + "def sweep(add):\n"
        + "    add(**{'rl.loss.entropy_coef': 0.0})\n"
        + "    add(**{'rl.loss.entropy_coef': 0.1})\n"
    )
    with pytest.raises(ValueError, match="cannot vectorise"):
        sweep.run_sweep(str(exp))
    assert not os.path.exists(tmp_path / "runs")  # nothing was created
