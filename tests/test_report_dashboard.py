"""``agentrl report``'s dashboard.png on a synthetic run directory."""

import json
import math
import os

import numpy as np
import pytest

from agentrl_jax import dashboard, metrics, report

N = 12


def _summary(run):
    before = {"greedy": [1, 1, 0, 0, 1, 0, 1, 0], "sampled": [1, 0, 0, 0, 1, 0, 1, 0]}
    after = {"greedy": [1, 1, 1, 0, 1, 1, 1, 0], "sampled": [1, 0, 1, 0, 1, 0, 0, 0]}
    evals = {
        name: {
            mode: {"success": float(np.mean(e)), "episode_success": e}
            for mode, e in results.items()
        }
        for name, results in (("eval_before", before), ("eval_after", after))
    }
    from agentrl_jax.train.eval_stats import paired_gain

    gains = {m: paired_gain(evals["eval_before"][m], evals["eval_after"][m]) for m in before}
    return {
        "heldout_success_before_rl": 0.5,
        "heldout_success_after_rl": 0.75,
        "heldout_gain": gains,
        "eval_split": "heldout",
        "run_dir": os.fspath(run),
        **evals,
    }


def _run(tmp_path, with_summary=True):
    rng = np.random.default_rng(0)
    run = metrics.make_run_dir(tmp_path, "dash", timestamp="x")
    with metrics.MetricsWriter(run, tensorboard=False) as w:
        for step in range(1, N + 1):
            w.write(step, {"loss": 3.0 - 0.1 * step, "tokens_per_s": 5000.0 + step}, prefix="sft")
        for step in range(1, N + 1):
            w.write(
                step,
                {
                    "success": 0.5 + 0.02 * step,
                    "entropy": 0.2 - 0.005 * step,
                    # a value next to 1 that moves by 1e-5: ticks must show it, not an offset
                    "mismatch/ratio_p50": 0.99999 + 1e-6 * step,
                    "mismatch/max_abs_dlogp": 0.0 if step == 3 else 10.0 ** -rng.uniform(2, 4),
                    "mismatch/mean_abs_dlogp": 10.0 ** -rng.uniform(5, 7),
                    "mismatch/kl_k3": rng.uniform(0, 1e-7),
                    "approx_kl": 0.0,
                    "skipped": 0.0,
                    "nonfinite_steps": 0.0,
                    "grad_norm": rng.uniform(0.1, 0.8),
                    "rollout_tokens_per_s": rng.uniform(3e3, 1e4),
                    "update_tokens_per_s": rng.uniform(3e3, 1.5e4),
                    "host_peak_rss_bytes": 2e9 + 1e6 * step,
                    "peak_device_memory_bytes": None,
                },
                prefix="rl",
            )
        w.write(N, {"heldout_success": 0.75}, prefix="eval")
    if with_summary:
        with open(os.path.join(run, report.SUMMARY_FILE), "w") as f:
            json.dump(_summary(run), f)
    return run


def test_report_writes_dashboard_and_lists_constant_series(tmp_path, capsys):
    run = _run(tmp_path)
    rep = report.build_report(run)
    assert rep.dashboard == os.path.join(run, report.PLOTS_DIR, dashboard.DASHBOARD_FILE)
    with open(rep.dashboard, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Constant series are listed, not drawn: rl/skipped and rl/nonfinite_steps make up the whole
    # "stability" group, so it gets no PNG; eval/heldout_success (logged once) is not listed.
    assert rep.constant == {"rl/approx_kl": 0.0, "rl/nonfinite_steps": 0.0, "rl/skipped": 0.0}
    assert "stability.png" not in {os.path.basename(p) for p in rep.plots}
    rows = {r["metric"] for r in rep.rows}
    assert {"rl/approx_kl", "rl/skipped", "eval/heldout_success"} <= rows
    report.run_from_cli(type("Args", (), {"run_dir": run})())
    out = capsys.readouterr().out
    assert "constant over the run (not plotted): rl/approx_kl=0, rl/nonfinite_steps=0" in out
    assert f"dashboard: {rep.dashboard}" in out


def test_dashboard_panels_pick_rl_series_and_skip_flat_ones(tmp_path):
    series = report.load_series(_run(tmp_path))
    panels = {p.title: keys for p, keys in dashboard.panel_series(series)}
    assert panels == {
        "training success (sampled rollouts)": ["rl/success"],
        "entropy": ["rl/entropy"],
        "rollout/train mismatch |dlogp|": [
            "rl/mismatch/max_abs_dlogp",
            "rl/mismatch/mean_abs_dlogp",
        ],
        "KL": ["rl/mismatch/kl_k3"],  # rl/approx_kl never changed
        "grad norm": ["rl/grad_norm"],
        "rollout tokens/s": ["rl/rollout_tokens_per_s"],
        "update tokens/s": ["rl/update_tokens_per_s"],  # not sft/tokens_per_s
        "peak memory (MiB)": ["rl/host_peak_rss_bytes"],  # the device peak was never logged
    }


def test_heldout_rows_carry_the_paired_gain(tmp_path):
    rows = dashboard._heldout(_summary(tmp_path))
    assert [r["mode"] for r in rows] == ["greedy", "sampled"]
    g = rows[0]["gain"]
    assert (rows[0]["before"], rows[0]["after"]) == (0.5, 0.75)
    assert (g["fixed"], g["broken"], g["n"]) == (2, 0, 8) and g["delta"] == 0.25
    assert rows[1]["gain"]["fixed"] == 1 and rows[1]["gain"]["broken"] == 1
    # A run still in RL: the evaluation before only.
    rows = dashboard._heldout({"heldout_success_before_rl": 0.7})
    assert rows == [{"mode": "greedy", "before": 0.7, "after": None, "gain": None}]


def test_dashboard_without_summary_or_series(tmp_path):
    run = _run(tmp_path, with_summary=False)
    assert report.build_report(run).dashboard is not None  # curves only
    assert dashboard.write_dashboard({}, None, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plain_axes_show_values_not_an_offset():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot([1, 2, 3], [0.99999, 1.0, 1.00001])
    dashboard.plain_axes(ax)
    fig.canvas.draw()
    assert ax.yaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels)  # each tick its own value
    assert "0.9999875" in labels and "1.0000125" in labels
    assert all(x.isdigit() for x in (t.get_text() for t in ax.get_xticklabels()) if x)


@pytest.mark.parametrize(
    "value, text", [(12500.0, "12,500"), (2.5e-07, "2.5e-07"), (0.99999, "1"), (0.12345, "0.1235")]
)
def test_tick_labels(value, text):
    assert dashboard._tick(value) == text


def test_constant_series_needs_two_points():
    s = {
        "a": (np.arange(3), np.array([1.0, 1.0, math.nan])),
        "b": (np.arange(1), np.array([2.0])),
        "c": (np.arange(2), np.array([math.nan, math.nan])),
        "d": (np.arange(2), np.array([1.0, 2.0])),
    }
    out = dashboard.constant_series(s)
    assert out["a"] == 1.0 and math.isnan(out["c"]) and set(out) == {"a", "c"}
