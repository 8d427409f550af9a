"""The chunked forward and teacher-forced logprobs that the sampler and the trainer share.

Alignment (the one rule every loss built on :func:`sequence_logprobs` follows): for tokens
``[B, T]``, ``logp[:, j] = log p(tokens[:, j + 1] | tokens[:, :j + 1])``, so per-token arrays
of a trajectory (``action_mask``, ``advantages``, ``rollout_logprobs``, ...) are shifted with
``x[:, 1:]``. Routes are aligned with the forward position that produced the logprob:
``routes[:, :-1]``.

Parity policies (``policy.parity``) run the teacher-forced pass as a ``lax.scan`` of the
model's chunk function with the sampler's chunk size, page size and cache capacity
(:class:`ChunkSpec`), applying recorded KV evictions (``evict_at``) and int8 KV decisions
(``int8_at``) chunk by chunk and, in either path, recorded sparse block selections
(``replay_blocks``); every path takes logprobs with :func:`fixed_order_logprobs`, the
sampler's reduction. With the sampler's batch size the recomputed logprobs are bitwise the
rollout's.

Shape legend: B sequences, T tokens, V vocab, L MoE layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.transformer import (
    CacheSpec,
    Transformer,
    init_cache,
    token_entropy,
    training_view,
    unchunk_extras,
)
from agentrl_jax.precision import DTypePolicy

NEVER = np.iinfo(np.int32).max  # evict_at / int8_at of a key that is never evicted / int8


def _tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree (same bits whatever the leading shape)."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (n - 1).bit_length()) - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def fixed_order_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[tokens] with a fixed-order sum: fp32 [..., V], int [...] -> f32 [...].

    ``jnp.sum``/``logsumexp`` reduce in an order XLA picks per shape, so the sampler's [B, V]
    rows and the trainer's [B, T, V] block differ in the last bit; the explicit pairwise tree
    does not. Differentiable (the max shift is a constant).
    """
    logits = logits.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = m[..., 0] + jnp.log(_tree_sum(jnp.exp(logits - m)))
    picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - lse


def tempered(logits: jax.Array, temperature: float) -> jax.Array:
    """float32 ``logits / temperature``: the logits of the distribution a sampler at that
    temperature draws from (one definition for the sampler and the trainer)."""
    return logits.astype(jnp.float32) / jnp.float32(temperature)


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """The sampler's chunk geometry that the parity recompute must reproduce.

    Attributes:
      chunk: rows per chunk call (the sampler's prefill/decode chunk C, >= 1).
      page_size: KV page size of the sampler's cache.
      max_len: the sampler's cache capacity per sequence (>= T); None = T.
      n_slots: the sampler's batch size; the trainer's no-gradient recompute runs micro-batches
        of this size so that its logprobs are bitwise the rollout's. None = the whole batch.
      temperature: the sampler's temperature (> 0). The policy being trained is the
        distribution the sampler draws from, ``softmax(logits / temperature)``: training's
        logprobs and entropies are of it (both paths), as the sampler's logprobs are.
    """

    chunk: int = 4
    page_size: int = 16
    max_len: int | None = None
    n_slots: int | None = None
    temperature: float = 1.0

    def __post_init__(self):
        if self.chunk < 1:
            raise ValueError(f"ChunkSpec.chunk={self.chunk} must be >= 1")
        if self.page_size < 1:
            raise ValueError(f"ChunkSpec.page_size={self.page_size} must be >= 1")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"ChunkSpec.max_len={self.max_len} must be >= 1 or None")
        if self.n_slots is not None and self.n_slots < 1:
            raise ValueError(f"ChunkSpec.n_slots={self.n_slots} must be >= 1 or None")
        if not self.temperature > 0:
            raise ValueError(f"ChunkSpec.temperature={self.temperature} must be > 0")


def as_chunk_spec(meta: Any) -> ChunkSpec | None:
    """``ChunkSpec`` from a ChunkSpec, a dict or any object with ``chunk``/``page_size``/
    ``max_len`` (and optionally ``n_slots``) attributes, e.g. the sampler's ``RolloutConfig``;
    None stays None.

    Raises:
      ValueError: ``meta`` has no ``chunk``.
    """
    if meta is None or isinstance(meta, ChunkSpec):
        return meta
    get = meta.get if isinstance(meta, dict) else lambda k, d=None: getattr(meta, k, d)
    chunk = get("chunk", None)
    if chunk is None:
        raise ValueError(f"sampling_meta {meta!r} has no 'chunk'")
    return ChunkSpec(
        chunk=int(chunk),
        page_size=int(get("page_size", 16)),
        max_len=get("max_len"),
        n_slots=get("n_slots"),
        temperature=float(get("temperature", 1.0)),
    )


def with_policy(model: Transformer, policy: DTypePolicy | None) -> Transformer:
    """``model`` itself, or a clone running under ``policy`` (same parameters)."""
    if policy is None or policy == model.policy:
        return model
    return model.clone(policy=policy)


def chunked_logits(
    model: Transformer,
    params,
    tokens: jax.Array,
    spec: ChunkSpec,
    *,
    evict_at: jax.Array | None = None,
    int8_at: jax.Array | None = None,
    replay_routes: jax.Array | None = None,
    replay_blocks: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Teacher-forced logits as a scan of the chunk function (the sampler's computation).

    Keys of position p are visible to a chunk starting at ``s`` iff ``s < evict_at[b, p]``
    (KV-eviction replay; default: never evicted); their F/D-layer K/V are int8 round trips from
    the chunk containing ``int8_at[b, p]`` on (int8 KV replay, ``model.attention``).

    Args:
      model: the Transformer (its policy is used as is).
      params: model parameters.
      tokens: int32 [B, T], T a multiple of ``spec.chunk`` and <= ``spec.max_len``.
      spec: the sampler's chunk geometry.
      evict_at: optional int32 [B, T] recorded eviction positions.
      int8_at: optional int32 [B, T] recorded int8 positions (int32 max = never).
      replay_routes: optional int32 [B, T, L, k].
      replay_blocks: optional int32 [B, T, L_F, K, n] recorded sparse block selections.

    Returns:
      (logits f32 [B, T, V], extras: ``routes`` [B, T, L, k] (MoE), ``values`` [B, T] (value
      head) and the model's scalar MoE losses averaged over chunks).

    Raises:
      ValueError: T not a multiple of the chunk or above ``max_len``.
    """
    b, t = tokens.shape
    c, max_len = spec.chunk, spec.max_len or tokens.shape[1]
    if t % c or t > max_len:
        raise ValueError(f"tokens length {t} must be a multiple of chunk={c} and <= {max_len=}")
    n_chunks = t // c
    cache = init_cache(model.cfg, model.policy, CacheSpec(b, max_len, spec.page_size))
    toks = tokens.reshape(b, n_chunks, c).swapaxes(0, 1)
    rr = rb = None
    if replay_routes is not None:
        rr = replay_routes.reshape(b, n_chunks, c, *replay_routes.shape[2:]).swapaxes(0, 1)
    if replay_blocks is not None:
        rb = replay_blocks.reshape(b, n_chunks, c, *replay_blocks.shape[2:]).swapaxes(0, 1)
    ev = jnp.full((b, max_len), NEVER, jnp.int32)
    if evict_at is not None:
        ev = ev.at[:, :t].set(evict_at.astype(jnp.int32))
    i8 = None
    if int8_at is not None:
        i8 = jnp.full((b, max_len), NEVER, jnp.int32).at[:, :t].set(int8_at.astype(jnp.int32))

    def step(cache, xs):
        tok, rep, blk = xs
        cache = dict(cache)
        cache["keep"] = cache["lengths"][:, None] < ev
        if i8 is not None:
            cache["int8_at"] = i8
        logits, cache, extras = model.apply(
            params,
            tok,
            cache=cache,
            valid=jnp.ones((b, c), bool),
            replay_routes=rep,
            replay_blocks=blk,
        )
        cache.pop("keep")
        cache.pop("int8_at", None)
        return cache, (logits, extras)

    _, (logits, extras) = jax.lax.scan(step, cache, (toks, rr, rb))
    logits = logits.swapaxes(0, 1).reshape(b, t, -1)
    return logits, unchunk_extras(extras, t, jnp.mean)


def sequence_logprobs(
    model: Transformer,
    params,
    tokens: jax.Array,
    policy: DTypePolicy | None = None,
    *,
    valid: jax.Array | None = None,
    replay_routes: jax.Array | None = None,
    evict_at: jax.Array | None = None,
    int8_at: jax.Array | None = None,
    replay_blocks: jax.Array | None = None,
    chunk_spec: ChunkSpec | Any | None = None,
    with_entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None, dict]:
    """Teacher-forced next-token logprobs (and entropies) of ``tokens`` (differentiable).

    Args:
      model: the Transformer; run under ``policy`` when given (same params).
      params: model parameters.
      tokens: int32 [B, T].
      policy: dtype policy (default ``model.policy``); parity policies take the chunked path.
      valid: bool [B, T] non-padding tokens (padding takes no MoE capacity; non-parity path,
        the chunked path treats every row as the sampler did). Either path routes padding
        with the router, whatever ``replay_routes`` holds there.
      replay_routes: int32 [B, T, L, k] routes to force (routing replay), MoE only.
      evict_at: int32 [B, T] recorded KV evictions to replay (parity policies only).
      int8_at: int32 [B, T] recorded int8 KV decisions to replay (parity policies only).
      replay_blocks: int32 [B, T, L_F, K, n] recorded sparse block selections to replay (both
        paths).
      chunk_spec: ``ChunkSpec`` (or anything :func:`as_chunk_spec` accepts, e.g. the sampler's
        ``RolloutConfig``); required by parity policies. Its ``temperature`` tempers the logits
        in either path.
      with_entropy: also return the per-token entropy of the predictive distribution.

    Returns:
      (logp f32 [B, T-1], entropy f32 [B, T-1] or None, extras) with extras the model's
      (``routes`` [B, T, L, k], ``values`` [B, T] with a value head, scalar MoE losses).

    Raises:
      ValueError: a parity policy without ``chunk_spec``, ``evict_at``/``int8_at`` without a
        parity policy, or a bad tokens shape.
    """
    model = with_policy(model, policy)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, T] with T >= 2, got shape {tokens.shape}")
    if replay_routes is not None and valid is not None:
        # Padding is routed by the router (distinct experts), never by a stored route: a padded
        # route such as [0, 0] would force one expert twice per token, overflow its dropless
        # capacity in the chunked path (where every row takes capacity) and drop other rows'
        # pairs, which the sampler never did.
        replay_routes = jnp.where(valid.astype(bool)[:, :, None, None], replay_routes, -1)
    spec = as_chunk_spec(chunk_spec)
    if model.policy.parity:
        if spec is None:
            raise ValueError(
                f"policy {model.policy.name!r} is a parity policy: pass chunk_spec (the sampler's "
                "chunk, page_size, max_len)"
            )
        logits, extras = chunked_logits(
            model,
            params,
            tokens,
            spec,
            evict_at=evict_at,
            int8_at=int8_at,
            replay_routes=replay_routes,
            replay_blocks=replay_blocks,
        )
    else:
        if evict_at is not None or int8_at is not None:
            raise ValueError("evict_at / int8_at (KV-mask replay) needs a parity policy")
        model, params = training_view(model, params)
        logits, _, extras = model.apply(
            params, tokens, valid=valid, replay_routes=replay_routes, replay_blocks=replay_blocks
        )
    if spec is not None and spec.temperature != 1.0:
        logits = tempered(logits, spec.temperature)
    logp = fixed_order_logprobs(logits[:, :-1], tokens[:, 1:])
    entropy = token_entropy(logits[:, :-1]) if with_entropy else None
    return logp, entropy, extras
