"""Run directories as units that resume cannot damage: what a run is, its lock, its attempts,
its config history, and what a resume may change.

A run directory is one that holds ``config.json`` (written when ``agentrl train`` makes it,
before anything else). Besides the logs and checkpoints it holds:

* ``run.lock``: locked (``flock``) while a process trains in the run; the holder's pid and host
  are written into it, and a second process is refused with them. The kernel drops the lock
  when its holder dies, even by SIGKILL, so a killed run can be resumed at once.
* ``attempts.jsonl``: one line per process that trained in the run (``attempt`` 1, 2, ...,
  ``pid``, ``host``, ``since``). Every row of ``metrics.jsonl`` and ``tool_calls.jsonl``
  carries its attempt, so rows of steps a resume replays can be told from the first try
  (``metrics.latest_attempts`` keeps the last).
* ``config_history.jsonl``: the changes a resume accepted, one line per attempt that made any
  (``{"attempt", "time", "changes": {key: [old, new]}}``). ``config.json`` stays what the run
  started with; the run's config is ``config.json`` with these changes applied in order
  (:func:`load_run_config`).

A resume keeps the run's config. It may change only :data:`RESUMABLE` keys; ``name`` and
``workdir`` (where a *new* run's directory goes) are ignored. ``docs/runs.md`` says what a
resume guarantees and what it refuses.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Any

from agentrl_jax.config import ConfigDict, apply_overrides
from agentrl_jax.experiment import from_saved
from agentrl_jax.metrics import CONFIG_FILE, JsonlWriter, plain, read_jsonl
from agentrl_jax.train.checkpoint import existing_steps, stage_dir

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
ATTEMPTS_FILE = "attempts.jsonl"
HISTORY_FILE = "config_history.jsonl"
SUMMARY_FILE = "summary.json"

# Keys a resume may change, with the rule each obeys: none of them changes what a step computes.
RESUMABLE = {
    "train.rl_steps": "not below the RL steps already trained; more steps continue the run",
    "train.eval_every": "any",
    "train.ckpt_every": "any",
    "train.log_tool_calls": "any",
}
# Where a new run's directory goes: nothing once the run exists.
IGNORED_ON_RESUME = ("name", "workdir")


class RunBusy(ValueError):
    """Another process holds the run's lock (the message names it)."""


def check_run_dir(path: str) -> str:
    """The absolute path of run directory ``path``.

    Raises:
      ValueError: ``path`` is missing, not a directory, or has no ``config.json`` (a folder
        of runs is told so, with one of its runs as an example).
    """
    run_dir = os.path.abspath(path)
    if not os.path.exists(run_dir):
        raise ValueError(f"run directory {path!r} does not exist")
    if not os.path.isdir(run_dir):
        raise ValueError(f"{path!r} is not a run directory: not a directory")
    if not os.path.isfile(os.path.join(run_dir, CONFIG_FILE)):
        runs = sorted(n for n in os.listdir(run_dir) if _is_run(os.path.join(run_dir, n)))
        hint = (
            f"it holds runs, e.g. {os.path.join(path, runs[-1])!r}"
            if runs
            else "a run directory is made by `agentrl train` and starts with its config.json"
        )
        raise ValueError(f"{path!r} is not a run directory: no {CONFIG_FILE}; {hint}")
    if _saved_config(run_dir) is None:
        raise ValueError(
            f"{path!r} is not a run directory: its {CONFIG_FILE} is not a run's config "
            "(no model section)"
        )
    return run_dir


def _is_run(path: str) -> bool:
    try:
        return _saved_config(path) is not None
    except ValueError:
        return False


def _saved_config(run_dir: str) -> dict[str, Any] | None:
    """The run's ``config.json`` if ``run_dir`` holds one of a run of this project, else None.

    Raises:
      ValueError: a ``config.json`` that is not valid JSON.
    """
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is not valid JSON ({e})") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return None  # e.g. a Hugging Face model directory's config.json
    return saved


def _history(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, HISTORY_FILE)
    return read_jsonl(path) if os.path.isfile(path) else []


def load_run_config(run_dir: str) -> ConfigDict:
    """The run's config: its ``config.json`` with ``config_history.jsonl`` applied in order.

    Raises:
      ValueError: ``run_dir`` is not a run (:func:`check_run_dir`), or its config has a key
        this version lacks.
    """
    saved = _saved_config(check_run_dir(run_dir))
    cfg = from_saved(saved)
    for row in _history(run_dir):
        cfg = apply_overrides(cfg, {k: new for k, (_, new) in row["changes"].items()})
    return cfg


def _flat(values: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(values, dict) or not values:
        return {prefix[:-1]: values}
    out: dict[str, Any] = {}
    for k, v in values.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def config_changes(run: ConfigDict, requested: ConfigDict) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (run's value, requested value)}`` where the two configs differ (as
    ``config.json`` stores values; free-form dict fields compare key by key)."""
    a, b = _flat(plain(run)), _flat(plain(requested))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def trained_rl_steps(run_dir: str) -> int:
    """The newest RL checkpoint step of the run (0 without one)."""
    steps = existing_steps(stage_dir(run_dir, "rl"))
    return steps[-1] if steps else 0


def resume_config(
    run_dir: str, requested: ConfigDict | None
) -> tuple[ConfigDict, dict[str, tuple[Any, Any]]]:
    """The config a resume of ``run_dir`` runs with, and the changes it accepts.

    Args:
      run_dir: a run directory (:func:`check_run_dir`).
      requested: the config the user asked for (experiment + ``--set``); None: the run's own.

    Returns:
      ``(config, {key: (old, new)})``: the run's config with the accepted changes.

    Raises:
      ValueError: a requested value differs from the run's in a key a resume may not change
        (every such key named), or ``train.rl_steps`` below the RL steps already trained.
    """
    cfg = load_run_config(run_dir)
    if requested is None:
        return cfg, {}
    changes = {
        k: v for k, v in config_changes(cfg, requested).items() if k not in IGNORED_ON_RESUME
    }
    refused = [k for k in changes if k not in RESUMABLE]
    if refused:
        shown = ", ".join(f"{k}={changes[k][1]!r} (run: {changes[k][0]!r})" for k in refused[:4])
        more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
        raise ValueError(
            f"resume keeps the run's config; {run_dir!r} differs in {shown}{more}. A resume may "
            f"change only {', '.join(RESUMABLE)} (drop SPEC to resume with the run's own "
            "config, or start a new run)"
        )
    trained = trained_rl_steps(run_dir)
    if "train.rl_steps" in changes and changes["train.rl_steps"][1] < trained:
        raise ValueError(
            f"train.rl_steps={changes['train.rl_steps'][1]} is fewer than the {trained} RL "
            f"steps {run_dir!r} already trained"
        )
    if changes:
        cfg = apply_overrides(cfg, {k: new for k, (_, new) in changes.items()})
    return cfg, changes


def finished_summary(run_dir: str, rl_steps: int) -> dict[str, Any] | None:
    """The run's stored ``summary.json`` if it finished (its evaluation after RL is there) at
    ``rl_steps`` or more RL steps; else None."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        summary = json.load(f)
    if "eval_after" in summary and summary.get("rl_steps", -1) >= rl_steps:
        return summary
    return None


def _holder() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def begin_attempt(run_dir: str, changes: dict | None = None) -> int:
    """Appends this process's attempt to ``attempts.jsonl`` (and accepted config ``changes``
    to ``config_history.jsonl``); returns its number (1 for a new run). Call with the lock held.
    """
    path = os.path.join(run_dir, ATTEMPTS_FILE)
    attempt = len(read_jsonl(path)) + 1 if os.path.isfile(path) else 1
    with JsonlWriter(path) as w:
        w.write({"attempt": attempt, **_holder()})
    if changes:
        with JsonlWriter(os.path.join(run_dir, HISTORY_FILE)) as w:
            w.write(
                {
                    "attempt": attempt,
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "changes": {k: list(v) for k, v in changes.items()},
                }
            )
        log.info("config changes recorded in %s: %s", HISTORY_FILE, changes)
    return attempt


class RunLock:
    """The run directory's lock (``run.lock``; module docstring). Use as a context manager.

    Raises (on entry):
      RunBusy: another process holds it (its pid, host and start time named).
      OSError: the lock file cannot be created (e.g. permission denied).
    """

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            try:
                h = json.loads(text)
                who = f"pid {h['pid']} on host {h['host']} (since {h['since']})"
            except (ValueError, KeyError, TypeError):
                who = "another process (it has not recorded its pid yet)"
            raise RunBusy(
                f"run directory {self.run_dir!r} is in use by {who}; one process trains in a "
                "run at a time"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
