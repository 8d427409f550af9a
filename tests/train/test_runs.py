"""Runs that resume cannot damage: what a run is, its own config, intact checkpoints (checksums,
fallback, a kill while writing), attempts in the logs, the run lock, finished runs, one-line
errors for user input."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import cli
from agentrl_jax.config import load_config
from agentrl_jax.experiment import build
from agentrl_jax.metrics import MetricsWriter, latest_attempts, read_jsonl, save_config
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.report import load_series
from agentrl_jax.train import checksum, runs, stages
from agentrl_jax.train.checkpoint import Checkpointer, UnusableCheckpoint, restore_params, stage_dir
from agentrl_jax.train.main import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"
# one device: the 8 fake devices are the mesh tests' (an 8-way run costs 2-3x the CPU time)
FAST = ["train.sft=False", "train.eval_before=False", "eval.modes=('greedy',)", "mesh.devices=1"]


# ---------------------------------------------------------------------------------- checksums
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int32", "uint32", "bool"])
def test_host_and_device_checksums_agree(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 37)) * 50).astype(dtype)
    assert checksum.host_checksum(np.asarray(x)) == checksum.device_checksum(x)
    assert checksum.checksum(x) == checksum.host_checksum(np.asarray(x))


def test_checksum_sees_every_flipped_bit_and_a_swap():
    x = np.random.default_rng(1).standard_normal(301).astype(np.float32)
    ref = checksum.host_checksum(x)
    words = x.view(np.uint32)
    for i in (0, 150, 300):
        for bit in range(32):
            y = words.copy()
            y[i] ^= np.uint32(1 << bit)
            assert checksum.host_checksum(y.view(np.float32)) != ref, (i, bit)
    swapped = x.copy()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert checksum.host_checksum(swapped) != ref
    assert checksum.host_checksum(np.arange(3, dtype=np.int64)) != checksum.host_checksum(
        np.arange(3, dtype=np.int64)[::-1]
    )


# ------------------------------------------------------------------------- checkpoint integrity
def _tree(seed):
    r = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(r.standard_normal((64, 32)), jnp.float32),
        "b": jnp.ones(3, "bfloat16"),
    }


def _opt(seed):
    """An optimiser state far smaller than the params: the data file's middle is params bytes."""
    return {"m": jnp.asarray(np.random.default_rng(seed).standard_normal(4), jnp.float32)}


def _save_two(directory):
    with Checkpointer(directory) as ck:
        for step in (1, 2):
            ck.save(step, params=_tree(step), opt_state=_opt(10 + step), rng=jax.random.key(0))


def _biggest_data_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) if "/d" in r for f in fs]
    return max(files, key=os.path.getsize)


def _flip_byte(step_dir):
    path = _biggest_data_file(step_dir)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


CORRUPTIONS = {
    "truncated data file": lambda s: os.truncate(
        _biggest_data_file(s), os.path.getsize(_biggest_data_file(s)) // 2
    ),
    "missing metadata": lambda s: os.remove(os.path.join(s, "state", "_METADATA")),
    "emptied manifest": lambda s: open(os.path.join(s, "state", "manifest.ocdbt"), "w").close(),
    "flipped bytes": _flip_byte,
}


@pytest.mark.parametrize("damage", list(CORRUPTIONS))
def test_unusable_checkpoint_falls_back_to_the_newest_intact_step(
    tmp_path, caplog, monkeypatch, damage
):
    stage = stage_dir(tmp_path, "rl")
    _save_two(stage)
    CORRUPTIONS[damage](os.path.join(stage, "2"))
    template = _tree(0)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    # read-only (eval): step 1, one line about step 2, nothing moved
    params, step = restore_params(stage, template)

    # reads a failed orbax restore left pending print no traceback when they end (the filter
    # is in place before the restore starts: one may end before its exception is handled);
    # other unraisable exceptions still do
    def coroutine_of(filename):
        return types.SimpleNamespace(cr_code=types.SimpleNamespace(co_filename=filename))

    for text, obj in [
        ("Event loop is closed", None),
        ("orbax read closed unfinished", coroutine_of("/x/orbax/checkpoint/serialization.py")),
        ("something else", coroutine_of("/x/mine.py")),
    ]:
        sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError(text), object=obj))
    texts = [str(u.exc_value) for u in unraisable]
    assert texts[-1] == "something else"
    assert "Event loop is closed" not in texts and "orbax read closed unfinished" not in texts
    assert step == 1 and os.path.isdir(os.path.join(stage, "2"))
    np.testing.assert_array_equal(params["w"], _tree(1)["w"])
    warned = [r.getMessage() for r in caplog.records if r.name == "agentrl_jax.train.checkpoint"]
    assert warned and all("\n" not in m for m in warned) and "step 2" in warned[0]
    with pytest.raises(UnusableCheckpoint, match="step 2"):
        restore_params(os.path.join(stage, "2"), template)  # that step asked for: no fallback
    # a resume: restored from step 1, step 2 set aside (not deleted) and written again
    with Checkpointer(stage, resume=True) as ck:
        out = ck.restore(params=template, opt_state=_opt(0), set_aside=True)
        assert out["step"] == 1 and [s for s, _ in out["unusable"]] == [2]
        for a, b in zip(jax.tree.leaves(out["opt_state"]), jax.tree.leaves(_opt(11))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert ck.all_steps() == [1]
        ck.save(2, params=_tree(2), opt_state=_opt(12), rng=jax.random.key(0))
    assert os.listdir(os.path.join(tmp_path, "checkpoints", "unusable")) == ["rl-2"]
    assert restore_params(stage, template)[1] == 2


def test_no_intact_checkpoint_or_another_config_is_one_error_and_moves_nothing(tmp_path):
    stage = stage_dir(tmp_path, "rl")
    _save_two(stage)
    wrong = {"w": jnp.zeros((64, 16)), "b": jnp.ones(3, "bfloat16")}
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\] with shape \(64, 32\).*\(64, 16\)"):
        restore_params(stage, wrong)
    for s in (1, 2):
        _flip_byte(os.path.join(stage, str(s)))
    with Checkpointer(stage, resume=True) as ck:
        with pytest.raises(ValueError, match="no intact checkpoint.*step 2: .*; step 1: "):
            ck.restore(params=_tree(0), opt_state=_opt(0), set_aside=True)
    assert sorted(os.listdir(stage)) == ["1", "2"]


KILLED_WRITER = """
import sys, jax, numpy as np
from agentrl_jax.train.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1], max_to_keep=2)
for step in range(1, 100000):
    x = np.random.default_rng(step).standard_normal(1 << 21).astype(np.float32)
    ck.save(step, params={"w": x}, opt_state={"m": x[:8]}, rng=jax.random.key(step))
"""


def test_sigkill_while_a_checkpoint_is_written_resumes_the_previous_step_bitwise(tmp_path):
    """The writer is stopped while a step's temporary folder exists, then SIGKILLed: the
    newest committed step restores bit for bit, and the next save works."""
    stage = str(tmp_path / "rl")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, stage], cwd=ROOT)
    tmp = lambda: [n for n in os.listdir(stage) if "tmp" in n] if os.path.isdir(stage) else []  # noqa: E731
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            if tmp() and [n for n in os.listdir(stage) if n.isdigit()]:
                proc.send_signal(signal.SIGSTOP)
                if tmp():
                    proc.kill()
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.002)
        else:
            pytest.fail("the writer never had a step in progress")
    finally:
        proc.kill()
        proc.wait()
    x = np.zeros(1 << 21, np.float32)
    with Checkpointer(stage, resume=True, max_to_keep=2) as ck:
        out = ck.restore(params={"w": x}, opt_state={"m": x[:8]})
        step = out["step"]
        want = np.random.default_rng(step).standard_normal(1 << 21).astype(np.float32)
        np.testing.assert_array_equal(out["params"]["w"], want)
        np.testing.assert_array_equal(out["opt_state"]["m"], want[:8])
        ck.save(step + 1, params={"w": want}, opt_state={"m": want[:8]}, rng=out["rng"])
    assert restore_params(stage, {"w": x})[1] == step + 1
    assert not tmp()  # the killed write's temporary folder is gone


# ------------------------------------------------------------------------------------- logs
def test_readers_keep_the_last_attempt_of_each_step(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, attempt=1) as w:
        for step in (2, 4):
            w.write(step, {"loss": float(step)}, prefix="sft")
        for step in (1, 2, 3):
            w.write(step, {"reward": 1.0}, prefix="rl")
        w.write(3, {"heldout_success": 0.5}, prefix="eval")
    with MetricsWriter(tmp_path, tensorboard=False, attempt=2) as w:  # resumed RL at step 1
        w.write(2, {"reward": 2.0}, prefix="rl")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["attempt"] for r in rows] == [1] * 6 + [2]
    kept = [
        (r["step"], r["attempt"], next(k for k in r if "/" in k)) for r in latest_attempts(rows)
    ]
    assert kept == [
        (2, 1, "sft/loss"),
        (4, 1, "sft/loss"),
        (1, 1, "rl/reward"),
        (3, 1, "eval/heldout_success"),
        (2, 2, "rl/reward"),
    ]
    series = load_series(tmp_path)
    assert "attempt" not in series
    assert series["rl/reward"][0].tolist() == [1, 2] and series["rl/reward"][1].tolist() == [1, 2]
    tool_rows = [{"step": 1, "attempt": 1}, {"step": 2, "attempt": 1}, {"step": 2, "attempt": 2}]
    assert latest_attempts(tool_rows, stage=lambda r: None) == tool_rows[::2]
    with pytest.raises(ValueError, match="reserved"):
        MetricsWriter(tmp_path, tensorboard=False).write(1, {"attempt": 1})


# --------------------------------------------------------------------------- what is a run
def _fake_run(tmp_path, *sets, rl_steps_done=0):
    """A run directory as `agentrl train` leaves it before any checkpoint (no compute)."""
    run_dir = str(tmp_path / "runs" / "r")
    os.makedirs(run_dir)
    save_config(run_dir, load_config(SMOKE, [*FAST, f"workdir={tmp_path / 'runs'}", *sets]))
    if rl_steps_done:
        os.makedirs(os.path.join(stage_dir(run_dir, "rl"), str(rl_steps_done)))
    return run_dir


def _snapshot(path):
    """Every file under ``path`` with its size and modification time."""
    out = {}
    for r, _, fs in os.walk(path):
        for f in fs:
            st = os.stat(os.path.join(r, f))
            out[os.path.join(r, f)] = (st.st_size, st.st_mtime_ns)
    return out


def test_resume_refuses_what_is_not_a_run(tmp_path, capsys):
    run_dir = _fake_run(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["Qwen3"]}')
    before = _snapshot(tmp_path)
    cases = {
        str(tmp_path / "runs"): f"no config.json; it holds runs, e.g. {run_dir!r}",
        str(tmp_path / "empty"): "is not a run directory: no config.json; a run directory is",
        str(tmp_path / "hf"): "its config.json is not a run's config",
        str(tmp_path / "absent"): "does not exist",
    }
    for path, message in cases.items():
        assert cli.main(["train", SMOKE, "--resume", path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert cli.main(["train"]) == 2 and "needs an experiment SPEC" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


def test_resume_keeps_the_runs_config(tmp_path, capsys):
    run_dir = _fake_run(tmp_path, rl_steps_done=2)
    asked = lambda *sets: load_config(SMOKE, [*FAST, *sets])  # noqa: E731
    with pytest.raises(
        ValueError, match=r"model.d_model=64 \(run: 32\), rl.lr=0.1 \(run: 0.0005\)"
    ):
        runs.resume_config(run_dir, asked("rl.lr=0.1", "model.d_model=64"))
    with pytest.raises(ValueError, match="train.rl_steps=1 is fewer than the 2 RL steps"):
        runs.resume_config(run_dir, asked("train.rl_steps=1"))
    cfg, changes = runs.resume_config(
        run_dir, asked("workdir=/elsewhere", "train.rl_steps=5", "train.eval_every=2")
    )
    assert changes == {"train.eval_every": (0, 2), "train.rl_steps": (2, 5)}
    assert cfg.workdir == str(tmp_path / "runs") and cfg.train.rl_steps == 5
    assert runs.resume_config(run_dir, None) == (runs.load_run_config(run_dir), {})
    # the CLI: one line naming the key, and nothing written into the run
    before = _snapshot(run_dir)
    assert cli.main(["train", "--resume", run_dir, "--set", "sft.steps=9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sft.steps=9 (run: 4)" in err
    assert _snapshot(run_dir) == before
    # accepted changes go to the history, never into config.json
    runs.begin_attempt(run_dir, changes)
    assert json.load(open(os.path.join(run_dir, "config.json")))["train"]["rl_steps"] == 2
    assert runs.load_run_config(run_dir).train.rl_steps == 5
    (row,) = read_jsonl(os.path.join(run_dir, runs.HISTORY_FILE))
    assert row["attempt"] == 1 and row["changes"]["train.rl_steps"] == [2, 5]


def test_a_run_in_use_is_refused_naming_its_holder(tmp_path, capsys):
    run_dir = _fake_run(tmp_path)
    with runs.RunLock(run_dir):
        with pytest.raises(runs.RunBusy, match=f"pid {os.getpid()} on host "):
            runs.RunLock(run_dir).acquire()
        assert cli.main(["train", "--resume", run_dir]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by pid {os.getpid()} on host" in err
    with runs.RunLock(run_dir):  # released: the next process gets it
        pass
    assert not os.path.exists(os.path.join(run_dir, runs.ATTEMPTS_FILE))


# ------------------------------------------------------------------------- user errors: exit 2
BROKEN_EXPERIMENTS = {
    "def get_config(arg=None):\n    return (\n": "bad.py:2: importing the experiment failed: "
    "SyntaxError",
    "import no_such_module_xyz\n": "bad.py:1: importing the experiment failed: ModuleNotFoundError",
    "def get_config(arg=None):\n    return undefined_name\n": "bad.py:2: get_config failed: "
    "NameError",
}


@pytest.mark.parametrize("source, message", list(BROKEN_EXPERIMENTS.items()))
def test_errors_in_an_experiment_file_are_one_line(tmp_path, capsys, monkeypatch, source, message):
    bad = tmp_path / "bad.py"
    bad.write_text(source)
    assert cli.main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    with pytest.raises(ValueError, match="bad.py"):
        cli.main(["--debug", "train", str(bad)])  # --debug keeps the traceback
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="bad.py"):
        cli.main(["train", str(bad)])


def test_os_errors_are_one_line(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert cli.main(["train", SMOKE, "--set", f"workdir={afile / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Not a directory" in err and str(afile) in err

    def denied(workdir, name):
        raise PermissionError(13, "Permission denied", str(workdir))

    monkeypatch.setattr("agentrl_jax.train.main.make_run_dir", denied)
    assert cli.main(["train", SMOKE, "--set", "workdir=/runs"]) == 2
    assert capsys.readouterr().err == "agentrl train: error: Permission denied: '/runs'\n"


def test_plan_refuses_a_mesh_that_cannot_use_the_devices(capsys):
    spec = os.path.join(ROOT, "experiments", "seed_moe_100l.py")
    assert cli.main(["plan", spec, "--devices", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'expert': 8" in err and "cannot use 7 devices" in err


def test_eval_falls_back_and_a_model_mismatch_is_one_line(tmp_path, capsys, monkeypatch):
    run_dir = _fake_run(tmp_path)
    s = build(runs.load_run_config(run_dir))
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    with Checkpointer(stage_dir(run_dir, "rl")) as ck:
        for step in (1, 2):
            ck.save(step, params=params, opt_state={}, rng=jax.random.key(0))
    _flip_byte(os.path.join(stage_dir(run_dir, "rl"), "2"))
    seen = {}

    def evaluate(model, params, ev, **kw):
        seen["params"] = params
        return {"greedy": {"success": 0.0}}

    monkeypatch.setattr("agentrl_jax.train.eval_cli.evaluate_split", evaluate)
    assert cli.main(["eval", run_dir]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step"] == 1 and out["checkpoint"] == stage_dir(run_dir, "rl")
    for a, b in zip(jax.tree.leaves(seen["params"]), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(os.listdir(stage_dir(run_dir, "rl"))) == ["1", "2"]  # eval moves nothing
    assert cli.main(["eval", run_dir, "--set", "model.d_ff=128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the config gives" in err and "(1, 128, 32)" in err, err


# ------------------------------------------------------------------------------ the main job
@pytest.mark.slow
def test_a_run_continued_by_more_steps_then_left_alone_when_finished(tmp_path, capsys, caplog):
    """Attempt 1 trains one RL step and finishes; attempt 2 (``--resume --set
    train.rl_steps=2``) continues it from its checkpoint; attempt 3 finds it finished, says so,
    exits 0 and touches nothing."""
    cfg = load_config(SMOKE, [*FAST, f"workdir={tmp_path}", "train.rl_steps=1"])
    first = run(cfg, progress=False)
    run_dir = first["run_dir"]
    assert tuple(first) == stages.SUMMARY_KEYS
    first_eval = json.load(open(os.path.join(run_dir, "summary.json")))["eval_after"]
    assert cli.main(["train", "--resume", run_dir, "--set", "train.rl_steps=2"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["rl_steps"] == 2 and second["run_dir"] == run_dir
    # the run's config: config.json as it started, the accepted change in the history
    assert json.load(open(os.path.join(run_dir, "config.json")))["train"]["rl_steps"] == 1
    (change,) = read_jsonl(os.path.join(run_dir, runs.HISTORY_FILE))
    assert change["attempt"] == 2 and change["changes"] == {"train.rl_steps": [1, 2]}
    attempts = read_jsonl(os.path.join(run_dir, runs.ATTEMPTS_FILE))
    host = socket.gethostname()
    assert [(a["attempt"], a["pid"], a["host"]) for a in attempts] == [
        (1, os.getpid(), host),
        (2, os.getpid(), host),
    ]
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    logged = [(r["step"], r["attempt"], next(k for k in r if "/" in k)[:3]) for r in rows]
    assert logged == [(1, 1, "rl/"), (1, 1, "eva"), (2, 2, "rl/"), (2, 2, "eva")]
    calls = read_jsonl(os.path.join(run_dir, "tool_calls.jsonl"))
    assert {(r["step"], r["attempt"]) for r in calls} == {(1, 1), (2, 2)}
    stored = json.load(open(os.path.join(run_dir, "summary.json")))
    assert stored["eval_mid"] == {"1": first_eval}  # the first final evaluation is kept
    assert len(stored["entropies"]) == 2 and stored["rl_steps"] == 2
    # finished: nothing runs, nothing is written, the stored summary is the answer
    before = _snapshot(run_dir)
    caplog.clear()
    assert cli.main(["train", "--resume", run_dir]) == 0
    assert json.loads(capsys.readouterr().out) == second
    assert f"run {run_dir} has finished its 2 RL steps; nothing to do" in caplog.text
    assert _snapshot(run_dir) == before
