"""Asynchronous RL end to end (smoke model): bounded staleness, per-token versions in the batch,
and a run SIGKILLed mid-step that resumes bitwise without skipping or repeating a task."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from agentrl_jax.config import load_config
from agentrl_jax.experiment import build
from agentrl_jax.metrics import latest_attempts, read_jsonl
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.rl.state import RLConfig
from agentrl_jax.rollout import cache_sharding
from agentrl_jax.rollout import sampler as sampler_module
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.checkpoint import existing_steps, stage_dir
from agentrl_jax.train.placement import Placement
from agentrl_jax.train.rl_loop import TASKS_FILE, RLRun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"
STEPS = 4
ASYNC = [
    "train.sft=False",
    "train.eval_before=False",
    # process rewards give a random model's episodes unequal advantages: the weights move
    "rl.advantage=episode_process",
    "rl.max_staleness=2",
    "rl.loss.tis_cap=2.0",
    "rl.sync_every_rounds=2",
    f"train.rl_steps={STEPS}",
    "train.ckpt_every=1",
]

# Trains STEPS steps with a checkpoint after each; the test kills it mid-run.
CHILD = """
import sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from agentrl_jax.config import load_config
from agentrl_jax.experiment import build
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.train.rl_loop import RLRun

cfg = load_config(sys.argv[1], sys.argv[4:])
s = build(cfg)
params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
run = RLRun(s, sys.argv[2], params, seed=cfg.seed, resume=False)
for step in range(cfg.train.rl_steps):
    run.step(step)
    run.save(step + 1)
"""


def _params(run):
    return [np.asarray(x) for x in jax.tree.leaves((run.state.params, run.state.opt_state))]


def _tasks(run_dir):
    rows = latest_attempts(read_jsonl(os.path.join(run_dir, TASKS_FILE)), stage=lambda r: None)
    return sorted(
        ((r["step"], r["drawn"], r["used"]) for r in rows), key=lambda x: x[0]
    )  # one row per step


def test_staleness_without_a_correction_is_refused():
    with pytest.raises(ValueError, match="max_staleness=1 trains on tokens of older policy"):
        RLConfig(max_staleness=1)
    RLConfig(max_staleness=1, old_logprobs="rollout")
    with pytest.raises(ValueError, match="partial_rollout='drop'; allowed"):
        RLConfig(partial_rollout="drop")
    with pytest.raises(ValueError, match="max_staleness=-1 must be an int >= 0"):
        RLConfig(max_staleness=-1)


@pytest.mark.slow  # a second process compiles and runs the smoke experiment: ~30 s of 2 cores
def test_sigkilled_async_run_resumes_bitwise(tmp_path):
    cfg = load_config(SMOKE, ASYNC)
    s = build(cfg)
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    straight = tmp_path / "straight"
    straight.mkdir()
    a = RLRun(s, str(straight), params, seed=cfg.seed, resume=False)
    lags = []
    for step in range(STEPS):
        m = a.step(step)
        lags.append(m["async/lag_max"])
        assert 0.0 <= m["async/lag_mean"] <= m["async/lag_max"] <= 2.0
        assert m["async/weight_switches"] >= (1.0 if step >= 1 else 0.0)
    a.close()
    assert max(lags) == 2.0  # tokens of version step - 2 reached the update

    broken = tmp_path / "broken"
    cache = jax.config.jax_compilation_cache_dir
    argv = [sys.executable, "-c", CHILD, SMOKE, str(broken), os.path.abspath(cache), *ASYNC]
    proc = subprocess.Popen(argv, cwd=ROOT)
    stage = stage_dir(str(broken), "rl")
    deadline = time.time() + 240
    try:  # killed as soon as checkpoint 2 is committed: the learner is in its third step
        while time.time() < deadline and proc.poll() is None:
            if 2 in existing_steps(stage):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the run never reached checkpoint 2 (exit code {proc.poll()})")
    finally:
        proc.kill()
        proc.wait()
    c = RLRun(s, str(broken), params, seed=cfg.seed, resume=True, attempt=2)
    assert 2 <= c.start_step < STEPS
    for step in range(c.start_step, STEPS):
        c.step(step)
    c.close()
    for x, y in zip(_params(a), _params(c), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.pipeline.state() == c.pipeline.state()
    # the task log: every step's tasks as the uninterrupted run drew and used them, once
    assert _tasks(str(broken)) == _tasks(str(straight))
    assert [step for step, _, _ in _tasks(str(broken))] == list(range(1, STEPS + 1))


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_overlapped_environment_without_staleness_resumes_bitwise(tmp_path):
    """``train.overlap_env`` at k=0: the rollout side plays every batch under the current
    version (lag 0) with tool calls overlapping the model; a checkpoint without older
    versions resumes bitwise."""
    over = [o for o in ASYNC if not o.startswith("rl.max_staleness")]  # the same update
    cfg = load_config(SMOKE, [*over, "train.overlap_env=True", "train.rl_steps=3"])
    s = build(cfg)
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    a = RLRun(s, str(tmp_path / "a"), params, seed=cfg.seed, resume=False)
    assert a.driver is not None
    for step in range(3):
        m = a.step(step)
        assert m["async/lag_max"] == 0.0 and m["async/weight_switches"] == 0.0
    a.close()
    b = RLRun(s, str(tmp_path / "b"), params, seed=cfg.seed, resume=False)
    b.step(0)
    b.save(1)
    b.close()
    c = RLRun(s, str(tmp_path / "b"), params, seed=cfg.seed, resume=True, attempt=2)
    assert c.start_step == 1
    for step in (1, 2):
        c.step(step)
    c.close()
    for x, y in zip(_params(a), _params(c), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # an asynchronous run on 8 devices and its one-device twin: minutes of 2 cores
def test_async_run_on_a_one_process_mesh(tmp_path, monkeypatch):
    """One process, 8 devices (mesh fsdp 4 x tensor 2), k=1: the rollout side plays under the
    run's mesh with sharded parameters and the update trains on them. The episodes are those of
    the one-device run (task log, rewards, lag) and the parameters agree within 1e-2 x the
    summed learning rates (the sharded update's rounding, tests/train/test_mesh.py).
    ``train.overlap_env`` runs through the same rollout side."""
    over = [o for o in ASYNC if not o.startswith(("rl.max_staleness", "rl.sync_every"))]
    cfg = load_config(SMOKE, [*over, "rl.max_staleness=1", "train.rl_steps=2"])
    s = build(cfg)
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    placement = Placement(MeshConfig(fsdp=4, tensor=2), s.model, s.policy)
    placed = []  # the mesh each fresh sampler state was placed on (rollout thread included)

    def spy(state):
        placed.append(cache_sharding.ambient_mesh())
        return cache_sharding.place_decode_state(state)

    monkeypatch.setattr(sampler_module, "place_decode_state", spy)
    runs, rows = {}, {}
    for name, place in (("one", None), ("mesh", placement)):
        run = RLRun(s, str(tmp_path / name), params, seed=cfg.seed, resume=False, placement=place)
        assert run.driver is not None
        rows[name] = [run.step(step) for step in range(2)]
        run.close()
        runs[name] = run
    assert placed and placed[-1] is placement.mesh
    table = runs["mesh"].state.params["params"]["embed"]["table"]
    assert table.sharding == placement.param_shardings()["params"]["embed"]["table"]
    assert len(table.sharding.device_set) == 8
    assert table.addressable_shards[0].data.size < table.size
    assert [m["async/lag_max"] for m in rows["mesh"]] == [0.0, 1.0]
    for a, b in zip(rows["one"], rows["mesh"], strict=True):
        for key in ("success", "reward", "episode_tokens"):
            assert a[key] == b[key], key
    assert _tasks(str(tmp_path / "one")) == _tasks(str(tmp_path / "mesh"))
    tol = 1e-2 * 2 * s.rl.lr
    for x, y in zip(_params(runs["one"]), _params(runs["mesh"]), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=tol)


def test_async_run_over_several_processes_is_refused(tmp_path):
    cfg = load_config(SMOKE, ASYNC)
    s = build(cfg)
    placement = Placement.default_device(s.model, s.policy)
    placement.multi_process = True  # what jax.distributed with several processes gives
    with pytest.raises(ValueError, match="run on one process; this run has 1 processes"):
        RLRun(
            s, str(tmp_path), None, seed=cfg.seed, resume=False, placement=placement
        )  # before compute
