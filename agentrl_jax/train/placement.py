"""Where a run's arrays live: the experiment's mesh applied to parameters, state and batches.

:class:`Placement` is built once per run from the ``mesh`` section. On one device (and one
process) it leaves everything where it is: arrays stay on the default device and steps are
plain ``jax.jit`` calls, so single-device numbers do not depend on this module. On several
devices:

* parameters, gradients and optimiser state are sharded by the logical rules
  (``sharding.tree_shardings`` of the model's boxed abstract init and of the optimiser's init
  on it): ``embed`` over ``fsdp``, heads / MLP / vocabulary over ``tensor``, experts over
  ``expert``; scalars and the PRNG key are replicated;
* batch rows are split over the rules' ``batch`` axes (``data, fsdp, expert`` by default, those
  that divide the row count);
* the SFT step and the RL update are jitted with these shardings (``sharding.StepShardings``);
* host-driven work (rollouts, scoring passes, evaluation) uses :meth:`Placement.host_params`
  under :meth:`Placement.host_context`: in one process the sharded parameters under the run's
  mesh; with several processes each process's own copy on a process-local mesh
  (``sharding.local_mesh_config``), since every process plays its own environments at its own
  pace and cannot join a collective per decode step.

Multi-process (``jax.distributed``): every process computes the same host batch (demonstrations
are replayed on each; RL episodes are exchanged after each rollout round,
:func:`play_sharded`) and puts its share of the rows onto its devices with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from agentrl_jax import multihost
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import DTypePolicy
from agentrl_jax.rl.state import TrainState
from agentrl_jax.rollout.trajectory import Trajectory
from agentrl_jax.sharding import (
    MeshConfig,
    StepShardings,
    activate,
    batch_sharding,
    local_mesh_config,
    make_mesh,
    replicated,
    tree_shardings,
)


class Placement:
    """The run's mesh and the shardings of its parameters, train state and batches.

    Args:
      mesh_cfg: the experiment's ``mesh`` section.
      model_cfg, policy: the model whose parameters are placed.
      devices: the devices of the mesh (default: ``mesh_cfg.pick(jax.devices())``, every
        process's unless ``mesh.devices`` names fewer).

    Raises:
      ValueError: the mesh cannot use the devices (``MeshConfig.shape``).
    """

    def __init__(
        self, mesh_cfg: MeshConfig, model_cfg: ModelConfig, policy: DTypePolicy, devices=None
    ):
        self.cfg, self.model_cfg, self.policy = mesh_cfg, model_cfg, policy
        self.multi_process = devices is None and jax.process_count() > 1
        devices = list(mesh_cfg.pick(jax.devices()) if devices is None else devices)
        self.sharded = len(devices) > 1 or self.multi_process
        self.mesh = make_mesh(mesh_cfg, devices) if self.sharded else None
        self.local_mesh = self.mesh
        if self.multi_process:
            local = jax.local_devices()
            self.local_mesh = make_mesh(local_mesh_config(mesh_cfg, len(local)), local)
        self._boxed = None
        self._host_memo: list[tuple[Any, Any]] = []

    @classmethod
    def default_device(cls, model_cfg: ModelConfig, policy: DTypePolicy) -> Placement:
        """Everything on the default device, as without a mesh."""
        return cls(MeshConfig(), model_cfg, policy, devices=jax.local_devices()[:1])

    @property
    def primary(self) -> bool:
        """Whether this process writes the run's files (process 0)."""
        return multihost.is_primary()

    # Shardings ---------------------------------------------------------------------------------
    def _boxed_params(self):
        if self._boxed is None:
            model = Transformer(self.model_cfg, self.policy)
            tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
            self._boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
        return self._boxed

    def param_shardings(self, mesh=None):
        """``NamedSharding`` per leaf of ``{"params": ...}`` (None on one device)."""
        mesh = mesh or self.mesh
        return None if mesh is None else tree_shardings(self._boxed_params(), mesh, self.cfg)

    def state_shardings(self, tx) -> TrainState | None:
        """Shardings of a ``TrainState`` with optimiser ``tx`` (None on one device)."""
        if not self.sharded:
            return None
        rep = replicated(self.mesh)
        opt = tree_shardings(jax.eval_shape(tx.init, self._boxed_params()), self.mesh, self.cfg)
        return TrainState(
            step=rep,
            params=self.param_shardings(),
            opt_state=opt,
            rng=rep,
            nonfinite_count=rep,
            consecutive_nonfinite=rep,
        )

    def step_shardings(self, tx, rows: int) -> StepShardings | None:
        """What a jitted step over ``rows``-row batches takes (None on one device)."""
        if not self.sharded:
            return None
        return StepShardings(
            self.mesh, self.cfg, self.state_shardings(tx), self.batch_sharding(rows)
        )

    def batch_sharding(self, rows: int) -> NamedSharding | None:
        """Rows of a ``[rows, ...]`` batch over the batch axes that divide ``rows``."""
        return None if not self.sharded else batch_sharding(self.mesh, self.cfg, rows)

    # Placing -----------------------------------------------------------------------------------
    def place_params(self, params):
        """``params`` sharded by the rules (unchanged on one device)."""
        return params if not self.sharded else put(params, self.param_shardings())

    def init_state(self, params, rl_cfg, rng, tx) -> TrainState:
        """``rl.state.init_train_state`` with every leaf placed by :meth:`state_shardings`:
        the optimiser state is created sharded where its parameters are."""
        from agentrl_jax.rl.state import init_train_state

        if not self.sharded:
            return init_train_state(params, rl_cfg, rng, tx=tx)
        shardings = self.state_shardings(tx)
        params = put(params, shardings.params)
        init = jax.jit(lambda p: tx.init(p), out_shardings=shardings.opt_state)
        zero = lambda: put(np.zeros((), np.int32), shardings.step)  # noqa: E731
        return TrainState(
            step=zero(),
            params=params,
            opt_state=init(params),
            rng=put(rng, shardings.rng),
            nonfinite_count=zero(),
            consecutive_nonfinite=zero(),
        )

    def place_state(self, state: TrainState, tx) -> TrainState:
        """A state (e.g. restored from a checkpoint) placed by :meth:`state_shardings`."""
        return state if not self.sharded else put(state, self.state_shardings(tx))

    def place_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A host batch of ``[B, ...]`` arrays as arrays with rows over the batch axes.

        With several processes every process holds the same host batch and contributes the
        rows its devices own (``jax.make_array_from_process_local_data``).
        """
        if not self.sharded:
            return batch
        rows = {int(np.shape(v)[0]) for v in batch.values() if v is not None}
        if len(rows) != 1:
            raise ValueError(f"batch arrays must share their row count, got {sorted(rows)}")
        sharding = self.batch_sharding(rows.pop())
        return {k: None if v is None else put(v, sharding) for k, v in batch.items()}

    # Host-driven work ---------------------------------------------------------------------------
    def host_context(self):
        """Context for rollouts, scoring and evaluation: the run's mesh with its rules (in one
        process) or this process's local mesh; nothing on one device."""
        if self.local_mesh is None:
            return contextlib.nullcontext()
        return activate(self.local_mesh, self.cfg)

    def host_params(self, params):
        """The parameters host-driven work uses: ``params`` in one process; with several,
        this process's copy on its local mesh (gathered on the devices, no host copy). The
        last two conversions are remembered (the policy's and a reference policy's)."""
        if not self.multi_process:
            return params
        for key, value in self._host_memo:
            if key is params:
                return value
        with jax.set_mesh(self.mesh):  # callers may hold the local mesh: gather on the global
            full = jax.jit(lambda p: p, out_shardings=replicated(self.mesh))(params)
        local = jax.tree.map(self._local_copy, full)
        target = self.param_shardings(self.local_mesh)
        if any(len(s.spec) for s in jax.tree.leaves(target)):
            local = jax.device_put(local, target)
        self._host_memo = [(params, local), *self._host_memo[:1]]
        return local

    def _local_copy(self, x: jax.Array) -> jax.Array:
        shards = [s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(
            x.shape, replicated(self.local_mesh), shards
        )


def put(tree, shardings):
    """``tree``'s leaves placed by ``shardings`` (a matching pytree or one sharding).

    In one process this is ``jax.device_put``. With several, a leaf that is already a global
    array is resharded on the devices, and a host value (numpy, or an array of this process
    alone) is taken as the same on every process: each contributes the part its devices own
    (``jax.make_array_from_process_local_data`` for row-sharded batches).
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda x: _put_one(x, shardings), tree)
    return jax.tree.map(_put_one, tree, shardings)


def _put_one(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x if x.sharding == sharding else jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(_put_one(jax.random.key_data(x), sharding), impl=impl)
    host = np.asarray(x)
    lo, hi = _process_rows(sharding, host.shape)
    if (lo, hi) == (0, host.shape[0] if host.ndim else 0):
        return jax.make_array_from_process_local_data(sharding, host, host.shape)
    return jax.make_array_from_process_local_data(sharding, host[lo:hi], host.shape)


def _process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> tuple[int, int]:
    """The rows ``[lo, hi)`` this process's devices hold of a ``shape`` array (the whole
    array when dimension 0 is not split across processes)."""
    if not shape:
        return 0, 0
    starts = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        starts.add((rows.start or 0, shape[0] if rows.stop is None else rows.stop))
    lo, hi = min(s for s, _ in starts), max(e for _, e in starts)
    covered = sum(e - s for s, e in starts)
    return (lo, hi) if covered == hi - lo else (0, shape[0])


# Episodes of several processes ---------------------------------------------------------------
def play_sharded(play: Callable[[int, int], Trajectory | None], n: int) -> Trajectory:
    """``play(lo, hi)`` for this process's block of ``n`` episodes, merged with the others'.

    ``play(lo, hi)`` plays episodes ``lo..hi-1`` of the caller's list (episode ids from ``lo``,
    so sampling keys are those of one process playing them all) and returns their trajectory.
    In one process this is ``play(0, n)``. With several, process ``p`` plays
    ``multihost.shard_range(n)``; the trajectories are all-gathered and concatenated in order,
    padded to the longest, each tool-call log row tagged with the ``process`` that played it,
    so every process continues with the trajectory one process would have produced.
    """
    if jax.process_count() == 1:
        return play(0, n)
    lo, hi = multihost.shard_range(n)
    mine = play(lo, hi) if hi > lo else None
    if mine is not None:
        logs = tuple({**row, "process": jax.process_index()} for row in mine.logs)
        mine = dataclasses.replace(jax.device_get(mine), logs=logs)
    parts = [t for t in multihost.allgather_objects(mine) if t is not None]
    return _concat(parts)


def _concat(parts: list[Trajectory]) -> Trajectory:
    """Trajectories of disjoint episodes as one, rows in order, padded to the longest."""
    from agentrl_jax.rollout.trajectory import ARRAY_FIELDS, concat_rows

    length = max(p.length for p in parts)
    rows = [{f: getattr(p, f) for f in ARRAY_FIELDS if getattr(p, f) is not None} for p in parts]
    merged = concat_rows(rows, length)
    logs = tuple(row for p in parts for row in p.logs)
    return Trajectory(**{f: merged.get(f) for f in ARRAY_FIELDS}, logs=logs)
