"""Orbax checkpoints of a training run: params, optimiser state, step, PRNG key, data state.

Layout: ``<run_dir>/checkpoints/<stage>/<step>/`` (orbax ``CheckpointManager``), one item
``state`` (a pytree: ``params``, ``opt_state``, ``rng`` as raw key data uint32, ``step``, and
``extra`` when the caller saves one, e.g. the older policy versions of asynchronous RL) and one
JSON item ``meta`` (the data iterator state and anything else JSON-safe, plus the checksum of
every array of ``state`` under ``array_checksums``: ``train/checksum.py``).

Safety: nothing here overwrites an existing checkpoint silently. ``Checkpointer(dir,
resume=False)`` refuses a directory that already holds checkpoints (ValueError naming it), and
``save`` refuses a step that already exists unless ``overwrite=True`` is passed explicitly.

Integrity: a step that does not load (truncated or missing files, an emptied manifest) or whose
arrays differ from their checksums is *unusable*. ``restore()`` of the latest step falls back to
the newest intact one, logging one line per unusable step; with ``set_aside=True`` (a resumed
run, which will write those steps again) the unusable steps are moved to
``<run_dir>/checkpoints/unusable/<stage>-<step>``, never deleted. A checkpoint whose arrays do not
fit the given templates (another model config) is a ``ValueError`` naming the first array, not
a fallback: every step of the run would fail the same way.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from agentrl_jax import multihost
from agentrl_jax.train.checksum import mismatches, tree_checksums

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
UNUSABLE_DIR = "unusable"
CHECKSUMS_KEY = "array_checksums"


class UnusableCheckpoint(ValueError):
    """One checkpoint step does not load or fails its checksums (the message says which)."""


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


class _OrbaxTaskNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        unread = msg.startswith(("Task exception", "Future exception"))
        ours = "orbax" in msg or "tensorstore" in msg
        return not (unread and "never retrieved" in msg and ours)


def _quiet_reads_of_a_failed_restore() -> None:
    """Silences (from now on) the tracebacks of the reads a failed restore leaves behind:
    orbax stops at the first failed read and closes its event loop while the others are still
    pending; each prints an unraisable ``RuntimeError('Event loop is closed')`` (or, closed
    unfinished, its own read error) when it ends, and asyncio logs orbax tasks whose error
    nobody retrieved. The one-line report of the step says what failed. Any other unraisable
    exception or asyncio error is still reported.
    Installed before a restore starts: a pending read can end before the restore's exception
    reaches its handler."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        code = getattr(getattr(unraisable, "object", None), "cr_code", None)
        closed_loop = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        if not (closed_loop or (code is not None and "orbax" in code.co_filename)):
            previous(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _OrbaxTaskNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_OrbaxTaskNoise())


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, without TensorStore's spec dump, at most ``limit``."""
    text = " ".join(str(e).split(" See full TensorStore details")[0].split())
    text = text or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


class Checkpointer:
    """Saves and restores one stage's checkpoints (see module docstring).

    Args:
      directory: the stage directory (``stage_dir(run_dir, "sft")``).
      resume: the directory may already hold checkpoints (they are restored, never replaced);
        temporary folders of a save that was killed are removed (the caller owns the run).
      max_to_keep: newest checkpoints kept (older ones are deleted by orbax); None keeps all.
      read_only: only restore (another process may be training in the run): nothing is
        created, cleaned or moved.

    Raises:
      ValueError: ``directory`` holds checkpoints and ``resume`` is False, or bad ``max_to_keep``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        resume: bool = False,
        max_to_keep=3,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.read_only = read_only
        steps = existing_steps(self.directory)
        if steps and not (resume or read_only):
            raise ValueError(
                f"checkpoint directory {self.directory!r} already holds steps {steps}; "
                "pass resume=True to continue it or choose a new run directory"
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 or None")
        # read_only is this class's (orbax's own flag only adds warnings): no create, no
        # cleanup, no save, so nothing is written.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=not read_only,
            cleanup_tmp_directories=resume and not read_only,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

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
        extra: Any = None,
    ) -> str:
        """Writes checkpoint ``step`` with the checksum of every array and waits for it;
        returns its directory. ``extra``: a pytree of arrays saved with the state (None: none).

        Raises:
          ValueError: negative step, ``step`` exists and ``overwrite`` is False, a read-only
            checkpointer, or ``meta`` using the reserved key ``array_checksums``.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        if self.read_only:
            raise ValueError(f"checkpointer of {self.directory!r} is read-only")
        if CHECKSUMS_KEY in (meta or {}):
            raise ValueError(f"meta key {CHECKSUMS_KEY!r} is reserved for the array checksums")
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
        if extra is not None:
            state["extra"] = extra
        meta = {**(meta or {}), CHECKSUMS_KEY: tree_checksums(state)}
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
        )
        self._mngr.wait_until_finished()
        return os.path.join(self.directory, str(step))

    def restore(
        self,
        *,
        params: Any,
        opt_state: Any = None,
        step: int | None = None,
        rng_impl=None,
        set_aside: bool = False,
        extra: Any = None,
    ) -> dict[str, Any]:
        """Restores ``step``, or the newest intact step, onto the structure of the templates.

        Args:
          params: a params pytree (arrays or ``jax.ShapeDtypeStruct``) giving structure/dtypes.
          opt_state: the optimiser-state template; None restores params only.
          step: which checkpoint (None: the newest one that loads and passes its checksums;
            each newer unusable one is logged in one line).
          rng_impl: PRNG implementation name of the saved key (None: the default).
          set_aside: move the unusable steps newer than the one restored to
            ``checkpoints/unusable/`` (a resumed run writes those steps again).
          extra: the template of the ``extra`` pytree saved with the state (with
            ``opt_state``), or None.

        Returns:
          ``{"params", "opt_state" (or None), "rng", "step", "meta", "extra" (or None),
          "unusable"}``; ``unusable``
          lists ``(step, reason)`` of the newer steps skipped.

        Raises:
          ValueError: no checkpoint, no intact one (each step's reason in one line), or
            arrays that do not fit the templates (the first one named).
          UnusableCheckpoint: the given ``step`` does not load or fails its checksums.
        """
        if step is not None:
            if step not in self._mngr.all_steps():
                raise ValueError(f"no checkpoint step {step} in {self.directory!r}")
            out = self._restore_step(step, params, opt_state, rng_impl, extra)
            return {**out, "unusable": []}
        steps = sorted(self._mngr.all_steps(), reverse=True)
        if not steps:
            raise ValueError(f"no checkpoint step in {self.directory!r}")
        unusable: list[tuple[int, str]] = []
        for s in steps:
            try:
                out = self._restore_step(s, params, opt_state, rng_impl, extra)
            except UnusableCheckpoint as e:
                logger.warning("%s", e)
                unusable.append((s, str(e)))
                continue
            if unusable:
                moved = self._set_aside([u for u, _ in unusable]) if set_aside else []
                logger.warning(
                    "falling back to checkpoint step %d of %s%s",
                    s,
                    self.directory,
                    f" (unusable steps moved to {os.path.dirname(moved[0])})" if moved else "",
                )
            return {**out, "unusable": unusable}
        reasons = "; ".join(f"step {s}: {r}" for s, r in unusable)
        raise ValueError(f"no intact checkpoint in {self.directory!r}: {reasons}")

    def _restore_step(self, step: int, params, opt_state, rng_impl, extra=None) -> dict[str, Any]:
        """Restores and verifies one step (``restore``'s contract, without a fallback)."""
        where = f"checkpoint step {step} of {self.directory!r}"
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = dict(meta["meta"])
        except Exception as e:  # noqa: BLE001 - any failure to read it makes the step unusable
            raise UnusableCheckpoint(
                f"{where} is unusable: its meta does not load ({_one_line(e)})"
            ) from e
        saved = meta.pop(CHECKSUMS_KEY, None)
        template = {
            "params": params,
            "opt_state": opt_state,
            "rng": jax.ShapeDtypeStruct(_key_shape(rng_impl), np.uint32),
            "step": jax.ShapeDtypeStruct((), np.int64),
        }
        if extra is not None and opt_state is not None:
            template["extra"] = extra
        if saved is not None and opt_state is None:
            _abstract(template, saved, where)  # checks the params' shapes against the saved ones
        _quiet_reads_of_a_failed_restore()
        try:
            if opt_state is None:  # params only: read everything onto this process's first
                # device (whatever mesh wrote it), keep the params
                template = {k: v for k, v in template.items() if k != "opt_state"}
                restore_args = ocp.args.StandardRestore(self._as_saved(step))
            else:
                restore_args = ocp.args.StandardRestore(_abstract(template, saved, where))
            state = self._mngr.restore(step, args=ocp.args.Composite(state=restore_args))["state"]
        except Exception as e:  # noqa: BLE001 - truncated/missing files raise anything
            raise UnusableCheckpoint(f"{where} is unusable: {_one_line(e)}") from e
        state = {k: state[k] for k in template}
        if saved is not None:
            bad = mismatches(state, {k: v for k, v in saved.items() if _under(k, template)})
            if bad:
                raise UnusableCheckpoint(
                    f"{where} is unusable: {len(bad)} array(s) differ from their checksums, "
                    f"first {bad[0]}"
                )
        restored = state["params"]
        if opt_state is None:
            restored = jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(restored))
        return {
            "params": _cast_like(restored, params),
            "opt_state": _cast_like(state.get("opt_state"), opt_state),
            "rng": data_to_key(state["rng"], rng_impl),
            "step": int(state["step"]),
            "meta": meta,
            "extra": _cast_like(state.get("extra"), template.get("extra")),
        }

    def _as_saved(self, step: int):
        """The saved ``state`` tree of ``step`` as restore targets: its device arrays on this
        process's first device (whatever mesh wrote them), its host arrays as host arrays."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def target(x):
            if x.sharding is None:  # saved from numpy (rng data, step)
                return np.zeros(x.shape, x.dtype)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)

        return jax.tree.map(target, self._mngr.item_metadata(step)["state"])

    def _set_aside(self, steps: list[int]) -> list[str]:
        """Moves ``steps`` to ``<checkpoints>/unusable/<stage>-<step>[-k]``; returns the paths.
        On a multi-process run process 0 moves them while the others wait."""
        moved = []
        if multihost.is_primary():
            stage = os.path.basename(self.directory)
            target = os.path.join(os.path.dirname(self.directory), UNUSABLE_DIR)
            os.makedirs(target, exist_ok=True)
            for s in steps:
                dest = os.path.join(target, f"{stage}-{s}")
                k = 0
                while os.path.exists(dest if k == 0 else f"{dest}-{k}"):
                    k += 1
                dest = dest if k == 0 else f"{dest}-{k}"
                os.rename(os.path.join(self.directory, str(s)), dest)
                moved.append(dest)
        moved = multihost.broadcast_object(moved)
        self._mngr.reload()
        return moved

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key_shape(impl: str | None) -> tuple[int, ...]:
    return tuple(jax.random.key_data(jax.random.key(0, impl=impl)).shape)


def _under(path: str, template: dict) -> bool:
    """Whether a saved key path (``"['params']..."``) belongs to one of ``template``'s groups."""
    return any(path.startswith(f"[{k!r}]") for k in template)


def _abstract(template: dict, saved: dict | None, where: str) -> Any:
    """``template`` as ShapeDtypeStructs in the *saved* dtypes (verified before any cast).

    Raises:
      ValueError: a template array the checkpoint lacks or saved with another shape.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, x in leaves:
        shape, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
        # A template sharded over several devices (or processes) restores each device's shard
        # where it is; others restore as orbax reads them (single-device runs as before).
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) == 1:
            sharding = None
        if saved is not None:
            key = jax.tree_util.keystr(path)
            if key not in saved:
                raise ValueError(f"{where} has no array {key}: it was saved by another config")
            if tuple(saved[key]["shape"]) != shape:
                raise ValueError(
                    f"{where} holds {key} with shape {tuple(saved[key]['shape'])}, the config "
                    f"gives {shape}: it was saved by another config"
                )
            dtype = np.dtype(saved[key]["dtype"])
        out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _cast_like(tree: Any, template: Any) -> Any:
    """``tree``'s leaves in ``template``'s dtypes (a checkpoint saved in another precision)."""
    if tree is None or template is None:
        return tree

    def cast(x, t):
        dtype = np.dtype(t.dtype)
        if np.dtype(x.dtype) == dtype:
            return x
        return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(dtype)

    return jax.tree.map(cast, tree, template)


def restore_params(path: str | os.PathLike, params_template: Any) -> tuple[Any, int]:
    """Params of a checkpoint given as a step directory or a stage directory (its newest intact
    step: an unusable newer one is logged and skipped). Read-only: safe while a run trains.

    Returns:
      ``(params, step)``.

    Raises:
      ValueError: no checkpoint at ``path``, no intact one, or one saved by another config;
        ``UnusableCheckpoint`` for a step directory that does not load or fails its checksums.
    """
    path = os.path.abspath(os.fspath(path))
    name = os.path.basename(path.rstrip(os.sep))
    directory, step = (os.path.dirname(path), int(name)) if name.isdigit() else (path, None)
    if not existing_steps(directory):
        raise ValueError(f"no checkpoint found at {path!r}")
    with Checkpointer(directory, read_only=True) as ckpt:
        out = ckpt.restore(params=params_template, step=step)
    return out["params"], out["step"]
