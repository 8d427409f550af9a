"""Teacher-forced logprob recompute shared by the RL update and behaviour cloning.

Alignment (the one rule every loss built on this must follow): for tokens ``[B, T]``,
``logp[:, j] = log p(tokens[:, j + 1] | tokens[:, :j + 1])``, so per-token arrays of the
trajectory (``action_mask``, ``advantages``, ``rollout_logprobs``, ...) are shifted with
``x[:, 1:]`` and the loss mask is :func:`target_mask`. Routes are aligned with the forward
position that produced the logprob: ``routes[:, :-1]``.

Parity policies (``policy.parity``) recompute through ``forward_chunked`` with the sampler's
chunk size, page size and cache capacity (:class:`ChunkSpec`), so the recomputed logprobs are
bitwise the sampler's when the batch size matches too.

Shape legend: B sequences, T tokens, V vocab, L MoE layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from agentrl_jax.model.transformer import (
    Transformer,
    forward_chunked,
    token_entropy,
    token_logprobs,
)
from agentrl_jax.precision import DTypePolicy


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """The sampler's chunk geometry that the parity recompute must reproduce.

    Attributes:
      chunk: rows per chunk call (the sampler's prefill/decode chunk C, >= 1).
      page_size: KV page size of the sampler's cache.
      max_len: the sampler's cache capacity per sequence; None = T rounded up to ``chunk``.
    """

    chunk: int = 16
    page_size: int = 16
    max_len: int | None = None

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"ChunkSpec.chunk={self.chunk} must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"ChunkSpec.page_size={self.page_size} must be >= 1")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"ChunkSpec.max_len={self.max_len} must be >= 1 or None")


def as_chunk_spec(meta: Any) -> ChunkSpec | None:
    """``ChunkSpec`` from a ChunkSpec, a dict or any object with ``chunk``/``page_size``/
    ``max_len`` attributes (e.g. the sampler's config); None stays None."""
    if meta is None or isinstance(meta, ChunkSpec):
        return meta
    get = meta.get if isinstance(meta, dict) else lambda k, d=None: getattr(meta, k, d)
    chunk = get("chunk", None)
    if chunk is None:
        raise ValueError(f"sampling_meta {meta!r} has no 'chunk'")
    return ChunkSpec(chunk=int(chunk), page_size=int(get("page_size", 16)), max_len=get("max_len"))


def with_policy(model: Transformer, policy: DTypePolicy | None) -> Transformer:
    """``model`` itself, or a clone running under ``policy`` (same parameters)."""
    if policy is None or policy == model.policy:
        return model
    return model.clone(policy=policy)


def target_mask(action_mask: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Loss mask aligned with :func:`sequence_logprobs`: bool [B, T] -> bool [B, T-1].

    Entry j is True when token j+1 is a (valid) action token, i.e. logp[:, j] is trained on.
    """
    m = action_mask.astype(bool)
    if valid is not None:
        m = m & valid.astype(bool)
    return m[:, 1:]


def sequence_logprobs(
    model: Transformer,
    params,
    tokens: jax.Array,
    policy: DTypePolicy | None = None,
    *,
    valid: jax.Array | None = None,
    replay_routes: jax.Array | None = None,
    chunk_spec: ChunkSpec | Any | None = None,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None, dict]:
    """Teacher-forced next-token logprobs (and entropies) of ``tokens`` (differentiable).

    Args:
      model: the Transformer; run under ``policy`` when given (same params).
      params: model parameters.
      tokens: int32 [B, T].
      policy: dtype policy (default ``model.policy``); parity policies take the chunked path.
      valid: bool [B, T] non-padding tokens (padding takes no MoE capacity; non-parity path).
      replay_routes: int32 [B, T, L, k] routes to force (routing replay), MoE only.
      chunk_spec: ``ChunkSpec`` (or anything :func:`as_chunk_spec` accepts); required by parity
        policies.
      with_entropy: also return the per-token entropy of the predictive distribution.

    Returns:
      (logp f32 [B, T-1], entropy f32 [B, T-1] or None, extras) with extras the model's
      (``routes`` [B, T, L, k] and scalar MoE losses; on the chunked path the scalar losses are
      means over chunks).

    Raises:
      ValueError: a parity policy without ``chunk_spec``, or a bad tokens shape.
    """
    model = with_policy(model, policy)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, T] with T >= 2, got shape {tokens.shape}")
    if model.policy.parity:
        spec = as_chunk_spec(chunk_spec)
        if spec is None:
            raise ValueError(
                f"policy {model.policy.name!r} is a parity policy: pass chunk_spec (the sampler's "
                "chunk, page_size, max_len)"
            )
        logits, extras = forward_chunked(
            model,
            params,
            tokens,
            chunk=spec.chunk,
            page_size=spec.page_size,
            max_len=spec.max_len,
            replay_routes=replay_routes,
        )
        n_chunks = -(-tokens.shape[1] // spec.chunk)
        extras = {k: v if k == "routes" else v / n_chunks for k, v in extras.items()}
    else:
        logits, _, extras = model.apply(params, tokens, valid=valid, replay_routes=replay_routes)
    logp = token_logprobs(logits[:, :-1], tokens[:, 1:])
    entropy = token_entropy(logits[:, :-1]) if with_entropy else None
    return logp, entropy, extras

