"""Experiment configs: module loading, ``key=value`` variants, ``--set`` overrides, sweeps.

An experiment is a Python module ``experiments/<name>.py`` with ``get_config(arg=None)``
returning an ``ml_collections.ConfigDict`` built on ``agentrl_jax.experiment.base_config()``,
and optionally ``sweep(add)`` calling ``add(**overrides)`` once per sweep point (big_vision
style)::

    cfg = load_config("experiments/toy.py:smoke=True", overrides=["model.n_layers=8"])

This module is the generic machinery and imports nothing of the project: the sections and their
defaults live with the code that owns them (frozen dataclasses), ``agentrl_jax.experiment``
assembles them, and :func:`to_dataclass` converts a section back at the edge, so a typo is an
error instead of a silent new key.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import ml_collections

ConfigDict = ml_collections.ConfigDict

# Config keys that moved to another section, old -> new (``register_moved_key``; the module that
# assembles the sections registers them). Setting an old key is an error naming the new one.
_MOVED: dict[str, str] = {}


def register_moved_key(old: str, new: str) -> None:
    """Records that the dotted config key ``old`` is now ``new``: a config or an override that
    still sets ``old`` raises a ``ValueError`` naming ``new`` (:func:`check_moved`), and
    :func:`move_keys` maps saved configs onto ``new``."""
    _MOVED[old] = new


def _moved_error(old: str) -> ValueError:
    return ValueError(f"config key {old!r} moved to {_MOVED[old]!r}; set {_MOVED[old]} instead")


def check_moved(cfg: ConfigDict, keys: Sequence[str] = ()) -> None:
    """Raises ``ValueError`` naming the new key if ``cfg`` holds, or ``keys`` name, a key that
    moved (``register_moved_key``)."""
    for key in keys:
        if key in _MOVED:
            raise _moved_error(key)
    for old in _MOVED:
        *path, leaf = old.split(".")
        node = cfg
        for part in path:
            node = node.get(part) if isinstance(node, ConfigDict) else None
        if isinstance(node, ConfigDict) and leaf in node:
            raise _moved_error(old)


def move_keys(dotted: dict[str, Any]) -> dict[str, Any]:
    """``dotted`` (``{"a.b": value}``) with every moved key under its new name (a saved run's
    config predating the move)."""
    return {_MOVED.get(k, k): v for k, v in dotted.items()}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_arg(arg: str | None, **defaults) -> ConfigDict:
    """Parses ``"smoke=True,size=small"`` into a ConfigDict on top of ``defaults``.

    Values are Python literals where they parse, else strings. Raises ``ValueError`` for a key
    not in ``defaults`` (when defaults are given) or a malformed item.
    """
    out = ConfigDict(defaults)
    if not arg:
        return out
    for item in arg.split(","):
        if not item:
            continue
        if "=" not in item:
            raise ValueError(f"experiment argument {item!r} must look like key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if defaults and key not in defaults:
            raise ValueError(f"unknown experiment argument {key!r}; known: {sorted(defaults)}")
        value = _literal(value)
        if key in out and isinstance(out[key], bool) and not isinstance(value, bool):
            raise ValueError(f"experiment argument {key}={value!r} must be True or False")
        out[key] = value
    return out


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"experiments/x.py:smoke=True"`` -> ``("experiments/x.py", "smoke=True")``."""
    path, _, arg = spec.partition(":")
    return path, (arg or None)


class ExperimentError(ValueError):
    """An experiment file that does not import, or whose ``get_config`` / ``sweep`` fails."""


@contextlib.contextmanager
def _in_experiment(path: str, what: str):
    """Turns an exception raised by experiment code into an ``ExperimentError`` naming the file,
    the line in it and the original error (``raise ... from`` keeps the traceback for --debug).
    A ``ValueError`` passes unchanged: the code above reports it as bad input already."""
    try:
        yield
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - anything the user's module raises is its error
        line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
        for frame in traceback.extract_tb(e.__traceback__):
            if os.path.abspath(frame.filename) == os.path.abspath(path):
                line = frame.lineno
        where = f"{path}:{line}" if line else path
        raise ExperimentError(f"{where}: {what} failed: {type(e).__name__}: {e}") from e


def load_module(path: str):
    """Imports an experiment module from a file path.

    Raises:
      ValueError: the file is missing or has no ``get_config``; ``ExperimentError`` (a
        ValueError) when importing it raises (a syntax error, a missing import, ...).
    """
    if not os.path.isfile(path):
        raise ValueError(f"experiment file {path!r} does not exist")
    name = "agentrl_experiment_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _in_experiment(path, "importing the experiment"):
        spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"experiment {path!r} has no get_config(arg=None)")
    return module


def apply_overrides(cfg: ConfigDict, overrides: Sequence[str] | dict[str, Any]) -> ConfigDict:
    """Applies ``["model.n_layers=8", ...]`` (or a dict) to a locked copy of ``cfg``.

    Raises:
      ValueError: unknown key, a key that moved (``cfg``'s or an override's; the message names
        the new key), or a value of the wrong type (message names the key).
    """
    items = overrides.items() if isinstance(overrides, dict) else [_split(o) for o in overrides]
    check_moved(cfg, [key for key, _ in items])
    cfg = ConfigDict(cfg.to_dict())
    cfg.lock()
    for key, value in items:
        node = cfg
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, ConfigDict) or part not in node:
                raise ValueError(
                    f"unknown config key {key!r} (no {'.'.join(parts[: i + 1])!r}); "
                    f"known here: {sorted(node.keys()) if isinstance(node, ConfigDict) else []}"
                )
            if i < len(parts) - 1:
                node = node[part]
        old = node[parts[-1]]
        value = _coerce(key, old, value)
        try:
            node[parts[-1]] = value
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"config key {key!r}: {e}") from None
    return cfg


def _split(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value")
    key, value = item.split("=", 1)
    return key.strip(), _literal(value) if isinstance(value, str) else value


def _coerce(key: str, old: Any, value: Any) -> Any:
    if isinstance(old, ConfigDict):
        if isinstance(value, dict) and not old.keys():  # a free-form dict field, empty by
            return ConfigDict(value)  # default (e.g. rl.advantage_kwargs)
        raise ValueError(f"config key {key!r} is a section; set one of its fields or a dict")
    if old is None or value is None:
        return value
    if isinstance(old, bool):
        if not isinstance(value, bool):
            raise ValueError(f"config key {key!r} expects a bool, got {value!r}")
        return value
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(old, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(old, list) and isinstance(value, tuple):  # a config read back from JSON
        value = list(value)
    if isinstance(old, str) and not isinstance(value, str):
        value = str(value)
    if type(value) is not type(old):
        raise ValueError(
            f"config key {key!r} expects {type(old).__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def load_config(spec: str, overrides: Sequence[str] = ()) -> ConfigDict:
    """Loads ``path.py[:arg]``, applies overrides, and returns a locked ConfigDict."""
    path, arg = split_spec(spec)
    module = load_module(path)
    with _in_experiment(path, "get_config"):
        cfg = module.get_config(arg)
    if not isinstance(cfg, ConfigDict):
        raise ValueError(f"{path}: get_config must return an ml_collections.ConfigDict")
    cfg = apply_overrides(cfg, list(overrides))
    return cfg


def sweep_points(spec: str) -> list[dict[str, Any]]:
    """The override dicts of the experiment's ``sweep(add)`` (empty if it has none)."""
    path, _ = split_spec(spec)
    module = load_module(path)
    points: list[dict[str, Any]] = []
    if hasattr(module, "sweep"):
        with _in_experiment(path, "sweep"):
            module.sweep(lambda **kw: points.append(kw))
    return points


def to_dataclass(section: ConfigDict | dict, cls):
    """Converts a config section into the frozen dataclass ``cls`` (validated there).

    Raises ``ValueError`` for keys the dataclass does not have.
    """
    data = section.to_dict() if isinstance(section, ConfigDict) else dict(section)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
    for f in dataclasses.fields(cls):
        if f.name in data and isinstance(data[f.name], list):
            data[f.name] = tuple(data[f.name])
    return cls(**data)
