"""What the benchmarks and the tests share: one timing helper and one set of tiny model configs.

Timing (``time_ms``, ``Timing``): warm-up calls first, then ``reps`` timed calls, each waited
for with ``sync`` (``jax.block_until_ready`` on the call's output unless told otherwise, e.g.
``torch.cuda.synchronize`` in the PyTorch baselines); the result is in milliseconds: median,
min, max. ``Timing.from_ms`` summarises times collected elsewhere (round-robin loops).

Model configs (``PRESETS``, ``preset``): plain keyword dicts for ``ModelConfig``, so this module
imports neither jax nor the package at import time and the PyTorch baselines (a separate venv)
read the same shapes. ``bench-dense`` / ``bench-moe`` are the benchmark models (4 layers,
d_model 256, 4 query / 2 KV heads of dim 64, vocab 1024, tied embeddings; FFN 768 or 8 experts
top-2 of hidden 384); the ``tiny-*`` presets are the test-sized models.

Scripts in this directory import it as ``common`` (a script's directory is on ``sys.path``);
tests import it as ``benchmarks.common`` from the repository root.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

PROMPT, NEW = 64, 128  # the benchmark sequences: 64 prompt tokens + 128 new (action) tokens

_BENCH = dict(
    vocab_size=1024,
    d_model=256,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    window=64,
    sparse_block_size=16,
    sparse_topk_tokens=64,
    tie_embeddings=True,
)
_TINY = dict(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    window=8,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    d_ff=48,
    init_std=0.2,
)
_TINY_MOE = dict(n_experts=4, experts_per_token=2, d_expert=16)
_SMALL_MOE = dict(
    vocab_size=512,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    layer_pattern="SSSF",
    window=32,
    sparse_block_size=8,
    sparse_topk_tokens=32,
    n_experts=4,
    experts_per_token=2,
    d_expert=64,
)

PRESETS: dict[str, dict[str, Any]] = {
    # The benchmark models (rollout, teacher_forced, update and the PyTorch baselines).
    "bench-dense": {**_BENCH, "d_ff": 768},
    "bench-moe": {**_BENCH, "n_experts": 8, "experts_per_token": 2, "d_expert": 384},
    # Test-sized: 2 layers of width 32 (dense, or MoE with 4 experts top-2), and one layer of
    # width 16 for loops that run whole episodes (SFT, evaluation).
    "tiny-dense": {**_TINY, "layer_pattern": "SD"},
    "tiny-moe": {**_TINY, **_TINY_MOE, "layer_pattern": "SF"},
    "tiny-1layer": dict(
        vocab_size=512,
        d_model=16,
        n_layers=1,
        layer_pattern="D",
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        d_ff=32,
        window=512,
    ),
    # A small hybrid MoE: compile_depth (at depths 4..96) and parity (4 layers, window 16).
    "small-moe-sssf": {**_SMALL_MOE, "n_layers": 4},
}


def preset_kwargs(name: str, **overrides: Any) -> dict[str, Any]:
    """The ``ModelConfig`` keyword arguments of preset ``name``, with ``overrides`` applied.

    Raises:
      ValueError: ``name`` is not a preset.
    """
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} unknown; allowed: {', '.join(PRESETS)}")
    return {**PRESETS[name], **overrides}


def preset(name: str, **overrides: Any):
    """``ModelConfig`` of preset ``name`` with ``overrides`` (e.g. ``layer_pattern="SSSF"``).

    Raises:
      ValueError: ``name`` is not a preset, or the config rejects the values.
    """
    from agentrl_jax.model.config import ModelConfig

    return ModelConfig(**preset_kwargs(name, **overrides))


def bench_model(kind: str, pattern: str, **overrides: Any):
    """The benchmark model: ``kind`` 'dense' or 'moe', attention ``pattern`` (e.g. 'D', 'SSSF').

    Raises:
      ValueError: ``kind`` is neither 'dense' nor 'moe'.
    """
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind={kind!r}; allowed: 'dense', 'moe'")
    return preset(f"bench-{kind}", layer_pattern=pattern, **overrides)


def update_matmul_flops(kind: str, batch: int = 8, seq: int = PROMPT + NEW) -> int:
    """Matmul FLOPs of one forward + backward of the benchmark model on ``batch x seq`` tokens.

    Counts what any implementation must multiply (3x the forward: the backward takes the
    gradients of the activations and of the weights): per token and layer the q/k/v/o
    projections, causal attention scores and values over the ``(t + 1) / 2`` keys a token sees on
    average, the FFN (dense SwiGLU, or ``experts_per_token`` routed SwiGLU experts: dropless, no
    capacity slack) and the router; then the LM head. Norms, softmax, RoPE and AdamW are not
    matmuls and are left out, so the count is a floor.

    Raises:
      ValueError: ``kind`` is neither 'dense' nor 'moe'.
    """
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind={kind!r}; allowed: 'dense', 'moe'")
    c = PRESETS[f"bench-{kind}"]
    d, h, nq, nkv = c["d_model"], c["head_dim"], c["n_heads"], c["n_kv_heads"]
    proj = d * h * (2 * nq + 2 * nkv)  # q and o: nq heads; k and v: nkv heads
    attn = 2 * nq * h * (seq + 1) / 2  # scores and values
    if kind == "dense":
        ffn = 3 * d * c["d_ff"]
    else:
        ffn = c["experts_per_token"] * 3 * d * c["d_expert"] + d * c["n_experts"]
    macs_per_token = c["n_layers"] * (proj + attn + ffn) + d * c["vocab_size"]
    return int(3 * 2 * macs_per_token * batch * seq)


class Timing(NamedTuple):
    """Wall times of repeated calls, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    reps: int

    @classmethod
    def from_ms(cls, times_ms: Sequence[float]) -> Timing:
        """Summarises ``times_ms`` (at least one).

        Raises:
          ValueError: ``times_ms`` is empty.
        """
        if not times_ms:
            raise ValueError("times_ms is empty: time at least one call")
        return cls(statistics.median(times_ms), min(times_ms), max(times_ms), len(times_ms))

    def fields(self, prefix: str = "ms", digits: int = 3) -> dict[str, float]:
        """``{prefix: median, prefix_min: min, prefix_max: max}``, rounded, for a JSON line."""
        return {
            prefix: round(self.median_ms, digits),
            f"{prefix}_min": round(self.min_ms, digits),
            f"{prefix}_max": round(self.max_ms, digits),
        }


def _block_until_ready(out: Any) -> None:
    import jax

    jax.block_until_ready(out)


def time_ms(
    fn: Callable[[], Any],
    *,
    reps: int = 5,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
) -> Timing:
    """Times ``fn()`` after ``warmup`` untimed calls; every call is waited for with ``sync``.

    Args:
      fn: the call to time (no arguments; close over them).
      reps: timed calls (>= 1).
      warmup: untimed calls first (compilation, caches, allocator), >= 0.
      sync: called with each call's output before the clock stops; ``jax.block_until_ready``
        when None. Pass ``lambda _: torch.cuda.synchronize()`` for PyTorch on a GPU, or
        ``lambda _: None`` for host-only work.

    Returns:
      ``Timing`` of the ``reps`` timed calls, in milliseconds.

    Raises:
      ValueError: ``reps < 1`` or ``warmup < 0``.
    """
    return time_interleaved([fn], reps=reps, warmup=warmup, sync=sync)[0]


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    *,
    reps: int = 5,
    warmup: int = 1,
    sync: Callable[[Any], Any] | None = None,
) -> list[Timing]:
    """:func:`time_ms` of each of ``fns``, in rounds: one call of each per round (after
    ``warmup`` untimed rounds), so drift in the machine's speed hits every function alike and
    their ratios hold where separate runs' rates do not.

    Raises:
      ValueError: no functions, ``reps < 1`` or ``warmup < 0``.
    """
    if not fns or reps < 1 or warmup < 0:
        raise ValueError(f"reps={reps} must be >= 1 and warmup={warmup} >= 0, for {len(fns)} fns")
    sync = _block_until_ready if sync is None else sync
    for _ in range(warmup):
        for fn in fns:
            sync(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            sync(fn())
            out.append((time.perf_counter() - t0) * 1e3)
    return [Timing.from_ms(t) for t in times]


def load_avg() -> float | None:
    """The 1-minute load average (None where the OS does not report one)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def env_fields(extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``backend``, ``devices``, ``jax_version`` and ``paged_decode_impl`` (what
    ``impl='auto'`` runs for paged decode on CPU: 'cpu' where the C++ kernel builds, else
    'xla') for a JSON line (imports jax)."""
    import jax
    from agentrl_jax.kernels import select_impl

    backend = jax.default_backend()
    out = {
        "backend": backend,
        "devices": jax.device_count(),
        "jax_version": jax.__version__,
        # on accelerators the choice depends on each call's shapes
        "paged_decode_impl": select_impl("paged_decode") if backend == "cpu" else "per shape",
    }
    out.update(extra or {})
    return out
