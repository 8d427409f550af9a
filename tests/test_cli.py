"""The ``agentrl`` dispatcher: parsing, lazy dispatch, clean errors, report and bench."""

import os
import subprocess
import sys
import types

import pytest

from agentrl_jax import cli, metrics


def test_parses_every_subcommand():
    p = cli.build_parser()
    a = p.parse_args(["train", "experiments/x.py:smoke=True", "--set", "a.b=1", "--set", "c=x"])
    assert (a.command, a.spec, a.overrides, a.resume) == (
        "train",
        "experiments/x.py:smoke=True",
        ["a.b=1", "c=x"],
        None,
    )
    a = p.parse_args(["train", "--resume", "runs/r", "--set", "train.rl_steps=80"])
    assert (a.spec, a.resume, a.overrides, a.debug) == (
        None,
        "runs/r",
        ["train.rl_steps=80"],
        False,
    )
    assert p.parse_args(["--debug", "train", "x.py"]).debug
    a = p.parse_args(
        ["eval", "runs/r", "--split", "heldout", "--difficulty", "3", "--episodes", "8"]
    )
    assert (a.run_dir_or_checkpoint, a.split, a.difficulty, a.episodes) == (
        "runs/r",
        "heldout",
        "3",
        8,
    )
    assert a.spec is None and a.overrides == []
    a = p.parse_args(["sweep", "experiments/x.py", "--set", "seed=2"])
    assert (a.command, a.overrides) == ("sweep", ["seed=2"])
    a = p.parse_args(["plan", "experiments/m.py", "--devices", "256"])
    assert (a.spec, a.devices, a.overrides) == ("experiments/m.py", 256, [])
    a = p.parse_args(["bench", "rollout", "--fast", "-n", "3"])
    assert (a.name, a.bench_args) == ("rollout", ["--fast", "-n", "3"])
    a = cli.parse_args(["plan", "m.py", "--set", "model.n_layers=8"])
    assert a.overrides == a.set == ["model.n_layers=8"]
    a = p.parse_args(["report", "runs/r", "--no-plots"])
    assert (a.run_dir, a.no_plots) == ("runs/r", True)


@pytest.mark.parametrize(
    "argv",
    [["frobnicate"], [], ["plan", "x.py", "--devices", "0"], ["eval", "r", "--episodes", "x"]],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage: agentrl" in capsys.readouterr().err


def test_missing_implementation_is_clean_error(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "train", "agentrl_jax.train._does_not_exist")
    assert cli.main(["train", "experiments/x.py"]) == 2
    err = capsys.readouterr().err
    assert "'agentrl train' is not available yet" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "fake_no_entry", types.ModuleType("fake_no_entry"))
    monkeypatch.setitem(cli.COMMANDS, "plan", "fake_no_entry")
    assert cli.main(["plan", "experiments/x.py"]) == 2
    assert "has no run_from_cli" in capsys.readouterr().err


def test_value_error_is_one_line_and_args_reach_impl(monkeypatch, capsys):
    seen = {}

    def run_from_cli(args):
        seen["args"] = args
        if args.overrides:
            raise ValueError("unknown config key 'model.nope'\n(no 'model.nope')")
        return 0

    fake = types.ModuleType("fake_sweep")
    fake.run_from_cli = run_from_cli
    monkeypatch.setitem(sys.modules, "fake_sweep", fake)
    monkeypatch.setitem(cli.COMMANDS, "sweep", "fake_sweep")
    assert cli.main(["sweep", "experiments/x.py:a=1"]) == 0
    assert seen["args"].spec == "experiments/x.py:a=1"
    assert cli.main(["sweep", "experiments/x.py", "--set", "model.nope=1"]) == 2
    err = capsys.readouterr().err
    assert err == "agentrl sweep: error: unknown config key 'model.nope' (no 'model.nope')\n"
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="model.nope"):
        cli.main(["sweep", "experiments/x.py", "--set", "model.nope=1"])


def test_report_command(tmp_path, capsys):
    run = metrics.make_run_dir(tmp_path, "r", timestamp="t")
    with metrics.MetricsWriter(run, tensorboard=False) as w:
        for step, value in enumerate([0.25, 0.5, 0.125]):
            w.write(step, {"reward": value}, prefix="train")
    assert cli.main(["report", run, "--no-plots"]) == 0
    out = capsys.readouterr().out
    row = [line.split() for line in out.splitlines() if line.startswith("train/reward")]
    assert row == [["train/reward", "0.25", "0.125", "0.125", "0.5", "3"]]
    assert not os.path.exists(os.path.join(run, "plots"))
    missing = str(tmp_path / "no_such_run")
    assert cli.main(["report", missing]) == 2
    err = capsys.readouterr().err
    assert missing in err and "does not exist" in err


def test_bench_runs_script_with_this_python(tmp_path, monkeypatch, capsys):
    bench_dir = tmp_path / "benchmarks"
    bench_dir.mkdir()
    out_file = tmp_path / "out.txt"
    (bench_dir / "hello.py").write_text(
        "import sys\n"
        f"open({str(out_file)!r}, 'w').write(sys.executable + '|' + ' '.join(sys.argv[1:]))\n"
        "sys.exit(3)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "hello", "--", "--reps", "2"]) == 3
    exe, args = out_file.read_text().split("|")
    assert os.path.realpath(exe) == os.path.realpath(sys.executable) and args == "--reps 2"
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "hello" in err


def test_module_entry_point_subprocess(tmp_path):
    missing = str(tmp_path / "absent")
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl_jax.cli", "report", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"agentrl report: error: run directory {missing!r} does not exist"
    )
