"""One figure of a run: ``dashboard.png``, the panels a person reads first.

Panels (each drawn only when the run logged it and it changed):
  held-out success  before and after RL per decoding mode (``summary.json``), the paired gain
                    written above the bars and drawn as one paired standard error on the
                    after-RL bar;
  training success, entropy, KL (``approx_kl``, ``mismatch/kl_k3``, ``kl``), grad norm;
  rollout/train mismatch  max and mean |dlogp| per step, log scale (zeros are left out of the
                    log axis and counted in the legend);
  rollout and update throughput (tokens/s), peak memory (device and host, MiB).

RL-stage series are found by name: ``rl/<name>`` first, else ``<prefix>/<name>`` under any
prefix but ``eval`` and ``sft``, else ``<name>``. A series whose finite values never change is
not drawn: it is listed in the figure's last panel and in :func:`constant_series`, so a flat
line never stands in for a value. Tick labels are the values themselves, never an offset or a
shared exponent (``plain_axes``).

Plots use matplotlib's Agg canvas directly (``matplotlib.figure.Figure``), never pyplot.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DASHBOARD_FILE = "dashboard.png"
_EXCLUDED_PREFIXES = ("eval/", "sft/")
_MAX_LISTED = 24
_MIB = 2.0**-20

Series = Mapping[str, tuple[np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Panel:
    """One dashboard panel: a title and the series names it draws (see the module docstring)."""

    title: str
    names: tuple[str, ...]
    log: bool = False
    scale: float = 1.0


PANELS = (
    Panel("training success (sampled rollouts)", ("success",)),
    Panel("entropy", ("entropy",)),
    Panel(
        "rollout/train mismatch |dlogp|",
        ("mismatch/max_abs_dlogp", "mismatch/mean_abs_dlogp"),
        log=True,
    ),
    Panel("KL", ("approx_kl", "mismatch/kl_k3", "mismatch/k3_kl", "kl")),
    Panel("grad norm", ("grad_norm", "grad_norm_max")),
    Panel("rollout tokens/s", ("rollout_tokens_per_s",)),
    Panel("update tokens/s", ("update_tokens_per_s", "tokens_per_s")),
    Panel(
        "peak memory (MiB)",
        ("peak_device_memory_bytes", "host_peak_rss_bytes"),
        scale=_MIB,
    ),
)


def find_series(series: Series, name: str) -> str | None:
    """The logged key that holds the RL stage's ``name`` (``rl/name`` first), or None."""
    if f"rl/{name}" in series:
        return f"rl/{name}"
    for key in sorted(series):
        if key.endswith("/" + name) and not key.startswith(_EXCLUDED_PREFIXES):
            if key.count("/") == name.count("/") + 1:  # '<prefix>/<name>', not deeper
                return key
    return name if name in series else None


def is_constant(values: np.ndarray) -> bool:
    """Whether a series never changes: its finite values are all equal (or there are none)."""
    finite = values[np.isfinite(values)]
    return finite.size == 0 or bool(np.all(finite == finite[0]))


def constant_series(series: Series, *, min_points: int = 2) -> dict[str, float]:
    """``{name: value}`` of every series logged at least ``min_points`` times that never
    changes (the value is NaN when it has no finite one)."""
    out = {}
    for name in sorted(series):
        v = series[name][1]
        if v.size >= min_points and is_constant(v):
            finite = v[np.isfinite(v)]
            out[name] = float(finite[0]) if finite.size else math.nan
    return out


def panel_series(series: Series) -> list[tuple[Panel, list[str]]]:
    """The curve panels to draw and the logged keys each draws: a panel's series that were
    logged and change; panels with none are left out."""
    out = []
    for panel in PANELS:
        keys = dict.fromkeys(k for n in panel.names if (k := find_series(series, n)))
        keys = [k for k in keys if not is_constant(series[k][1])]
        if keys:
            out.append((panel, keys))
    return out


def _tick(value: float, digits: int = 4) -> str:
    """A tick label: whole numbers in full (``12,500``), others to ``digits`` significant
    digits (``0.1235``, ``2.5e-07``)."""
    if value == int(value) and abs(value) < 1e9:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _value_formatter():
    """A matplotlib formatter that labels each tick with its own value, with as many digits as
    the ticks need to differ (``0.99999``, ``1``, ``1.00001``), never an offset."""
    from matplotlib.ticker import Formatter

    class ValueFormatter(Formatter):
        def __call__(self, x, pos=None):
            return _tick(x)

        def format_ticks(self, values):
            v = np.asarray(values, float)
            steps = np.diff(np.sort(v))
            steps = steps[steps > 0]
            digits = 4
            if steps.size and np.abs(v).max() > 0:
                # enough significant digits to resolve the tick spacing at the largest value
                span = math.floor(math.log10(np.abs(v).max())) - math.floor(math.log10(steps.min()))
                digits = min(max(digits, span + 2), 15)
            return [_tick(x, digits) for x in values]

    return ValueFormatter()


def plain_axes(ax, *, integer_x: bool = True) -> None:
    """Tick labels that show the values themselves (no offset, no shared exponent)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if ax.get_yscale() == "linear":
        ax.yaxis.set_major_formatter(_value_formatter())
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:.0f}"))


def _heldout(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per decoding mode: before, after (fractions or None) and the paired gain dict."""
    before_all = summary.get("eval_before") or {}
    after_all = summary.get("eval_after") or {}
    gains = summary.get("heldout_gain") or {}
    flat = {
        "greedy": ("heldout_success_before_rl", "heldout_success_after_rl"),
        "sampled": ("heldout_sampled_success_before_rl", "heldout_sampled_success_after_rl"),
    }
    out = []
    for mode, (kb, ka) in flat.items():
        before = (before_all.get(mode) or {}).get("success", summary.get(kb))
        after = (after_all.get(mode) or {}).get("success", summary.get(ka))
        if before is None and after is None:
            continue
        out.append({"mode": mode, "before": before, "after": after, "gain": gains.get(mode)})
    return out


def _draw_heldout(ax, rows: Sequence[Mapping[str, Any]], split: str) -> None:
    x = np.arange(len(rows))
    w = 0.38
    ticks, labels = [], []
    for i, r in enumerate(rows):
        for dx, key, color in ((-w / 2, "before", "#9aa5b1"), (w / 2, "after", "#1f77b4")):
            ticks.append(x[i] + dx)
            labels.append(f"{r['mode']}\n{key} RL")
            if r[key] is None:
                continue
            yerr = None
            if key == "after" and r["gain"]:
                yerr = 100 * r["gain"]["stderr"]
            ax.bar(x[i] + dx, 100 * r[key], w, color=color, yerr=yerr, capsize=4)
            ax.text(x[i] + dx, 2, f"{100 * r[key]:.1f}", ha="center", fontsize=8, color="white")
        g = r["gain"]
        if g:
            text = (
                f"{100 * g['delta']:+.1f} ± {100 * g['stderr']:.1f} pts\n"
                f"{g['fixed']} fixed / {g['broken']} broken of {g['n']}"
            )
        else:
            text = "no evaluation after RL" if r["after"] is None else "no paired gain"
        ax.text(x[i], 103, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("success (%)", fontsize=8)
    ax.set_title(f"{split} success before / after RL (error bar: paired s.e.)", fontsize=9)


def _draw_series(ax, panel: Panel, drawn: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> None:
    for key, steps, values in drawn:
        v = values * panel.scale
        label = key
        if panel.log:
            keep = v > 0
            if not keep.all():
                n = int((~keep).sum())
                label += f" (0 at {n} step{'s' if n > 1 else ''}, not shown)"
            steps, v = steps[keep], v[keep]
        ax.plot(steps, v, marker="." if steps.size < 50 else None, linewidth=1.2, label=label)
    if panel.log:
        ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("RL step", fontsize=8)
    ax.legend(fontsize=6)
    plain_axes(ax)


def _draw_constants(ax, constants: Mapping[str, float]) -> None:
    ax.axis("off")
    items = [f"{k} = {v:.6g}" for k, v in constants.items()]
    if len(items) > _MAX_LISTED:
        items = items[: _MAX_LISTED - 1] + [f"... {len(constants) - _MAX_LISTED + 1} more"]
    ax.set_title("constant over the run (not drawn)", fontsize=9)
    ax.text(0, 1, "\n".join(items) or "none", va="top", fontsize=6, family="monospace")


def write_dashboard(
    series: Series, summary: Mapping[str, Any] | None, path_png: str | os.PathLike
) -> str | None:
    """Draws the dashboard of one run into ``path_png``; returns the path, or None when there
    is nothing to draw (no panel's series logged and no held-out evaluation).

    Args:
      series: ``{metric: (steps, values)}`` as ``report.load_series`` returns it.
      summary: the run's ``summary.json`` contents, or None.
      path_png: where to write the PNG (its directory is created).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    heldout = _heldout(summary or {})
    consts = {
        k: v for k, v in constant_series(series).items() if not k.startswith(_EXCLUDED_PREFIXES)
    }
    panels = [(p, [(k, *series[k]) for k in keys]) for p, keys in panel_series(series)]
    if not panels and not heldout:
        return None
    n = len(panels) + bool(heldout) + bool(consts)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.3 * nrows))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.06, top=0.93, wspace=0.28, hspace=0.45)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n:]:
        ax.set_visible(False)
    if heldout:
        _draw_heldout(axes.pop(0), heldout, (summary or {}).get("eval_split") or "held-out")
    for panel, drawn in panels:
        _draw_series(axes.pop(0), panel, drawn)
    if consts:
        _draw_constants(axes.pop(0), consts)
    run = (summary or {}).get("run_dir")
    fig.suptitle(os.path.basename(os.fspath(run)) if run else "run dashboard", fontsize=11)
    parent = os.path.dirname(os.fspath(path_png))
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path_png, dpi=90)
    return os.fspath(path_png)
