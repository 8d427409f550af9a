"""Prefill/decode disaggregation: prefill on one device sub-mesh, decode on another.

``run_episodes(..., disaggregate=Disaggregation((0, 1, 2, 3), (4, 5, 6, 7)))`` keeps two copies
of the sampler state: one on the prefill sub-mesh A, one on the decode sub-mesh B (meshes from
``agentrl_jax.sharding.make_mesh``: ``jax.make_mesh`` with explicit Auto axis types). Parameters
and state are replicated within each sub-mesh (every device of a sub-mesh computes the whole
batch: simple and bitwise equal to one device; sharding slots over a sub-mesh is the next step).

Per prefill call of the agent loop:
  1. B -> A: for every slot being prefilled, the KV its decode wrote since A last saw it (the
     pages covering those positions, the slot's S-layer ring rows, its ``lengths`` entry);
  2. prefill runs on A (its outputs live on A's devices);
  3. A -> B: the prefilled slots' new KV (pages covering the new positions, ring rows,
     ``lengths`` and next-token ``logits`` rows); decode then runs on B.
Rows are gathered on the source, moved with ``jax.device_put`` and scattered into the other
copy; the bytes moved are counted per slot (``kv_moved_bytes`` in the turn logs) and in
``RolloutStats.kv_moved_bytes``. Block tables and slot resets are applied to both copies by the
host. KV eviction / int8 decisions are not supported (they rewrite older pages in place). One
gather / ``device_put`` / scatter per slot and layer buffer: batching the slots of a call into
one transfer, and sharding slots within a sub-mesh, are the obvious next optimisations.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np

from agentrl_jax.sharding import make_mesh

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Disaggregation:
    """Device ids (indices into ``jax.devices()``) of the prefill and decode sub-meshes.

    Raises:
      ValueError: if a side is empty, the sides overlap, or an id is out of range.
    """

    prefill_devices: tuple[int, ...]
    decode_devices: tuple[int, ...]

    def __post_init__(self):
        for field in ("prefill_devices", "decode_devices"):
            ids = tuple(int(i) for i in getattr(self, field))
            if not ids or len(set(ids)) != len(ids):
                raise ValueError(f"Disaggregation.{field}={ids} must be non-empty and unique")
            object.__setattr__(self, field, ids)
        if set(self.prefill_devices) & set(self.decode_devices):
            raise ValueError(
                f"Disaggregation: prefill_devices={self.prefill_devices} and "
                f"decode_devices={self.decode_devices} overlap"
            )

    def meshes(self) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
        """(prefill mesh, decode mesh); raises ValueError for ids >= ``jax.device_count()``."""
        devices = jax.devices()
        ids = self.prefill_devices + self.decode_devices
        if max(ids) >= len(devices):
            raise ValueError(f"Disaggregation device ids {ids} need > {len(devices)} devices")
        return tuple(make_mesh(devices=[devices[i] for i in d]) for d in (
            self.prefill_devices, self.decode_devices))  # fmt: skip


def place(tree, mesh: jax.sharding.Mesh):
    """``tree`` replicated on every device of ``mesh`` (already placed leaves are not copied)."""
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def slot_pages(tables: np.ndarray, slot: int, lo: int, hi: int, page_size: int) -> list[int]:
    """Pool pages of ``slot`` holding positions ``[lo, hi)`` (from host block tables)."""
    row = tables[slot, lo // page_size : -(-hi // page_size)]
    return [int(p) for p in row if p >= 0]


@functools.partial(jax.jit, static_argnums=3, donate_argnums=0)
def _scatter(x, idx, part, axis):
    return x.at[(slice(None),) * axis + (idx,)].set(part)


def move_rows(src, dst, mesh, slots, pages, *, pattern: str, logits: bool):
    """Copies slot rows and pool pages of DecodeState ``src`` into ``dst`` on ``mesh``.

    Args:
      src, dst: DecodeStates on different sub-meshes (same shapes).
      mesh: the mesh ``dst`` lives on.
      slots: slot indices whose S-layer ring rows and ``lengths`` (and with ``logits`` their
        next-token logits rows) are copied.
      pages: pool page ids copied in every F/D layer.
      pattern: the model's layer pattern (``layer_i`` of kind ``S`` is a ring indexed by slot).
      logits: copy the logits rows too.

    Returns:
      (new dst, bytes moved).
    """
    moved = 0

    def copy(x_src, x_dst, idx, axis):
        nonlocal moved
        if not len(idx):
            return x_dst
        idx = np.asarray(idx, np.int32)
        part = place(x_src.take(idx, axis=axis), mesh)
        moved += part.nbytes
        return _scatter(x_dst, idx, part, axis)

    layers = {}
    for name, layer in dst.cache["layers"].items():  # [G, B, W, K, H] rings, [G, P, L, K, H]
        idx = slots if pattern[int(name[6:])] == "S" else pages
        src_layer = src.cache["layers"][name]
        layers[name] = {key: copy(src_layer[key], x, idx, 1) for key, x in layer.items()}
    cache = dict(dst.cache, layers=layers)
    cache["lengths"] = copy(src.cache["lengths"], dst.cache["lengths"], slots, 0)
    state = dst._replace(cache=cache)
    if logits:
        state = state._replace(logits=copy(src.logits, dst.logits, slots, 0))
    return state, moved


class Split:
    """Host side of a disaggregated rollout: the prefill-mesh copy of the sampler state.

    Args:
      plan: the two sub-meshes' device ids.
      sampler: the rollout's ``Sampler``.
      params: model parameters (placed on both sub-meshes).
      state: the initial DecodeState (copied to the prefill mesh; :meth:`to_decode` places the
        caller's copy on the decode mesh).
      tables: int32 [slots, max_pages] host block tables (kept current by the caller).
    """

    def __init__(self, plan: Disaggregation, sampler, params, state, tables: np.ndarray):
        self.mesh_a, self.mesh_b = plan.meshes()
        self.sampler, self.tables = sampler, tables
        self.params_a, self.params_b = place(params, self.mesh_a), place(params, self.mesh_b)
        self.state_a = place(state, self.mesh_a)
        self.upto = np.zeros(tables.shape[0], np.int64)  # tokens per slot current on mesh A
        self.prefill_devices: set[int] = set()
        self.decode_devices: set[int] = set()

    def set_params(self, params):
        """New parameters on both sub-meshes; returns the decode-side copy."""
        self.params_a, self.params_b = place(params, self.mesh_a), place(params, self.mesh_b)
        return self.params_b

    def to_decode(self, tree):
        return place(tree, self.mesh_b)

    def reset(self, state_b, mask, tables=None):
        """Applies ``Sampler.reset_slots(mask, tables)`` to the prefill copy; returns the
        (already reset) decode-side ``state_b`` placed on the decode mesh."""
        self.state_a = place(self.sampler.reset_slots(self.state_a, mask, tables), self.mesh_a)
        self.upto[np.asarray(mask)] = 0
        return self.to_decode(state_b)

    def _move(self, s, src, dst, mesh, lo, hi, *, logits):
        pages = slot_pages(self.tables, s, lo, hi, self.sampler.cfg.page_size)
        pattern = self.sampler.model.cfg.layer_pattern
        dst, n = move_rows(src, dst, mesh, [s], pages, pattern=pattern, logits=logits)
        logger.debug("slot %d: moved KV of positions [%d, %d), %d bytes", s, lo, hi, n)
        return dst, n

    def prefill(self, state_b, tokens, n_new, cached):
        """``Sampler.prefill`` on the prefill mesh with the KV moved both ways.

        Args:
          state_b: the decode-side DecodeState.
          tokens, n_new: as ``Sampler.prefill`` (int32 [B, Tp], int32 [B]).
          cached: int [B] tokens each slot has cached before this prefill.

        Returns:
          (new state_b, routes or None, int64 [B] bytes moved per slot).
        """
        moved = np.zeros(len(n_new), np.int64)
        for s in np.nonzero(n_new)[0]:  # KV written by decode that the prefill attends to
            if cached[s] > self.upto[s]:
                self.state_a, moved[s] = self._move(
                    s, state_b, self.state_a, self.mesh_a, self.upto[s], cached[s], logits=False
                )
        self.state_a, routes = self.sampler.prefill(self.params_a, self.state_a, tokens, n_new)
        self.prefill_devices |= {d.id for d in self.state_a.logits.sharding.device_set}
        for s in np.nonzero(n_new)[0]:
            lo, hi = int(cached[s]), int(cached[s] + n_new[s])
            state_b, n = self._move(s, self.state_a, state_b, self.mesh_b, lo, hi, logits=True)
            moved[s] += n
            self.upto[s] = hi
        return state_b, routes, moved
