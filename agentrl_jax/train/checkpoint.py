"""Orbax checkpoints of a training run: params, optimiser state, step, PRNG key, data state.

Layout: ``<run_dir>/checkpoints/<stage>/<step>/`` (orbax ``CheckpointManager``), one item
``state`` (a pytree: ``params``, ``opt_state``, ``rng`` as raw key data uint32, ``step``) and one
JSON item ``meta`` (the data iterator state and anything else JSON-safe).

Safety: nothing here overwrites an existing checkpoint silently. ``Checkpointer(dir,
resume=False)`` refuses a directory that already holds checkpoints (ValueError naming it), and
``save`` refuses a step that already exists unless ``overwrite=True`` is passed explicitly.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def stage_dir(run_dir: str | os.PathLike, stage: str) -> str:
    """``<run_dir>/checkpoints/<stage>`` (not created)."""
    if not stage or os.sep in stage:
        raise ValueError(f"stage={stage!r} must be a non-empty name without path separators")
    return os.path.join(os.path.abspath(os.fspath(run_dir)), CHECKPOINT_DIR, stage)


def existing_steps(directory: str | os.PathLike) -> list[int]:
    """Steps saved under ``directory`` (ascending; empty if it does not exist)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def key_to_data(rng: jax.Array) -> np.ndarray:
    """A typed PRNG key as raw uint32 data (orbax stores plain arrays)."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(rng))
    return np.asarray(rng)


def data_to_key(data: Any, impl: str | None = None) -> jax.Array:
    """Inverse of ``key_to_data`` (default implementation unless ``impl`` is given)."""
    return jax.random.wrap_key_data(jnp.asarray(data, jnp.uint32), impl=impl)


class Checkpointer:
    """Saves and restores one stage's checkpoints (see module docstring).

    Args:
      directory: the stage directory (``stage_dir(run_dir, "sft")``).
      resume: the directory may already hold checkpoints (they are restored, never replaced).
      max_to_keep: newest checkpoints kept (older ones are deleted by orbax); None keeps all.

    Raises:
      ValueError: ``directory`` holds checkpoints and ``resume`` is False, or bad ``max_to_keep``.
    """

    def __init__(self, directory: str | os.PathLike, *, resume: bool = False, max_to_keep=3):
        self.directory = os.path.abspath(os.fspath(directory))
        steps = existing_steps(self.directory)
        if steps and not resume:
            raise ValueError(
                f"checkpoint directory {self.directory!r} already holds steps {steps}; "
                "pass resume=True to continue it or choose a new run directory"
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 or None")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        rng: jax.Array,
        meta: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> str:
        """Writes checkpoint ``step`` and waits for it; returns its directory.

        Raises:
          ValueError: negative step, or ``step`` exists and ``overwrite`` is False.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if step in self._mngr.all_steps():
            if not overwrite:
                raise ValueError(
                    f"checkpoint step {step} already exists in {self.directory!r}; "
                    "pass overwrite=True to replace it"
                )
            self._mngr.delete(step)
        state = {
            "params": params,
            "opt_state": opt_state,
            "rng": key_to_data(rng),
            "step": np.asarray(step, np.int64),
        }
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta or {}))
            ),
        )
        self._mngr.wait_until_finished()
        return os.path.join(self.directory, str(step))

    def restore(
        self, *, params: Any, opt_state: Any = None, step: int | None = None, rng_impl=None
    ) -> dict[str, Any]:
        """Restores ``step`` (default: latest) onto the structure of the given templates.

        Args:
          params: a params pytree (arrays or ``jax.ShapeDtypeStruct``) giving structure/dtypes.
          opt_state: the optimiser-state template; None restores params only.
          step: which checkpoint.
          rng_impl: PRNG implementation name of the saved key (None: the default).

        Returns:
          ``{"params", "opt_state" (or None), "rng", "step", "meta"}``.

        Raises:
          ValueError: no checkpoint to restore.
        """
        step = self._mngr.latest_step() if step is None else step
        if step is None or step not in self._mngr.all_steps():
            raise ValueError(f"no checkpoint step {step} in {self.directory!r}")
        template = {
            "params": params,
            "opt_state": opt_state,
            "rng": np.zeros(_key_shape(rng_impl), np.uint32),
            "step": np.asarray(0, np.int64),
        }
        if opt_state is None:  # params only: read everything as saved, keep the params
            restore_args = ocp.args.StandardRestore()
        else:
            restore_args = ocp.args.StandardRestore(_abstract(template))
        out = self._mngr.restore(
            step, args=ocp.args.Composite(state=restore_args, meta=ocp.args.JsonRestore())
        )
        state = out["state"]
        restored = state["params"]
        if opt_state is None:
            restored = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(restored))
        return {
            "params": restored,
            "opt_state": state.get("opt_state"),
            "rng": data_to_key(state["rng"], rng_impl),
            "step": int(state["step"]),
            "meta": out["meta"],
        }

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key_shape(impl: str | None) -> tuple[int, ...]:
    return tuple(jax.random.key_data(jax.random.key(0, impl=impl)).shape)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
            if not isinstance(x, jax.ShapeDtypeStruct)
            else x
        ),
        tree,
    )


def restore_params(path: str | os.PathLike, params_template: Any) -> tuple[Any, int]:
    """Params of a checkpoint given as a step directory or a stage directory (latest step).

    Returns:
      ``(params, step)``.

    Raises:
      ValueError: no checkpoint at ``path``.
    """
    path = os.path.abspath(os.fspath(path))
    name = os.path.basename(path.rstrip(os.sep))
    directory, step = (os.path.dirname(path), int(name)) if name.isdigit() else (path, None)
    if not existing_steps(directory):
        raise ValueError(f"no checkpoint found at {path!r}")
    with Checkpointer(directory, resume=True) as ckpt:
        out = ckpt.restore(params=params_template, step=step)
    return out["params"], out["step"]
