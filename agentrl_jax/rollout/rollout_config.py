"""``RolloutConfig``: how the rollout samples tokens and how its KV cache is shaped.

The sampler (``rollout.sampler``) and the agent loop (``rollout.agent_loop``) read it; it is the
experiment config's ``rollout`` section.
"""

from __future__ import annotations

import dataclasses

from agentrl_jax.model.decode_params import DecodeOptions


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How tokens are sampled and how the cache is shaped (hashable: a static jit argument).

    Attributes:
      temperature: softmax temperature (> 0) of the sampling distribution.
      top_p: nucleus mass in (0, 1]; 1 disables.
      top_k: keep the k most likely tokens; 0 disables.
      greedy: argmax instead of sampling (temperature/top-k/top-p ignored).
      max_new_tokens: most tokens generated per model turn.
      stop_tokens: ids that end a turn (the stop token is kept and cached); empty -> the agent
        loop uses the tokenizer's ``</call>``, ``<eot>``, ``<eos>``.
      chunk: decode chunk rows C (>= 1; parity policies need the trainer's chunk, default 4).
      prefill_chunk: prefill chunk rows Cp; None -> ``chunk`` (parity policies always use chunk).
      page_size: KV page size (a multiple of the model's ``sparse_block_size``).
      max_len: cache capacity per sequence (tokens).
      decode_kernel: decode one row per step through the paged decode kernel under non-parity
        policies (module docstring); ignored under parity policies.
      eviction_threshold: KV eviction of finished tool outputs (``kv_cache.EvictionConfig``
        threshold, in [0, 1]; 0 disables): the agent loop's default when it is given no
        ``eviction`` (so ``agentrl train`` sets it as ``rollout.eviction_threshold``).
      eviction_int8: with ``eviction_threshold``: move those tokens' K/V to int8 instead.
      eviction_drop_threshold: with ``eviction_int8``: blocks under this share are evicted
        rather than moved to int8 (``EvictionConfig.drop_threshold``).
      n_pages: shared KV page pool of the agent loop when its options give none (None: every
        slot owns ``max_len`` worth of pages).
      int8_pages: int8 page pool of the agent loop with int8 eviction and a shared pool, when
        its options give none (None: ``n_pages``).
      record_blocks: record every F layer's sparse block selection per token
        (``Trajectory.sparse_blocks``; replayed by the trainer with ``rl.use_block_replay``).
      last_row_logits: non-parity prefill runs the LM head on each sequence's last new row only
        (parity policies run it on every row, as the trainer's chunks do).
      fuse_projections: the one-row decode's parameters join each dense MLP's gate and up
        projections (``model.decode_params``; where its table allows).
      transpose_head: the one-row decode's parameters hold a tied head's table transposed
        (where its table allows; packing for the ``decode_matmul`` kernel is the experiment's
        ``kernels.decode_matmul`` choice).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    max_new_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()
    chunk: int = 4
    prefill_chunk: int | None = None
    page_size: int = 16
    max_len: int = 512
    decode_kernel: bool = True
    eviction_threshold: float = 0.0
    eviction_int8: bool = False
    eviction_drop_threshold: float = 0.0
    n_pages: int | None = None
    int8_pages: int | None = None
    record_blocks: bool = False
    last_row_logits: bool = True
    fuse_projections: bool = True
    transpose_head: bool = True

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"RolloutConfig.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutConfig.top_p={self.top_p} must be in (0, 1]")
        for field, lo in (("top_k", 0), ("max_new_tokens", 1), ("chunk", 1), ("page_size", 1)):
            v = getattr(self, field)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"RolloutConfig.{field}={v!r} must be an int >= {lo}")
        for field in ("prefill_chunk", "n_pages", "int8_pages"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"RolloutConfig.{field}={v!r} must be None or an int >= 1")
        if self.max_len < self.chunk or self.max_len % self.page_size:
            raise ValueError(
                f"RolloutConfig.max_len={self.max_len} must be >= chunk={self.chunk} and a "
                f"multiple of page_size={self.page_size}"
            )
        if not 0.0 <= self.eviction_threshold <= 1.0:
            raise ValueError(
                f"RolloutConfig.eviction_threshold={self.eviction_threshold} must be in [0, 1]"
            )
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))

    def prefill_rows(self, parity: bool) -> int:
        """Prefill chunk rows actually used (``chunk`` under a parity policy)."""
        return self.chunk if parity or self.prefill_chunk is None else self.prefill_chunk

    def decode_options(self) -> DecodeOptions:
        """The rewrites the one-row decode's parameters may take (``model.decode_params``)."""
        return DecodeOptions(
            fuse_projections=self.fuse_projections, transpose_head=self.transpose_head
        )

    def replace(self, **changes) -> RolloutConfig:
        return dataclasses.replace(self, **changes)
