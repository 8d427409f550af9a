"""``agentrl report``: summary table and PNG curves of a run's ``metrics.jsonl``; sweep helpers.

``agentrl report RUN_DIR`` prints the table (first / last / min / max of every metric, and the
metrics that never changed), and writes into ``RUN_DIR/plots/`` one PNG per metric group, the
table as ``summary.csv`` and ``dashboard.png`` (:mod:`agentrl_jax.dashboard`: held-out success
before and after RL with its paired error bar, and the RL curves a person reads first).
Series that never change are not drawn; tick labels show values, never an offset.

Plots use matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), never pyplot, so no
global backend is switched and nothing needs a display.

Metric groups (one figure each, one panel per metric), matched on the metric name in this order:
``memory`` (memory, bytes), ``throughput`` (per_s, _ms), ``mismatch`` (mismatch, dlogp, k3,
ratio, ess, routing), ``grad_norm``, ``stability`` (skip, nonfinite, fallback), ``losses``
(loss, kl), ``entropy``, ``reward`` (reward, success, adherence, return), else ``other``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agentrl_jax.dashboard import (
    DASHBOARD_FILE,
    constant_series,
    is_constant,
    plain_axes,
    write_dashboard,
)
from agentrl_jax.metrics import METRICS_FILE, RESERVED_KEYS, latest_attempts, read_jsonl, to_float

logger = logging.getLogger(__name__)

PLOTS_DIR = "plots"
SUMMARY_FILE = "summary.json"
SUMMARY_COLUMNS = ("metric", "first", "last", "min", "max", "n")
_GROUP_RULES: tuple[tuple[str, str], ...] = (
    ("memory", r"memory|bytes"),
    ("throughput", r"per_s|_ms$|_s$"),
    ("mismatch", r"mismatch|dlogp|k3|ratio|(^|[/_])ess|routing"),
    ("grad_norm", r"grad_norm"),
    ("stability", r"skip|nonfinite|non_finite|fallback"),
    ("losses", r"loss|(^|[/_])kl"),
    ("entropy", r"entropy"),
    ("reward", r"reward|success|adherence|return"),
)
_PANELS_PER_ROW = 3


def metric_group(name: str) -> str:
    """The figure group of a metric name (see the module docstring)."""
    low = name.lower()
    for group, pattern in _GROUP_RULES:
        if re.search(pattern, low):
            return group
    return "other"


def _resolve_metrics_path(run_dir: str | os.PathLike) -> str:
    run_dir = os.fspath(run_dir)
    if os.path.isfile(run_dir) and run_dir.endswith(".jsonl"):
        return run_dir
    if not os.path.isdir(run_dir):
        raise ValueError(f"run directory {run_dir!r} does not exist")
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"run directory {run_dir!r} has no {METRICS_FILE}")
    return path


def load_series(run_dir: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads a run's numeric metric curves.

    Args:
      run_dir: a run directory (or a ``metrics.jsonl`` path).

    Returns:
      ``{metric: (steps int64[n], values float64[n])}`` in file order; non-finite values logged
      as ``"nan"``/``"inf"`` come back as floats. Non-numeric values are left out. Steps are
      increasing: rows a resumed run superseded are dropped (``metrics.latest_attempts``),
      and when a step is logged again without attempts (files written before rows carried
      them), the later entries replace the earlier ones from that step on.

    Raises:
      ValueError: ``run_dir`` does not exist or holds no ``metrics.jsonl``, or a malformed line.
    """
    records = latest_attempts(read_jsonl(_resolve_metrics_path(run_dir)))
    steps: dict[str, list[int]] = {}
    values: dict[str, list[float]] = {}
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        for key, value in rec.items():
            if key in RESERVED_KEYS:
                continue
            x = to_float(value)
            if x is None:
                continue
            s, v = steps.setdefault(key, []), values.setdefault(key, [])
            # A resumed run re-logs the steps after its last checkpoint: the later write wins.
            while s and s[-1] >= step:
                s.pop()
                v.pop()
            s.append(step)
            v.append(x)
    return {k: (np.asarray(steps[k], np.int64), np.asarray(values[k], np.float64)) for k in steps}


def summarize(series: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
    """One row per metric: ``metric, first, last, min, max, n`` (sorted by metric name).

    ``first``/``last`` are the first/last logged values (NaN shows); ``min``/``max`` ignore
    non-finite values (NaN when there is none); ``n`` counts logged values.
    """
    rows = []
    for name in sorted(series):
        _, v = series[name]
        finite = v[np.isfinite(v)]
        rows.append(
            {
                "metric": name,
                "first": float(v[0]),
                "last": float(v[-1]),
                "min": float(finite.min()) if finite.size else math.nan,
                "max": float(finite.max()) if finite.size else math.nan,
                "n": int(v.size),
            }
        )
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Renders rows of dicts as a plain-text table (numbers right-aligned, floats ``.6g``)."""
    columns = list(columns) if columns is not None else _columns(rows)
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), int | float) for r in rows) and bool(rows) for c in columns]

    def line(items: Sequence[str]) -> str:
        return "  ".join(
            s.rjust(w) if num else s.ljust(w) for s, w, num in zip(items, widths, numeric)
        ).rstrip()

    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    return columns


def _figure(n_panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(n_panels, _PANELS_PER_ROW)
    nrows = math.ceil(n_panels / ncols)
    height = 3.0 * nrows + 0.4
    fig = Figure(figsize=(4.2 * ncols, height))
    FigureCanvasAgg(fig)
    # Fixed margins: matplotlib's constrained/tight layouts double the rendering time.
    fig.subplots_adjust(
        left=0.08, right=0.97, bottom=0.55 / height, top=1 - 0.55 / height, wspace=0.3, hspace=0.5
    )
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def plot_groups(
    series: Mapping[str, tuple[np.ndarray, np.ndarray]], out_dir: str | os.PathLike
) -> list[str]:
    """Writes one PNG per metric group (``<out_dir>/<group>.png``), one panel per metric.

    Metrics that never change are left out (a group of only those gets no PNG).
    Returns the written paths, sorted.
    """
    os.makedirs(out_dir, exist_ok=True)
    groups: dict[str, list[str]] = {}
    for name in sorted(series):
        if not is_constant(series[name][1]):
            groups.setdefault(metric_group(name), []).append(name)
    paths = []
    for group, names in sorted(groups.items()):
        fig, axes = _figure(len(names))
        for ax, name in zip(axes, names):
            steps, values = series[name]
            ax.plot(steps, values, marker="." if steps.size < 50 else None, linewidth=1.2)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            plain_axes(ax)
        fig.suptitle(group)
        path = os.path.join(os.fspath(out_dir), f"{group}.png")
        fig.savefig(path, dpi=90)
        paths.append(path)
    return paths


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`build_report` produced.

    Attributes:
      run_dir: the run directory.
      rows: one summary row per metric (:func:`summarize`).
      table: ``rows`` as a plain-text table.
      plots: the metric-group PNGs.
      dashboard: the dashboard PNG, or None (plots off, or nothing to draw).
      constant: ``{metric: value}`` of the metrics logged more than once that never changed.
    """

    run_dir: str
    rows: list[dict[str, Any]]
    table: str
    plots: list[str]
    dashboard: str | None = None
    constant: dict[str, float] = dataclasses.field(default_factory=dict)


def build_report(run_dir: str | os.PathLike, *, plots: bool = True) -> Report:
    """Summarises ``<run_dir>/metrics.jsonl`` and writes plots into ``<run_dir>/plots/``.

    Also writes ``<run_dir>/plots/summary.csv`` with the table rows, and
    ``<run_dir>/plots/dashboard.png`` (held-out success from ``<run_dir>/summary.json`` when
    the run has one).

    Raises:
      ValueError: missing run directory / metrics file, malformed JSONL or ``summary.json``, or
        no numeric metric.
    """
    series = load_series(run_dir)
    if not series:
        raise ValueError(f"run directory {os.fspath(run_dir)!r}: {METRICS_FILE} has no metrics")
    rows = summarize(series)
    table = format_table(rows, SUMMARY_COLUMNS)
    out_dir = os.path.join(os.fspath(run_dir), PLOTS_DIR)
    written: list[str] = []
    dashboard = None
    if plots:
        written = plot_groups(series, out_dir)
        write_sweep_table(rows, os.path.join(out_dir, "summary.csv"), columns=SUMMARY_COLUMNS)
        summary = _read_summary(run_dir)
        dashboard = write_dashboard(series, summary, os.path.join(out_dir, DASHBOARD_FILE))
    return Report(
        run_dir=os.fspath(run_dir),
        rows=rows,
        table=table,
        plots=written,
        dashboard=dashboard,
        constant=constant_series(series),
    )


def _read_summary(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = os.path.join(os.fspath(run_dir), SUMMARY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e


def write_sweep_table(
    rows: Sequence[Mapping[str, Any]],
    path_csv: str | os.PathLike,
    *,
    columns: Sequence[str] | None = None,
) -> str:
    """Writes ``rows`` (dicts, e.g. point, final success, reward, entropy, wall_s) as CSV.

    Columns are ``columns`` or the union of keys in first-seen order; missing cells are empty.
    Returns the same rows as a plain-text table (for printing).

    Raises:
      ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError(f"no rows to write to {os.fspath(path_csv)!r}")
    columns = list(columns) if columns is not None else _columns(rows)
    parent = os.path.dirname(os.fspath(path_csv))
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path_csv, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in columns})
    return format_table(rows, columns)


def plot_sweep_curves(
    run_dirs: Sequence[str | os.PathLike],
    metric: str,
    path_png: str | os.PathLike,
    *,
    labels: Sequence[str] | None = None,
) -> str:
    """Plots ``metric`` against step for every run in ``run_dirs`` on one axes; returns the path.

    Runs that lack the metric or whose directory is unreadable are skipped with a warning (a
    crashed sweep point must not hide the others).

    Raises:
      ValueError: ``labels`` length differs from ``run_dirs``, or no run has ``metric``.
    """
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"labels has {len(labels)} entries, run_dirs {len(run_dirs)}")
    labels = (
        list(labels) if labels is not None else [os.path.basename(os.fspath(d)) for d in run_dirs]
    )
    fig, axes = _figure(1)
    ax = axes[0]
    plotted = 0
    for run_dir, label in zip(run_dirs, labels):
        try:
            series = load_series(run_dir)
        except ValueError as e:
            logger.warning("sweep plot: skipping %s (%s)", run_dir, e)
            continue
        if metric not in series:
            logger.warning("sweep plot: %s has no metric %r", run_dir, metric)
            continue
        steps, values = series[metric]
        ax.plot(steps, values, label=label, linewidth=1.2)
        plotted += 1
    if not plotted:
        raise ValueError(f"metric {metric!r} is in none of the {len(run_dirs)} run directories")
    ax.set_xlabel("step")
    ax.set_title(metric)
    ax.grid(alpha=0.3)
    plain_axes(ax)
    ax.legend(fontsize=7)
    parent = os.path.dirname(os.fspath(path_png))
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path_png, dpi=90)
    return os.fspath(path_png)


def run_from_cli(args) -> int:
    """``agentrl report <run_dir> [--no-plots]``: prints the table and where the plots went."""
    report = build_report(args.run_dir, plots=not getattr(args, "no_plots", False))
    print(f"run: {report.run_dir}")
    print(report.table)
    if report.constant:
        listed = ", ".join(f"{k}={v:.6g}" for k, v in report.constant.items())
        print(f"constant over the run (not plotted): {listed}")
    if report.plots:
        print(f"plots ({len(report.plots)}): {os.path.dirname(report.plots[0])}")
    if report.dashboard:
        print(f"dashboard: {report.dashboard}")
    return 0
