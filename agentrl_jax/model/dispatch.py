"""Which attention runs: the one place the model's attention decisions are made.

Two levels, each one table:

* **Paths** (:data:`PATHS`, :func:`attention_path`): how a layer attends, from the layer kind,
  teacher-forced or cached, a one-row decode, sinks, attention-mass tracking, stored block
  means (``ModelConfig.sparse_gather``) and the policy's parity. The first row whose condition
  holds is taken. ``model.attention`` (teacher-forced, S rings) and ``model.paged_attention``
  (cached F/D layers) run the path they are given; :func:`one_row_decode` is the sampler's
  choice between the one-row decode model and chunks.
* **Kernels** (:func:`kernel_impl`): which implementation of a kernel op a path calls, from the
  run's per-op choice (``DTypePolicy.kernel_choice``: the experiment's ``kernels`` section and
  ``kernel_impl`` key) resolved by the op's table (``kernels.select.TABLE``: backend, shapes,
  dtype).

:func:`describe` says what both resolve to for a model (the run's log prints it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.precision import DTypePolicy


def kernel_impl(
    policy: DTypePolicy, op: str, shape: kernels.OpShape | None = None, backend: str | None = None
) -> str:
    """The concrete impl of kernel ``op`` for a call of ``shape``: ``policy.kernel_choice(op)``
    resolved by ``kernels.select_impl`` (the op's table). Raises ValueError as it does."""
    return kernels.select_impl(op, policy.kernel_choice(op), shape, backend)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The signals one layer call's attention path is chosen from.

    Attributes:
      kind: the layer kind, 'S', 'F' or 'D'.
      cached: a chunk appended to a cache (prefill, decode, the trainer's chunked pass); False:
        teacher-forced.
      one_row: the one-row decode (a ``decode_kernel`` model on a chunk of one row).
      sinks: the layer has learned attention sinks.
      tracks_mass: the cache accumulates the attention mass each key receives (KV eviction).
      sparse_gather: an F layer keeps block means and reads only its selected blocks.
      parity: the policy's trainer pass must equal the sampler's bitwise.
    """

    kind: str
    cached: bool
    one_row: bool = False
    sinks: bool = False
    tracks_mass: bool = False
    sparse_gather: bool = False
    parity: bool = False


def _kernel(c: AttentionCall) -> bool:
    """The paged decode kernel can serve the call: one row, no probabilities (mass), no sink."""
    return c.one_row and not c.tracks_mass and not c.sinks


def _gather(c: AttentionCall) -> bool:
    return c.kind == "F" and c.sparse_gather


# (path, condition, what runs); the first row whose condition holds is the path.
PATHS: tuple[tuple[str, Callable[[AttentionCall], bool], str], ...] = (
    # teacher-forced
    ("sinks", lambda c: not c.cached and c.sinks,
     "model.sinks.sink_attention over the window (S) or all keys (XLA: no kernel has sinks)"),
    ("sliding_window", lambda c: not c.cached and c.kind in ("S", "D"),
     "kernel op sliding_window (window W for S, T for D)"),
    ("block_sparse", lambda c: not c.cached,
     "select_blocks (or the replayed blocks), kernel op block_sparse"),
    # cached
    ("ring", lambda c: c.kind == "S", "the ring buffer and the chunk, masked (XLA)"),
    ("decode_dense", lambda c: c.kind == "D" and _kernel(c),
     "kernel op paged_decode over the live pages"),
    ("decode_gathered", lambda c: _gather(c) and _kernel(c),
     "blocks scored on the stored means, kernel op paged_decode over them"),
    ("gathered", _gather, "blocks scored on the stored means, only their keys read (XLA)"),
    ("decode_sparse", _kernel,
     "select_blocks on the live pages' keys, kernel op paged_decode over the selected blocks"),
    ("live_dense", lambda c: c.kind == "D" and not c.tracks_mass and not c.parity,
     "the live pages gathered and masked (page buckets; XLA)"),
    ("masked", lambda c: True, "the whole context gathered and masked (F: to its blocks; XLA)"),
)  # fmt: skip
PATH_NAMES = tuple(name for name, _, _ in PATHS)


def attention_path(call: AttentionCall) -> str:
    """The first row of :data:`PATHS` whose condition holds for ``call``.

    Raises:
      ValueError: an unknown layer kind.
    """
    if call.kind not in ("S", "F", "D"):
        raise ValueError(f"AttentionCall.kind={call.kind!r}; allowed: 'S', 'F', 'D'")
    return next(name for name, holds, _ in PATHS if holds(call))


def one_row_decode(policy: DTypePolicy, requested: bool, tracks_mass: bool) -> bool:
    """Whether the sampler decodes one row per step with the ``decode_kernel`` model: asked for
    (``RolloutConfig.decode_kernel``), not under a parity policy (the kernel sums in another
    order than the trainer's chunks), not while tracking attention mass (the kernel returns no
    probabilities); else it decodes in chunks."""
    return requested and not policy.parity and not tracks_mass


def op_shapes(cfg: ModelConfig, policy: DTypePolicy, seq_len: int, page_size: int) -> dict:
    """The ``OpShape`` of each kernel op for one sequence of ``seq_len`` tokens of this model
    (``page_size``-token pages; decode_matmul: a [D, *] weight under the policy's dtypes)."""
    dtype = jnp.dtype(policy.compute).name
    base = kernels.OpShape(
        head_dim=cfg.head_dim,
        group=cfg.n_heads // cfg.n_kv_heads,
        dtype=dtype,
        seq_len=seq_len,
        kv_heads=cfg.n_kv_heads,
    )
    operands = "float8_e4m3fn" if policy.fp8_matmul else dtype
    return {
        "sliding_window": base,
        "block_sparse": dataclasses.replace(
            base, block_size=cfg.sparse_block_size, n_sel=cfg.sparse_topk_blocks
        ),
        "paged_decode": dataclasses.replace(
            base, page_size=page_size, max_pages=-(-seq_len // page_size)
        ),
        "decode_matmul": kernels.OpShape(
            head_dim=cfg.d_model, dtype=operands, accum=policy.accum_dtype
        ),
    }


def describe(
    cfg: ModelConfig,
    policy: DTypePolicy,
    *,
    seq_len: int,
    page_size: int,
    decode_kernel: bool = True,
    backend: str | None = None,
) -> str:
    """One line for the run's log: each kernel op's impl at this model's shapes (one sequence
    of ``seq_len`` tokens) and each layer kind's attention path, teacher-forced / prefill /
    decode (``decode_kernel``: ``RolloutConfig.decode_kernel``; decode without KV eviction's
    mass tracking)."""
    backend = backend or kernels.select.current_backend()
    shapes = op_shapes(cfg, policy, seq_len, page_size)
    ops = ", ".join(
        f"{op}={kernel_impl(policy, op, shapes[op], backend)} ({policy.kernel_choice(op)})"
        for op in kernels.OPS
    )
    one_row = one_row_decode(policy, decode_kernel, tracks_mass=False)
    paths = []
    for kind in dict.fromkeys(cfg.layer_pattern):
        base = AttentionCall(
            kind,
            cached=False,
            sinks=cfg.attn_sinks,
            sparse_gather=cfg.sparse_gather,
            parity=policy.parity,
        )
        runs = [attention_path(base)]
        for row in (False, one_row):
            runs.append(attention_path(dataclasses.replace(base, cached=True, one_row=row)))
        paths.append(f"{kind} {'/'.join(runs)}")
    return (
        f"kernels on {backend} at T={seq_len}: {ops}; attention paths "
        f"(teacher/prefill/decode): {', '.join(paths)}"
    )
