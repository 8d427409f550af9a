"""Meshes, logical-axis rules and multi-host start-up.

Mesh axes are ``data, fsdp, expert, tensor``. Parameters and activations carry logical axis names
(``nn.with_logical_partitioning`` / ``nn.with_logical_constraint``); ``MeshConfig.rules`` maps
them to mesh axes. Meshes are built with explicit ``Auto`` axis types because ``jax.make_mesh``
defaults to Explicit axes in current JAX, which Linen's logical sharding does not use.

A mesh axis shards an array dimension only where it divides it (:func:`fit_spec`): a model with
2 KV heads on ``tensor=4`` keeps its KV heads whole and is still sharded elsewhere, and a batch
of 4 rows on 8 data shards is split over the axes whose product divides 4.

Multi-process (one JAX process per host or per GPU): :func:`maybe_initialize_distributed` starts
``jax.distributed`` from explicit arguments or the usual cluster variables; the mesh then spans
every process's devices (``jax.devices()``) and process-local meshes
(:func:`local_mesh_config`) serve work each process does on its own (rollouts of its tasks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axis (or None = replicated). Tuples of mesh axes shard over several.
DEFAULT_RULES: tuple[tuple[str, object], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("layers", None),
    ("cache_pages", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape (config section ``mesh``). ``-1`` means "the devices the other axes leave".

    ``data=-1`` is the default: data parallelism over every device. Setting another axis to
    ``-1`` (``mesh.fsdp=-1``: parameters and optimiser state sharded over every device) gives
    that axis the rest instead, and ``data`` is then 1 unless it is set to a size.

    Attributes:
      data, fsdp, expert, tensor: axis sizes (their product must equal the device count).
      rules: logical-axis rules as ``((logical, mesh_axis_or_None_or_tuple), ...)``.
      devices: how many devices the run uses: -1 every device (every process's), N the first N
        of ``jax.devices()`` (one-process runs; N=1 runs on the default device, unsharded).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES
    devices: int = -1

    def pick(self, devices: list) -> list:
        """The first ``devices`` of ``devices`` (all of them for -1).

        Raises:
          ValueError: ``devices`` is 0, below -1, or more than there are; or a subset is asked
            of a multi-process run (every process's devices take part there).
        """
        n = self.devices
        if not isinstance(n, int) or n == 0 or n < -1 or n > len(devices):
            raise ValueError(
                f"MeshConfig.devices={n!r} must be -1 (all) or 1..{len(devices)} (the devices)"
            )
        if n not in (-1, len(devices)) and jax.process_count() > 1:
            raise ValueError(
                f"MeshConfig.devices={n} on a {jax.process_count()}-process run: every process's "
                "devices take part (-1)"
            )
        return list(devices) if n == -1 else list(devices)[:n]

    def shape(self, n_devices: int) -> dict[str, int]:
        """Resolves ``-1`` and validates the product against ``n_devices``.

        Raises:
          ValueError: an axis that is 0 or below -1, two axes other than ``data`` at -1, or
            sizes that do not use exactly ``n_devices`` devices.
        """
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        for a, s in sizes.items():
            if not isinstance(s, int) or s == 0 or s < -1:
                raise ValueError(f"MeshConfig.{a}={s!r} must be a positive int or -1")
        free = [a for a, s in sizes.items() if s == -1]
        if len(free) > 1 and "data" in free:  # the default data=-1 yields to the other axis
            sizes["data"] = 1
            free.remove("data")
        if len(free) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {free}")
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if free:
            if n_devices % fixed:
                raise ValueError(
                    f"MeshConfig: {n_devices=} is not divisible by the fixed axes' product {fixed}"
                )
            sizes[free[0]] = n_devices // fixed
        if math.prod(sizes.values()) != n_devices:
            raise ValueError(f"MeshConfig {sizes} does not use exactly {n_devices=} devices")
        return sizes

    def logical_rules(self) -> tuple[tuple[str, object], ...]:
        """The rules with list values as tuples (as Flax expects them)."""
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in self.rules)

    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the ``batch`` logical axis is sharded over (by the rules)."""
        axes = dict(self.logical_rules()).get("batch")
        return (axes,) if isinstance(axes, str) else tuple(axes or ())


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> jax.sharding.Mesh:
    """Builds a mesh with Auto axis types over ``devices`` (default: all devices, every
    process's on a multi-process run)."""
    cfg = cfg or MeshConfig()
    devices = list(devices if devices is not None else jax.devices())
    sizes = cfg.shape(len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    except TypeError:  # older signature without devices=
        arr = np.asarray(devices).reshape(shape)
        return jax.sharding.Mesh(arr, MESH_AXES, axis_types=auto)


@contextlib.contextmanager
def activate(mesh: jax.sharding.Mesh, cfg: MeshConfig | None = None):
    """Context in which Linen logical constraints resolve against ``mesh``."""
    rules = (cfg or MeshConfig()).logical_rules()
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


def logical_to_sharding(tree, mesh: jax.sharding.Mesh, cfg: MeshConfig | None = None):
    """Maps a pytree of logical ``PartitionSpec``s (from ``nn.get_partition_spec``) to shardings."""
    rules = (cfg or MeshConfig()).logical_rules()
    specs = nn.logical_to_mesh(tree, rules)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def fit_spec(spec: P, shape: tuple[int, ...], mesh_sizes: dict[str, int]) -> P:
    """``spec`` with the mesh axes kept only where they divide the dimension.

    Per dimension the axes are taken in order while their running product divides the
    dimension's size; an axis already used by an earlier dimension is dropped.
    """
    used: set[str] = set()
    out = []
    for i, dim in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        keep, size = [], 1
        for a in axes:
            n = mesh_sizes.get(a, 1)
            if a in used or n == 1 or dim % (size * n):
                continue
            keep.append(a)
            size *= n
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def tree_shardings(boxed, mesh: jax.sharding.Mesh, cfg: MeshConfig | None = None):
    """Shardings of a pytree whose leaves carry logical names (``nn.Partitioned`` boxes, e.g.
    ``jax.eval_shape`` of ``model.init`` or of an optimiser's ``init`` on boxed parameters).

    Unboxed leaves are replicated; axes that do not divide a dimension are dropped
    (:func:`fit_spec`). Returns the unboxed tree's structure with a ``NamedSharding`` per leaf.
    """
    rules = (cfg or MeshConfig()).logical_rules()
    sizes = dict(mesh.shape)
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), rules)
    # the boxes' values (nn.unbox would apply the boxes' constraints under an active mesh)
    shapes = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.Partitioned) else x,
        boxed,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )
    return jax.tree.map(
        lambda s, x: NamedSharding(mesh, fit_spec(s, np.shape(x), sizes)),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, P),
    )


def batch_sharding(
    mesh: jax.sharding.Mesh, cfg: MeshConfig | None = None, batch: int | None = None
) -> NamedSharding:
    """Rows (dimension 0) over the rules' ``batch`` axes (those that divide ``batch`` when it is
    given); every other dimension replicated. One sharding serves every ``[B, ...]`` array."""
    axes = (cfg or MeshConfig()).batch_axes()
    spec = P(axes) if batch is None else fit_spec(P(axes), (batch,), dict(mesh.shape))
    return NamedSharding(mesh, spec)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def local_mesh_config(cfg: MeshConfig, n_local: int) -> MeshConfig:
    """The process-local mesh of a multi-process run (rollouts and other per-process work):
    the configured ``tensor`` and ``expert`` sizes where the ``n_local`` devices allow them
    (their product divides ``n_local``), the rest data-parallel (``fsdp`` 1)."""
    tensor = cfg.tensor if cfg.tensor > 0 and n_local % cfg.tensor == 0 else 1
    expert = cfg.expert if cfg.expert > 0 and (n_local // tensor) % cfg.expert == 0 else 1
    return dataclasses.replace(cfg, data=-1, fsdp=1, expert=expert, tensor=tensor)


# Multi-process start-up -------------------------------------------------------------------------
CLUSTER_MARKERS = (
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


def _cluster_processes() -> int | None:
    """Processes a cluster launcher announces (None: no launcher variable)."""
    for var in ("JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").strip():
            return int(os.environ[var])
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "").strip()
    if hosts:
        return len(hosts.split(","))
    return None


def maybe_initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    detect: bool = False,
) -> bool:
    """Calls ``jax.distributed.initialize`` when this is one of several processes.

    Explicit arguments (``agentrl train --coordinator HOST:PORT --num-processes N
    --process-id I``) win; without them a launch is detected from the usual variables
    (``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, SLURM, Open
    MPI, TPU workers on Kubernetes), whose values JAX reads itself; ``detect=True``
    (``--distributed``) initialises with JAX's own cluster detection in any case (Cloud TPU
    VMs, found through their metadata server). CPU collectives go through gloo (the CPU
    backend has no others; GPU and TPU backends ignore the setting). Must run before anything
    touches a JAX backend.

    Returns:
      True if ``jax.distributed`` was initialised (here or before).

    Raises:
      ValueError: only some of the three explicit arguments, ``num_processes`` < 1 or
        ``process_id`` outside ``[0, num_processes)``.
    """
    explicit = (coordinator, num_processes, process_id)
    if any(v is not None for v in explicit) and None in explicit:
        raise ValueError(
            "--coordinator, --num-processes and --process-id go together "
            f"(got coordinator={coordinator!r}, num_processes={num_processes}, "
            f"process_id={process_id})"
        )
    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"--num-processes={num_processes} must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id={process_id} must be in [0, {num_processes})")
        if num_processes == 1:
            return False
    elif not detect and (
        not any(os.environ.get(m) for m in CLUSTER_MARKERS) or _cluster_processes() == 1
    ):
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    log.info(
        "jax.distributed: process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


@dataclasses.dataclass(frozen=True)
class StepShardings:
    """Shardings of a jitted training step ``step(state, batch, *rest) -> (state, metrics)``.

    Attributes:
      mesh: the mesh the step runs on.
      cfg: the mesh config (its logical rules are active while the step traces).
      state: a pytree of ``NamedSharding`` with the state's structure.
      batch: the sharding of every ``[B, ...]`` batch array (rows over the batch axes).
    """

    mesh: jax.sharding.Mesh
    cfg: MeshConfig
    state: object
    batch: NamedSharding

    def jit(self, step, n_rest: int = 0):
        """``step`` jitted with explicit shardings: the state in and out as ``state`` (donated),
        the batch as ``batch``, the ``n_rest`` further arguments (e.g. a PRNG key, or None) and
        the metrics replicated. Calls trace and run under :func:`activate` (logical constraints
        and the MoE layers' expert parallelism see the mesh)."""
        rep = replicated(self.mesh)
        jitted = jax.jit(
            step,
            in_shardings=(self.state, self.batch, *(rep,) * n_rest),
            out_shardings=(self.state, rep),
            donate_argnums=(0,),
        )

        def call(state, batch, *rest):
            with activate(self.mesh, self.cfg):
                return jitted(state, batch, *rest)

        call.jitted = jitted
        return call
