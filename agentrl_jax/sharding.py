"""Meshes, logical-axis rules and multi-host start-up.

Mesh axes are ``data, fsdp, expert, tensor``. Parameters and activations carry logical axis names
(``nn.with_logical_partitioning`` / ``nn.with_logical_constraint``); ``MeshConfig.rules`` maps
them to mesh axes. Meshes are built with explicit ``Auto`` axis types because ``jax.make_mesh``
defaults to Explicit axes in current JAX, which Linen's logical sharding does not use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import jax
import numpy as np
from flax import linen as nn

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
    """Mesh shape. ``-1`` in one axis means "all remaining devices".

    Attributes:
      data, fsdp, expert, tensor: axis sizes (their product must equal the device count).
      rules: logical-axis rules as ``((logical, mesh_axis_or_None_or_tuple), ...)``.
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES

    def shape(self, n_devices: int) -> dict[str, int]:
        """Resolves ``-1`` and validates the product against ``n_devices``."""
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        for a, s in sizes.items():
            if s == 0 or s < -1:
                raise ValueError(f"MeshConfig.{a}={s} must be a positive int or -1")
        if len(free) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {free}")
        fixed = int(np.prod([s for s in sizes.values() if s != -1]))
        if free:
            if n_devices % fixed:
                raise ValueError(
                    f"MeshConfig: {n_devices=} is not divisible by the fixed axes' product {fixed}"
                )
            sizes[free[0]] = n_devices // fixed
        if int(np.prod(list(sizes.values()))) != n_devices:
            raise ValueError(f"MeshConfig {sizes} does not use exactly {n_devices=} devices")
        return sizes

    def logical_rules(self) -> tuple[tuple[str, object], ...]:
        return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in self.rules)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> jax.sharding.Mesh:
    """Builds a mesh with Auto axis types over ``devices`` (default: all devices)."""
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
        lambda s: jax.sharding.NamedSharding(mesh, s),
        specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


def maybe_initialize_distributed() -> bool:
    """Calls ``jax.distributed.initialize()`` when launched as one of several processes.

    Detects multi-process launches through the usual coordinator variables
    (``JAX_COORDINATOR_ADDRESS``, SLURM, Open MPI, TPU pod metadata is auto-detected by JAX).
    Returns True if initialisation ran.
    """
    markers = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_ID")
    if not any(m in os.environ for m in markers):
        return False
    n = int(os.environ.get("SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "2")))
    if n <= 1:
        return False
    jax.distributed.initialize()
    logging.info("jax.distributed initialised: process %d of %d", jax.process_index(), n)
    return True
