"""Run bookkeeping: run directories, metrics writers (JSONL + TensorBoard), progress, memory.

A run directory holds everything one run writes::

    runs/<name>-YYYYmmdd-HHMMSS[-k]/
      config.json        the resolved config (:func:`save_config`)
      metrics.jsonl      one JSON object per :meth:`MetricsWriter.write` call
      tb/                TensorBoard event files (scalars only)
      tool_calls.jsonl   every tool call of the RL rollouts, with its step and attempt
      hack_suspects.jsonl  each episode the reward-hack check flagged, whole (``train/rl_loop``)
      plots/             written by ``agentrl report`` (:mod:`agentrl_jax.report`)
      run.lock, attempts.jsonl, config_history.jsonl, summary.json, checkpoints/
                         the training job's (``train/runs.py``, ``train/checkpoint.py``)

JSONL format: each line is ``{"step": int, "time": unix_seconds, "<prefix>/<key>": value, ...}``,
plus ``"attempt": int`` when the writer is given one (the process's attempt at the run: a
resumed run replays the steps after its checkpoint, and :func:`latest_attempts` keeps the
replay's rows).
Values are JSON numbers, bools, strings or ``null``. JAX/NumPy scalars (and size-1 arrays) are
converted to Python numbers. Non-finite floats are written as the *strings* ``"nan"``, ``"inf"``
and ``"-inf"`` (strict JSON has no NaN), so a divergence stays visible in the log;
:func:`read_jsonl` leaves them as strings and :func:`to_float` turns them back into floats.
``None`` is written as ``null`` and skipped in TensorBoard.

Files are opened in append mode: resuming a run into the same directory continues its logs and
never truncates them; readers drop the superseded rows (:func:`latest_attempts`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
TB_DIR = "tb"
NO_PROGRESS_ENV = "AGENTRL_NO_PROGRESS"
RESERVED_KEYS = ("step", "time", "attempt")
_MAX_SUFFIX = 1000


def make_run_dir(workdir: str | os.PathLike, name: str, *, timestamp: str | None = None) -> str:
    """Creates a fresh run directory ``<workdir>/<name>-YYYYmmdd-HHMMSS[-k]`` and returns its path.

    Never reuses an existing directory: each candidate is created with ``os.mkdir`` (atomic,
    fails if it exists) and on a clash the suffix ``-1``, ``-2``, ... is tried.

    Args:
      workdir: parent directory; created if missing.
      name: run name; non-empty, no path separators.
      timestamp: overrides the local-time stamp (tests, reproducible names).

    Raises:
      ValueError: empty ``name`` or one containing a path separator.
    """
    if not name or os.sep in name or (os.altsep and os.altsep in name) or name in (".", ".."):
        raise ValueError(f"run name {name!r} must be non-empty and contain no path separator")
    os.makedirs(workdir, exist_ok=True)
    stamp = timestamp if timestamp is not None else time.strftime("%Y%m%d-%H%M%S")
    base = os.path.join(os.fspath(workdir), f"{name}-{stamp}")
    for k in range(_MAX_SUFFIX):
        path = base if k == 0 else f"{base}-{k}"
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"could not create a new run directory after {_MAX_SUFFIX} tries: {base}")


def to_jsonable(value: Any, *, key: str = "value") -> Any:
    """Converts a metric value into a JSON-safe Python value (see the module docstring).

    Accepts Python/NumPy/JAX scalars, size-1 arrays, bools, strings and ``None``. Non-finite
    floats become ``"nan"``, ``"inf"`` or ``"-inf"``.

    Raises:
      ValueError: a non-scalar array or an unsupported type (message names ``key``).
    """
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _float(float(value))
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy or jax array
        arr = np.asarray(value)
        if arr.size != 1:
            raise ValueError(f"metric {key!r} must be a scalar, got an array of shape {arr.shape}")
        item = arr.reshape(()).item()
        return to_jsonable(item, key=key)
    raise ValueError(f"metric {key!r} has unsupported type {type(value).__name__}")


def _float(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def to_float(value: Any) -> float | None:
    """Reads a logged value back as a float: numbers, bools and ``"nan"``/``"inf"``/``"-inf"``.

    Returns ``None`` for anything else (``null``, other strings).
    """
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


class JsonlWriter:
    """Appends one JSON object per line to ``path`` (e.g. per-turn tool logs).

    Use as a context manager or call :meth:`close`. Values go through :func:`to_jsonable` at the
    top level; nested lists/dicts are converted recursively (unknown objects become their repr).
    """

    def __init__(self, path: str | os.PathLike):
        parent = os.path.dirname(os.fspath(path))
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.path = os.fspath(path)
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends ``record`` as one line. Raises ``ValueError`` for unsupported values."""
        if self._file is None:
            raise ValueError(f"JsonlWriter({self.path!r}) is closed")
        out = {}
        for k, v in record.items():
            out[str(k)] = (
                plain(v) if isinstance(v, Mapping | list | tuple) else to_jsonable(v, key=str(k))
            )
        self._file.write(json.dumps(out, allow_nan=False) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a JSONL file written by :class:`JsonlWriter` / :class:`MetricsWriter`.

    A truncated *last* line (a run killed mid-write) is skipped with a warning.

    Raises:
      ValueError: the file is missing, or a line other than the last is not a JSON object
        (message names the file and line number).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"JSONL file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                logger.warning("%s: skipping truncated last line %d", path, i + 1)
                break
            raise ValueError(f"{path}:{i + 1}: malformed JSONL line ({e})") from None
        records.append(rec)
    return records


def _metric_stage(record: Mapping[str, Any]) -> str:
    """The prefix of a metrics row's keys (``rl``, ``eval``, ``sft``; ``""`` without one)."""
    for key in record:
        if key not in RESERVED_KEYS:
            return key.split("/", 1)[0] if "/" in key else ""
    return ""


def latest_attempts(
    records: Sequence[Mapping[str, Any]], stage: Callable[[Mapping[str, Any]], Any] = _metric_stage
) -> list[Mapping[str, Any]]:
    """The rows of a run's JSONL log that its last attempts stand by, in file order.

    A resumed run (a later ``attempt``) replays a stage from its checkpoint, say from step
    ``m``: rows an earlier attempt wrote for that stage at step ``m`` or later belong to a
    discarded history and are dropped; everything else is kept. Rows without ``attempt``
    count as attempt 0.

    Args:
      records: rows with ``step`` (and ``attempt``), as :func:`read_jsonl` returns them.
      stage: a row's stage (default: its metric prefix, so SFT, RL and evaluation rows of one
        step are told apart); ``lambda r: None`` for a log of one stage (``tool_calls.jsonl``).
    """
    first: dict[tuple[Any, int], int] = {}  # (stage, attempt) -> first step it wrote
    for r in records:
        key = (stage(r), int(r.get("attempt", 0)))
        first[key] = min(first.get(key, r["step"]), r["step"])
    cut: dict[tuple[Any, int], float] = {}  # rows at or after this step are superseded
    for g, a in first:
        later = [s for (h, b), s in first.items() if h == g and b > a]
        cut[(g, a)] = min(later, default=math.inf)
    return [r for r in records if r["step"] < cut[(stage(r), int(r.get("attempt", 0)))]]


class MetricsWriter:
    """Writes scalar metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard (``<run_dir>/tb``).

    ``write(step, {"loss": x}, prefix="train")`` appends ``{"step": step, "time": t,
    "train/loss": x}``. TensorBoard gets every numeric value (bools as 0/1, non-finite floats
    as-is); strings and ``None`` go to JSONL only. On multi-host runs pass
    ``enabled=(jax.process_index() == 0)`` so only one process writes.

    Args:
      run_dir: an existing run directory.
      tensorboard: also write TensorBoard event files (needs ``tensorboardX``).
      enabled: if False every method is a no-op.
      attempt: written into every JSONL row as ``"attempt"`` (the process's attempt at the
        run, 1 for the first); None writes no attempt.

    Raises:
      ValueError: ``run_dir`` is not a directory, or ``attempt`` < 1.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        enabled=True,
        attempt: int | None = None,
    ):
        self.run_dir = os.fspath(run_dir)
        self.enabled = enabled
        if attempt is not None and attempt < 1:
            raise ValueError(f"attempt={attempt} must be >= 1 (or None)")
        self.attempt = attempt
        self._jsonl: JsonlWriter | None = None
        self._tb = None
        if not enabled:
            return
        if not os.path.isdir(self.run_dir):
            raise ValueError(f"run_dir {self.run_dir!r} is not a directory")
        self._jsonl = JsonlWriter(os.path.join(self.run_dir, METRICS_FILE))
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=os.path.join(self.run_dir, TB_DIR))

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, METRICS_FILE)

    def write(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
        """Logs ``metrics`` at ``step``; keys become ``"<prefix>/<key>"`` when prefix is set.

        Raises:
          ValueError: negative step, a reserved key (``step``/``time``), a non-scalar array or
            an unsupported value type (message names the key).
        """
        if not self.enabled:
            return
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        record: dict[str, Any] = {"step": step, "time": time.time()}
        if self.attempt is not None:
            record["attempt"] = self.attempt
        for key, value in metrics.items():
            name = f"{prefix.rstrip('/')}/{key}" if prefix else str(key)
            if name in RESERVED_KEYS:
                raise ValueError(
                    f"metric name {name!r} is reserved; allowed: any but {'/'.join(RESERVED_KEYS)}"
                )
            record[name] = to_jsonable(value, key=name)
        self._jsonl.write(record)
        self._jsonl.flush()  # a running job's curves are readable (tail -f, `agentrl report`)
        if self._tb is not None:
            for name, value in record.items():
                if name in RESERVED_KEYS:
                    continue
                x = to_float(value)
                if x is not None:
                    self._tb.add_scalar(name, x, global_step=step)

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plain(obj: Any) -> Any:
    """``obj`` (ConfigDict, dataclass, mapping, sequence, scalar) as ``config.json`` stores it:
    dicts, lists and JSON scalars (tuples become lists; unknown objects their ``repr``)."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):  # ml_collections.ConfigDict
        return plain(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return plain(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    if isinstance(obj, float):
        return _float(obj)
    if obj is None or isinstance(obj, str | bool | int):
        return obj
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return to_jsonable(obj)
    return repr(obj)


def save_config(run_dir: str | os.PathLike, config: Any) -> str:
    """Writes ``config`` (ConfigDict, dataclass or mapping) to ``<run_dir>/config.json``.

    The write is atomic (temp file + rename), so a resumed run that rewrites it never leaves a
    half-written file. Tuples become lists; unknown objects their ``repr``. Returns the path.

    Raises:
      ValueError: ``run_dir`` is not a directory.
    """
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise ValueError(f"run_dir {run_dir!r} is not a directory")
    path = os.path.join(run_dir, CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(plain(config), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load_config_json(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads ``<run_dir>/config.json``. Raises ``ValueError`` if it is missing."""
    path = os.path.join(os.fspath(run_dir), CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist (is {os.fspath(run_dir)!r} a run directory?)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def progress_enabled(stream=None) -> bool:
    """True unless ``AGENTRL_NO_PROGRESS=1`` or ``stream`` (default stderr) is not a TTY."""
    if os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0"):
        return False
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class ProgressBar:
    """A tqdm progress bar with ETA and the latest metrics as postfix.

    Disabled (every call a no-op) when stderr is not a TTY or ``AGENTRL_NO_PROGRESS=1``;
    ``enabled`` forces it either way.

    Raises:
      ValueError: negative ``total`` or ``initial``.
    """

    def __init__(self, total: int, *, desc: str = "", initial: int = 0, enabled=None):
        if total < 0 or initial < 0:
            raise ValueError(f"total={total} and initial={initial} must be >= 0")
        self.enabled = progress_enabled() if enabled is None else bool(enabled)
        self._bar = None
        if self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True)

    def update(self, n: int = 1, **metrics: Any) -> None:
        """Advances by ``n`` steps and shows ``metrics`` (floats to 4 significant digits)."""
        if self._bar is None:
            return
        if metrics:
            shown = {}
            for k, v in metrics.items():
                x = to_float(to_jsonable(v, key=k)) if not isinstance(v, str) else None
                shown[k] = f"{x:.4g}" if x is not None else str(v)
            self._bar.set_postfix(shown, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _memory_stats(device) -> dict | None:
    try:
        return device.memory_stats() or None
    except Exception:  # some backends raise instead of returning None
        return None


def peak_device_memory_bytes(device=None) -> int | None:
    """Peak bytes in use on ``device`` (default ``jax.local_devices()[0]``), or None.

    None where the backend has no ``memory_stats`` (e.g. CPU) or reports no peak.
    """
    import jax

    stats = _memory_stats(jax.local_devices()[0] if device is None else device)
    if not stats:
        return None
    peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
    return None if peak is None else int(peak)


MEMORY_WATERMARK = 0.85  # the guide's safe peak fraction of device memory
_warned_fraction = [0.0]


def peak_device_memory_fraction(devices=None) -> float | None:
    """The highest peak-in-use / capacity (``bytes_limit``) over ``devices`` (default: this
    process's), or None where the backend reports neither. Logs a warning when it reaches
    ``MEMORY_WATERMARK`` (again only when it grows by another 1%)."""
    import jax

    fractions = []
    for device in jax.local_devices() if devices is None else devices:
        stats = _memory_stats(device) or {}
        peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
        if peak is not None and stats.get("bytes_limit"):
            fractions.append(peak / stats["bytes_limit"])
    if not fractions:
        return None
    fraction = max(fractions)
    if fraction >= MEMORY_WATERMARK and fraction >= _warned_fraction[0] + 0.01:
        _warned_fraction[0] = fraction
        logger.warning(
            "peak device memory at %.1f%% of capacity (safe watermark %.0f%%): see "
            "`agentrl plan --accelerator` for a mesh or micro-batch that fits",
            100 * fraction,
            100 * MEMORY_WATERMARK,
        )
    return fraction


def host_peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``getrusage`` maxrss)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def memory_metrics(device=None) -> dict[str, int | float | None]:
    """``{"peak_device_memory_bytes": int|None, "peak_device_memory_fraction": float|None,
    "host_peak_rss_bytes": int}`` for logging (the fraction: the highest over this process's
    devices, with the 85% warning of :func:`peak_device_memory_fraction`)."""
    return {
        "peak_device_memory_bytes": peak_device_memory_bytes(device),
        "peak_device_memory_fraction": peak_device_memory_fraction(
            None if device is None else [device]
        ),
        "host_peak_rss_bytes": host_peak_rss_bytes(),
    }
