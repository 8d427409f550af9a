"""The decoder: embedding, a scanned stack of layer-pattern groups, fp32 logits.

Legend: B batch, T time, C chunk length, D model dim, V vocab, G pattern groups (scan length),
P layers per group (``len(layer_pattern)``), L_moe MoE layers (``n_layers`` when MoE), k experts
per token.

One ``Transformer.apply`` serves both paths:
  * teacher-forced: ``apply(params, tokens[B,T])`` (training, logprob recompute);
  * chunked with a cache: ``apply(params, tokens[B,C], cache=cache, valid=valid[B,C])``
    appends the chunk after ``cache['lengths']`` tokens (prefill and decode in the rollout).

``forward_chunked`` runs the teacher-forced pass as a ``lax.scan`` of the chunk function; with
the sampler using the same chunk size, batch and cache capacity, rollout and training logprobs are
bitwise equal (the ``*-parity`` dtype policies use it).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax.model.attention import Attention, init_layer_cache
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.decode_params import unstack_groups
from agentrl_jax.model.layers import DecodeForm, Embedder, RMSNorm
from agentrl_jax.model.moe import MLP, MoE
from agentrl_jax.precision import DTypePolicy

_REMAT = {
    "full": lambda: jax.checkpoint_policies.nothing_saveable,
    "dots": lambda: jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nn.Module):
    """Pre-norm residual block: attention of ``kind`` then a dense or MoE FFN.

    Returns ``(x, cache, routes, aux, blocks)``: ``blocks`` is an F layer's recorded block
    selection ([B, T, K, n_sel], with ``record_blocks`` in the chunked path) or None.
    """

    cfg: ModelConfig
    policy: DTypePolicy
    kind: str
    decode_kernel: bool = False
    record_blocks: bool = False
    form: DecodeForm = DecodeForm()

    @nn.compact
    def __call__(self, x, positions, cache, meta, valid, replay, group=None, replay_blocks=None):
        cfg, pol, form = self.cfg, self.policy, self.form
        h = RMSNorm(cfg, pol, name="attn_norm")(x)
        a, cache = Attention(
            cfg, pol, self.kind, self.decode_kernel, self.record_blocks, form, name="attn"
        )(h, positions, cache=cache, meta=meta, valid=valid, group=group,
          replay_blocks=replay_blocks)  # fmt: skip
        blocks = None
        if cache is not None and "blocks" in cache:
            cache = dict(cache)
            blocks = cache.pop("blocks")
        x = x + a
        h = RMSNorm(cfg, pol, name="ffn_norm")(x)
        if cfg.is_moe:
            # small-capacity-first dispatch in the rollout (cache) only: under autodiff a cond
            # would keep both branches' residuals
            f, routes, aux = MoE(cfg, pol, small_first=cache is not None, form=form, name="moe")(
                h, valid=valid, replay_routes=replay
            )
        else:
            f, routes, aux = MLP(cfg, pol, form, name="mlp")(h), None, {}
        x = nn.with_logical_constraint(x + f, ("batch", "seq", "embed"))
        return x, cache, routes, aux, blocks


class Group(nn.Module):
    """One repetition of the layer pattern: the body of the depth scan.

    Caches come one of two ways (``Transformer`` docstring): stacked in the carry
    ``(x, caches)`` with this group's index in ``xs`` (updated in place), or this group's slice
    in ``xs`` and returned as a scan output. ``xs`` also carries this group's replayed routes
    [B, T, P, k] and replayed block selections [B, T, F_group, K, n] (or None).
    """

    cfg: ModelConfig
    policy: DTypePolicy
    decode_kernel: bool = False
    record_blocks: bool = False
    form: DecodeForm = DecodeForm()

    @nn.compact
    def __call__(self, carry, xs, positions, meta, valid):
        x, stacked = carry
        group, sliced, replay, replay_blocks = xs
        caches = sliced if stacked is None else stacked
        if self.cfg.frozen_groups and caches is None:  # no gradient below the trained groups
            x = jnp.where(group == self.cfg.frozen_groups, jax.lax.stop_gradient(x), x)
        new_caches, routes, aux_sum, blocks = {}, [], {}, []
        n_f = 0
        for i, kind in enumerate(self.cfg.layer_pattern):
            name = f"layer_{i}"
            rb = None
            if replay_blocks is not None and kind == "F":
                rb = replay_blocks[:, :, n_f]
            n_f += kind == "F"
            x, c, r, aux, blk = Block(
                self.cfg,
                self.policy,
                kind,
                self.decode_kernel,
                self.record_blocks,
                self.form,
                name=name,
            )(
                x,
                positions,
                None if caches is None else caches[name],
                meta,
                valid,
                None if replay is None else replay[:, :, i],
                None if stacked is None else group,
                rb,
            )
            if c is not None:
                new_caches[name] = c
            if r is not None:
                routes.append(r)
            if blk is not None:
                blocks.append(blk)
            for key, value in aux.items():
                aux_sum[key] = aux_sum.get(key, 0.0) + value
        routes = jnp.stack(routes, axis=2) if routes else None  # [B, T, P, k]
        blocks = jnp.stack(blocks, axis=2) if blocks else None  # [B, T, F_group, K, n]
        if stacked is not None:
            return (x, new_caches), (None, routes, aux_sum, blocks)
        return (x, None), (new_caches or None, routes, aux_sum, blocks)


class Transformer(nn.Module):
    """Decoder-only transformer with hybrid attention and optional MoE FFNs.

    ``decode_kernel``: one-row chunks of F/D layers attend through the paged decode kernel
    (``model.attention`` docstring; same parameters, numbers equal up to reduction order).
    ``record_blocks``: the chunked path returns every F layer's block selection in
    ``extras['blocks']`` (for the rollout to record; same numbers).
    ``form``: how the parameters are laid out (``layers.DecodeForm``; the default: as trained):
    the one-row decode's are rewritten once per weight version (``decode_params.prepare_decode``).
    ``unstacked`` (or ``form.unstacked``): the pattern groups run as a Python loop over
    parameters stored per group (``group_<g>``, see ``decode_params.unstack_groups``) instead of
    the depth scan over stacked ones. A scan slices every weight out of its stack on every call
    (XLA copies the slice before the matmul reads it), so a decode step would copy all weights
    once; the sampler unstacks them once per weight version. The same numbers up to fp32
    rounding (XLA fuses the unrolled groups otherwise than the loop body; not for parity
    paths); compile time grows with depth, so only shallow decode models use it
    (``model.decode_params``).

    Cache plumbing through the depth scan: without remat the stacked layer caches ([G, ...])
    are the scan carry and each layer scatters its new rows into its group's entry in place, so
    a decode step touches only the new rows and the pages it reads. Passing per-group slices as
    scan input/output instead makes XLA slice out, rebuild and copy every pool on every call
    (per-step cost grows with the pool, i.e. with batch x ``max_len``). Under remat the slices
    are kept: a rematerialised group saves its inputs for the backward pass, and a stacked
    carry would be saved once per group. Both ways compute the same numbers (only gathers and
    scatters differ).
    """

    cfg: ModelConfig
    policy: DTypePolicy
    decode_kernel: bool = False
    record_blocks: bool = False
    unstacked: bool = False
    form: DecodeForm = DecodeForm()

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        *,
        cache: dict | None = None,
        valid: jax.Array | None = None,
        replay_routes: jax.Array | None = None,
        replay_blocks: jax.Array | None = None,
        logits_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None, dict]:
        """Forward pass.

        Args:
          tokens: int32 [B, T] (teacher-forced) or [B, C] (a chunk appended to ``cache``).
          cache: None, or the dict from :func:`init_cache` (``layers``, ``lengths``,
            ``block_tables``) — then positions continue from ``cache['lengths']``.
          valid: bool [B, C] real rows of a chunk (a prefix of each row); default all.
          replay_routes: int32 [B, T, L_moe, k] expert indices to force (routing replay).
          replay_blocks: int32 [B, T, L_F, K, n] key blocks each F layer (in depth order)
            attends to, per query token and kv head (-1 unused): block-selection replay.
          logits_rows: optional int32 [B]: the LM head runs on that row of each sequence only
            (a prefill needs the last new token's logits; the other rows' vocabulary matmul is
            skipped) and logits are [B, 1, V]. The same row values; the matmul's row count
            differs, so XLA may pick another kernel and the last bits can differ.

        Returns:
          (logits float32 [B, T, V], new cache or None, extras) where extras holds ``routes``
          int32 [B, T, L_moe, k] (MoE only), summed aux losses (``aux_loss`` etc.), with
          ``cfg.value_head`` ``values`` f32 [B, T]: V of the prefix ending at each token, and
          with ``record_blocks`` in the chunked path ``blocks`` int32 [B, T, L_F, K, n_sel].

        Raises:
          ValueError: ``replay_routes`` / ``replay_blocks`` of the wrong shape or for a model
            without MoE / F layers.
        """
        cfg, pol = self.cfg, self.policy
        b, t = tokens.shape
        p = len(cfg.layer_pattern)
        form = self.form
        embedder = Embedder(cfg, pol, form, name="embed")
        x = nn.with_logical_constraint(embedder.encode(tokens), ("batch", "seq", "embed"))
        if cache is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            meta, layer_caches = None, None
        else:
            positions = cache["lengths"][:, None] + jnp.arange(t, dtype=jnp.int32)
            meta = {k: v for k, v in cache.items() if k != "layers"}
            layer_caches = cache["layers"]
        replay = None
        if replay_routes is not None:
            if not cfg.is_moe:
                raise ValueError("replay_routes given but the model has no MoE layers")
            want = (b, t, cfg.n_layers, cfg.experts_per_token)
            if replay_routes.shape != want:
                raise ValueError(f"replay_routes.shape={replay_routes.shape}, expected {want}")
            replay = replay_routes.reshape(b, t, cfg.n_groups, p, -1).transpose(2, 0, 1, 3, 4)
        replay_blk = None
        if replay_blocks is not None:
            n_f = cfg.layer_pattern.count("F")
            want = (b, t, cfg.n_groups * n_f, cfg.n_kv_heads)
            if not n_f or replay_blocks.ndim != 5 or replay_blocks.shape[:4] != want:
                raise ValueError(
                    f"replay_blocks.shape={replay_blocks.shape}, expected {want} + (n,) "
                    f"(layer_pattern={cfg.layer_pattern!r})"
                )
            replay_blk = replay_blocks.reshape(b, t, cfg.n_groups, n_f, *replay_blocks.shape[3:])
            replay_blk = replay_blk.transpose(2, 0, 1, 3, 4, 5)

        group = Group
        if cfg.remat != "none":
            group = nn.remat(Group, policy=_REMAT[cfg.remat](), prevent_cse=False)
        in_carry = layer_caches is not None and cfg.remat == "none"
        carry = (x, layer_caches if in_carry else None)
        xs = (
            jnp.arange(cfg.n_groups, dtype=jnp.int32),
            None if in_carry else layer_caches,
            replay,
            replay_blk,
        )
        if self.unstacked or form.unstacked:
            outs = []
            for g in range(cfg.n_groups):
                if g == cfg.frozen_groups and g and cache is None:  # no gradient below here
                    carry = (jax.lax.stop_gradient(carry[0]), carry[1])
                xs_g = jax.tree.map(lambda a, g=g: a[g], xs)
                carry, out = group(
                    cfg, pol, self.decode_kernel, self.record_blocks, form, name=f"group_{g}"
                )(carry, xs_g, positions, meta, valid)
                outs.append(out)
            ys = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        else:
            scanned = nn.scan(
                group,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.n_groups,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            carry, ys = scanned(
                cfg, pol, self.decode_kernel, self.record_blocks, form, name="groups"
            )(carry, xs, positions, meta, valid)
        (x, carried), (new_layers, routes, aux, blocks) = carry, ys
        if in_carry:
            new_layers = carried
        x = RMSNorm(cfg, pol, name="final_norm")(x)
        if logits_rows is None:
            logits = embedder.decode(x)
        else:
            if logits_rows.shape != (b,):
                raise ValueError(f"logits_rows.shape={logits_rows.shape}, expected ({b},)")
            logits = embedder.decode(jnp.take_along_axis(x, logits_rows[:, None, None], axis=1))

        extras = {k: jnp.sum(v) for k, v in aux.items()}
        if cfg.value_head:
            h = x if cfg.value_head == "shared" else jax.lax.stop_gradient(x)
            head = nn.Dense(
                1,
                dtype=jnp.float32,
                param_dtype=jnp.float32,
                name="value_head",
                kernel_init=nn.initializers.zeros,
            )
            extras["values"] = head(h.astype(jnp.float32))[..., 0]
        if routes is not None:  # [G, B, T, P, k] -> [B, T, G*P, k]
            extras["routes"] = routes.transpose(1, 2, 0, 3, 4).reshape(b, t, cfg.n_layers, -1)
        if blocks is not None:  # [G, B, T, F, K, n] -> [B, T, G*F, K, n]
            blocks = blocks.transpose(1, 2, 0, 3, 4, 5)
            extras["blocks"] = blocks.reshape(b, t, -1, *blocks.shape[4:])
        new_cache = None
        if cache is not None:
            v = jnp.ones((b, t), bool) if valid is None else valid
            new_cache = dict(cache)
            new_cache["layers"] = new_layers
            new_cache["lengths"] = cache["lengths"] + jnp.sum(v, axis=1).astype(jnp.int32)
        return logits, new_cache, extras


def training_view(model: Transformer, params) -> tuple[Transformer, dict]:
    """``(model, params)`` for a teacher-forced pass that is differentiated. With
    ``cfg.frozen_groups`` the groups run unstacked (a depth scan's backward pass runs every
    group, the frozen ones too); else both unchanged. Gradients reach the stacked parameters
    through the slices."""
    if not model.cfg.check_trainable().frozen_groups or model.unstacked:
        return model, params
    return model.clone(unstacked=True), unstack_groups(params, model.cfg.n_groups)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Shape of a model cache: ``batch`` sequences, each up to ``max_len`` tokens in pages.

    ``n_pages`` defaults to ``batch * ceil(max_len / page_size)`` (every sequence owns its pages;
    the rollout allocator may share a smaller pool). ``page_size`` must be a multiple of
    ``sparse_block_size`` so key blocks never straddle pages. ``int8_pages`` > 0 gives every
    paged layer an int8 pool of that many pages, addressed through ``int8_tables``
    (``model.paged``; the rollout allocator fills them).
    """

    batch: int
    max_len: int
    page_size: int = 16
    n_pages: int | None = None
    int8_pages: int = 0

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.n_pages if self.n_pages is not None else self.batch * self.pages_per_seq


def init_cache(cfg: ModelConfig, policy: DTypePolicy, spec: CacheSpec) -> dict:
    """Empty cache with contiguous per-sequence block tables (``lengths`` all zero).

    With ``spec.int8_pages`` the cache also holds ``int8_tables`` int32 [B, max_pages], all -1.

    Raises ``ValueError`` if ``page_size`` is not a multiple of ``sparse_block_size``.
    """
    if spec.page_size % cfg.sparse_block_size and "F" in cfg.layer_pattern:
        raise ValueError(
            f"CacheSpec.page_size={spec.page_size} must be a multiple of "
            f"sparse_block_size={cfg.sparse_block_size}"
        )
    if spec.batch <= 0 or spec.max_len <= 0:
        raise ValueError(f"CacheSpec batch={spec.batch} and max_len={spec.max_len} must be > 0")
    layers = {}
    for i, kind in enumerate(cfg.layer_pattern):
        one = init_layer_cache(
            kind,
            cfg,
            policy,
            batch=spec.batch,
            n_pages=spec.pool_pages,
            page_size=spec.page_size,
            int8_pages=spec.int8_pages,
            max_len=spec.pages_per_seq * spec.page_size,
        )
        layers[f"layer_{i}"] = jax.tree.map(
            lambda a: jnp.broadcast_to(a, (cfg.n_groups, *a.shape)), one
        )
    tables = jnp.arange(spec.batch * spec.pages_per_seq, dtype=jnp.int32).reshape(
        spec.batch, spec.pages_per_seq
    )
    if spec.n_pages is not None:  # shared pool: the allocator fills the tables
        tables = jnp.full_like(tables, -1)
    cache = {
        "layers": layers,
        "lengths": jnp.zeros((spec.batch,), jnp.int32),
        "block_tables": tables,
    }
    if spec.int8_pages:
        cache["int8_tables"] = jnp.full_like(tables, -1)
    return cache


def forward_chunked(
    model: Transformer,
    params,
    tokens: jax.Array,
    *,
    chunk: int,
    page_size: int = 16,
    max_len: int | None = None,
    replay_routes: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """Teacher-forced forward as a ``lax.scan`` of the chunk function (parity path).

    tokens int32 [B, T] -> (logits float32 [B, T, V], extras). ``max_len`` (default T rounded
    up to ``chunk``) must equal the sampler's cache capacity for bitwise agreement.
    """
    b, t = tokens.shape
    if chunk <= 0:
        raise ValueError(f"{chunk=} must be > 0")
    n_chunks = -(-t // chunk)
    t_pad = n_chunks * chunk
    max_len = max_len or t_pad
    if max_len < t_pad:
        raise ValueError(f"{max_len=} must be >= tokens rounded up to the chunk ({t_pad})")
    cache = init_cache(model.cfg, model.policy, CacheSpec(b, max_len, page_size))
    toks = jnp.pad(tokens, ((0, 0), (0, t_pad - t))).reshape(b, n_chunks, chunk).transpose(1, 0, 2)
    valid = (jnp.arange(t_pad) < t).reshape(n_chunks, chunk)
    rr = None
    if replay_routes is not None:
        rr = jnp.pad(replay_routes, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        rr = rr.reshape(b, n_chunks, chunk, *rr.shape[2:]).swapaxes(0, 1)

    def step(cache, xs):
        tok, val, rep = xs
        logits, cache, extras = model.apply(
            params, tok, cache=cache, valid=jnp.broadcast_to(val, (b, chunk)), replay_routes=rep
        )
        return cache, (logits, extras)

    _, (logits, extras) = jax.lax.scan(step, cache, (toks, valid, rr))
    logits = logits.swapaxes(0, 1).reshape(b, t_pad, -1)[:, :t]
    return logits, unchunk_extras(extras, t, jnp.sum)


PER_TOKEN_EXTRAS = ("routes", "values", "blocks")


def unchunk_extras(extras: dict, t: int, reduce) -> dict:
    """Per-chunk model extras stacked by a chunk scan ([N, B, C, ...]) -> one pass's: per-token
    entries (``PER_TOKEN_EXTRAS``) as [B, t, ...], scalars reduced over chunks with ``reduce``."""
    out = {k: reduce(v) for k, v in extras.items() if k not in PER_TOKEN_EXTRAS}
    for k in PER_TOKEN_EXTRAS:
        if k in extras:
            v = extras[k].swapaxes(0, 1)
            out[k] = v.reshape(v.shape[0], -1, *v.shape[3:])[:, :t]
    return out


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens) under fp32 ``logits``: [B,T,V], int [B,T] -> float32 [B,T]."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return picked - lse


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the fp32 softmax: [B,T,V] -> [B,T]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def init_params(model: Transformer, rng: jax.Array, seq_len: int = 8):
    """Initialises parameters (logical-partitioning boxes stripped) from a PRNG key.

    The key is turned into an ``unsafe_rbg`` key first: threefry-based initialisers make XLA
    compile the init program 2-3x slower on CPU, and init quality does not need threefry.
    """
    key = jax.random.wrap_key_data(jax.random.bits(rng, (4,), jnp.uint32), impl="unsafe_rbg")
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    variables = jax.jit(model.init)(key, tokens)
    return nn.unbox(variables)


def param_count(params) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
