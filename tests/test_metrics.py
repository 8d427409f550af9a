"""Run directories, JSONL/TensorBoard metrics, progress bar, memory, and the report."""

import json
import math
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax import metrics, report


def _tb_scalars(logdir):
    """Reads scalar summaries back from TFRecord event files: {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2

    out = {}
    files = [f for f in os.listdir(logdir) if f.startswith("events.out.tfevents")]
    assert files, f"no event file in {logdir}"
    for name in files:
        with open(os.path.join(logdir, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_make_run_dir_never_overwrites(tmp_path):
    paths = [metrics.make_run_dir(tmp_path / "runs", "exp", timestamp="20250101-000000")]
    marker = os.path.join(paths[0], "keep.txt")
    with open(marker, "w") as f:
        f.write("precious")
    paths += [metrics.make_run_dir(tmp_path / "runs", "exp", timestamp="20250101-000000")]
    paths += [metrics.make_run_dir(tmp_path / "runs", "exp", timestamp="20250101-000000")]
    assert len(set(paths)) == 3
    assert [os.path.basename(p) for p in paths] == [
        "exp-20250101-000000",
        "exp-20250101-000000-1",
        "exp-20250101-000000-2",
    ]
    assert open(marker).read() == "precious"
    assert os.listdir(paths[1]) == []
    default = metrics.make_run_dir(tmp_path / "runs", "exp")
    assert os.path.basename(default).startswith("exp-2")


@pytest.mark.parametrize("bad", ["", "a/b", ".."])
def test_make_run_dir_rejects_bad_name(tmp_path, bad):
    with pytest.raises(ValueError, match="run name"):
        metrics.make_run_dir(tmp_path, bad)


def test_metrics_jsonl_roundtrip_and_tensorboard(tmp_path):
    rng = np.random.default_rng(0)
    loss = rng.normal(size=3).astype(np.float32)
    run = metrics.make_run_dir(tmp_path, "rt")
    with metrics.MetricsWriter(run) as w:
        for step in range(3):
            w.write(
                step,
                {
                    "loss": jnp.asarray(loss[step]),
                    "grad_norm": np.float64(loss[step] * 2),
                    "tokens": np.int64(100 + step),
                },
                prefix="train",
            )
            # each step is on disk before the writer closes (a running job can be watched)
            assert len(metrics.read_jsonl(w.path)) == step + 1
        w.write(
            3,
            {"loss": float("nan"), "kl": float("inf"), "note": "switch", "x": None},
            prefix="train/",
        )
    # Resume: a second writer appends instead of truncating.
    with metrics.MetricsWriter(run, tensorboard=False) as w:
        w.write(4, {"success": True})
    recs = metrics.read_jsonl(os.path.join(run, metrics.METRICS_FILE))
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    for step in range(3):
        assert recs[step]["train/loss"] == pytest.approx(float(loss[step]), rel=1e-7)
        assert recs[step]["train/tokens"] == 100 + step
        assert isinstance(recs[step]["train/tokens"], int)
    assert recs[3]["train/loss"] == "nan" and recs[3]["train/kl"] == "inf"
    assert recs[3]["train/note"] == "switch" and recs[3]["train/x"] is None
    assert recs[4]["success"] is True
    with open(os.path.join(run, metrics.METRICS_FILE)) as f:
        for line in f:
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert math.isnan(metrics.to_float("nan")) and metrics.to_float("-inf") == -math.inf

    tb = _tb_scalars(os.path.join(run, metrics.TB_DIR))
    assert [s for s, _ in tb["train/loss"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([v for _, v in tb["train/loss"][:3]], loss, rtol=1e-6)
    assert math.isnan(tb["train/loss"][3][1])
    assert "train/note" not in tb and "train/x" not in tb


def test_metrics_writer_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        metrics.MetricsWriter(tmp_path / "missing")
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match="'train/v' must be a scalar"):
            w.write(0, {"v": np.ones(3)}, prefix="train")
        with pytest.raises(ValueError, match="reserved"):
            w.write(0, {"step": 1})
        with pytest.raises(ValueError, match="step must be >= 0"):
            w.write(-1, {"a": 1.0})
    disabled = metrics.MetricsWriter(tmp_path / "nowhere", enabled=False)
    disabled.write(0, {"a": 1.0})
    disabled.close()
    assert not os.path.exists(tmp_path / "nowhere")


def test_jsonl_writer_tool_log_and_truncated_line(tmp_path):
    path = tmp_path / "sub" / "tool_calls.jsonl"
    with metrics.JsonlWriter(path) as w:
        w.write({"turn": np.int32(1), "tool": "run_tests", "args": {"k": [np.float32(0.5)]}})
        w.write({"turn": 2, "tool": "edit", "args": {"x": float("nan")}})
    with open(path, "a") as f:
        f.write('{"turn": 3, "to')  # a run killed mid-write
    recs = metrics.read_jsonl(path)
    assert recs == [
        {"turn": 1, "tool": "run_tests", "args": {"k": [0.5]}},
        {"turn": 2, "tool": "edit", "args": {"x": "nan"}},
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        metrics.read_jsonl(bad)


def test_save_config(tmp_path):
    import ml_collections

    cfg = ml_collections.ConfigDict({"name": "x", "model": {"pattern": ("S", "F"), "lr": 1e-3}})
    path = metrics.save_config(tmp_path, cfg)
    assert os.path.basename(path) == metrics.CONFIG_FILE
    assert metrics.load_config_json(tmp_path) == {
        "name": "x",
        "model": {"pattern": ["S", "F"], "lr": 1e-3},
    }
    with pytest.raises(ValueError, match="does not exist"):
        metrics.load_config_json(tmp_path / "nope")


def test_progress_bar_disabled_and_enabled(monkeypatch, capsys):
    monkeypatch.setenv(metrics.NO_PROGRESS_ENV, "1")
    assert not metrics.progress_enabled()
    with metrics.ProgressBar(5) as bar:
        bar.update(1, loss=0.5)
    assert capsys.readouterr().err == ""
    with metrics.ProgressBar(4, desc="rl", enabled=True) as bar:
        bar.update(2, loss=jnp.float32(0.25), note="hi")
    err = capsys.readouterr().err
    assert "rl" in err and "loss=0.25" in err and "2/4" in err
    with pytest.raises(ValueError, match="total"):
        metrics.ProgressBar(-1)


def test_memory_metrics():
    m = metrics.memory_metrics()
    keys = {"peak_device_memory_bytes", "peak_device_memory_fraction", "host_peak_rss_bytes"}
    assert set(m) == keys
    assert m["host_peak_rss_bytes"] > 1 << 20  # a Python process with jax uses > 1 MiB
    peak = m["peak_device_memory_bytes"]
    assert peak is None or peak > 0


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_peak_memory_fraction_and_watermark_warning(caplog, monkeypatch):
    monkeypatch.setattr(metrics, "_warned_fraction", [0.0])
    cpu = _Device(None)  # backends without memory stats report nothing
    assert metrics.peak_device_memory_fraction([cpu]) is None
    low = _Device({"peak_bytes_in_use": 40, "bytes_limit": 100})
    high = _Device({"peak_bytes_in_use": 90, "bytes_limit": 100})
    with caplog.at_level("WARNING", logger="agentrl_jax.metrics"):
        assert metrics.peak_device_memory_fraction([low]) == 0.4
        assert not caplog.records
        assert metrics.peak_device_memory_fraction([low, high]) == 0.9  # the highest device
        assert metrics.peak_device_memory_fraction([high]) == 0.9  # warned once at 90%
    assert len(caplog.records) == 1 and "90.0% of capacity" in caplog.records[0].getMessage()


def _synthetic_run(tmp_path, n=20):
    rng = np.random.default_rng(1)
    run = metrics.make_run_dir(tmp_path, "rep", timestamp="x")
    reward = np.cumsum(rng.uniform(0, 0.1, n))
    with metrics.MetricsWriter(run, tensorboard=False) as w:
        for step in range(n):
            w.write(
                step,
                {
                    "reward": reward[step],
                    "success": float(step % 2),
                    "entropy": 2.0 - 0.01 * step,
                    "loss": float("nan") if step == 5 else rng.normal(),
                    "grad_norm": rng.uniform(0.5, 2),
                    "mismatch/k3_kl": rng.uniform(0, 1e-3),
                    "tokens_per_s": rng.uniform(1e3, 2e3),
                    "peak_device_memory_bytes": None,
                    "host_peak_rss_bytes": 1e9 + step,
                },
                prefix="train",
            )
    return run, reward


def test_report_table_and_plots(tmp_path):
    run, reward = _synthetic_run(tmp_path)
    rep = report.build_report(run)
    rows = {r["metric"]: r for r in rep.rows}
    assert rows["train/reward"]["first"] == pytest.approx(reward[0])
    assert rows["train/reward"]["last"] == pytest.approx(reward[-1])
    assert rows["train/reward"]["min"] == pytest.approx(reward.min())
    assert rows["train/reward"]["max"] == pytest.approx(reward.max())
    assert rows["train/reward"]["n"] == 20
    assert rows["train/loss"]["n"] == 20 and math.isfinite(rows["train/loss"]["min"])
    assert "train/peak_device_memory_bytes" not in rows
    assert rep.table.splitlines()[0].split() == list(report.SUMMARY_COLUMNS)
    assert "train/entropy" in rep.table
    names = sorted(os.path.basename(p) for p in rep.plots)
    assert names == [
        "entropy.png",
        "grad_norm.png",
        "losses.png",
        "memory.png",
        "mismatch.png",
        "reward.png",
        "throughput.png",
    ]
    for p in rep.plots:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(run, report.PLOTS_DIR, "summary.csv"))


def test_report_bad_run_dir(tmp_path):
    with pytest.raises(ValueError, match="'.*missing' does not exist"):
        report.build_report(tmp_path / "missing")
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        report.build_report(tmp_path)


def test_sweep_table_and_curves(tmp_path):
    run_a, _ = _synthetic_run(tmp_path / "a", n=5)
    run_b, _ = _synthetic_run(tmp_path / "b", n=7)
    rows = [
        {"point": "lr=1e-5", "heldout_success": 0.5, "reward": 0.25, "wall_s": 3.0},
        {"point": "lr=3e-5", "heldout_success": 0.75, "entropy": 1.5, "wall_s": 4.0},
    ]
    text = report.write_sweep_table(rows, tmp_path / "sweep" / "table.csv")
    with open(tmp_path / "sweep" / "table.csv") as f:
        lines = f.read().splitlines()
    assert lines == [
        "point,heldout_success,reward,wall_s,entropy",
        "lr=1e-5,0.5,0.25,3.0,",
        "lr=3e-5,0.75,,4.0,1.5",
    ]
    assert "lr=3e-5" in text and text.splitlines()[0].split()[0] == "point"
    png = report.plot_sweep_curves(
        [run_a, run_b, tmp_path / "crashed"], "train/reward", tmp_path / "sweep" / "r.png"
    )
    with open(png, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with pytest.raises(ValueError, match="'nope' is in none"):
        report.plot_sweep_curves([run_a], "nope", tmp_path / "x.png")
    with pytest.raises(ValueError, match="no rows"):
        report.write_sweep_table([], tmp_path / "e.csv")


def test_metric_groups():
    assert report.metric_group("train/kv_bytes") == "memory"
    assert report.metric_group("rollout/tokens_per_s") == "throughput"
    assert report.metric_group("mismatch/max_abs_dlogp") == "mismatch"
    assert report.metric_group("train/kl_loss") == "losses"
    assert report.metric_group("train/skipped_steps") == "stability"
    assert report.metric_group("eval/goal_adherence") == "reward"
    assert report.metric_group("lr") == "other"


def test_load_series_resumed_run_later_writes_win(tmp_path):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(5):
            w.write(step, {"loss": float(step)})
    # Resumed from a checkpoint at step 2: steps 3 and 4 are logged again with new values.
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(3, 6):
            w.write(step, {"loss": 10.0 + step})
    steps, values = report.load_series(tmp_path)["loss"]
    assert steps.tolist() == [0, 1, 2, 3, 4, 5]
    assert values.tolist() == [0.0, 1.0, 2.0, 13.0, 14.0, 15.0]
