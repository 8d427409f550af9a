"""Attention layers: gated sliding-window (S), sparse GQA full (F), dense full (D).

Legend: B batch, T query time, C chunk length, S key time, D model dim, N query heads,
K kv heads, G query heads per kv head, H head dim, J key blocks, P pages, L page size, W window.

Two ways to run one layer, sharing parameters and the projections:
  * teacher-forced: ``x [B,T,D]`` at positions ``0..T-1``; attention through
    ``agentrl_jax.kernels`` (impl chosen by the dtype policy).
  * chunked with a cache: ``x [B,C,D]`` appended after the ``lengths[b]`` tokens already
    cached. ``S`` layers keep a ring buffer of ``W`` tokens per sequence; ``F``/``D`` layers
    keep a paged pool ``[P, L, K, H]`` addressed through per-sequence ``block_tables``. The
    chunk's keys are written first, then the chunk attends over the gathered context with a
    mask (fixed shapes: decode and chunked training compute identical numbers).

KV compression hooks of the chunked path (F/D layers; replayed by the trainer's chunked pass):
``meta['keep']`` bool [B, S] hides evicted keys; ``meta['int8_at']`` int32 [B, S] moves keys to
int8 (per logical page and KV head, ``model.kv_quant``) in place from the chunk containing that
position on. A ``kv_cache_dtype='int8'`` policy quantises every page of F/D layers once the next
page starts (S rings stay in the compute dtype); its teacher-forced pass does not quantise (the
difference is measured as rollout/trainer mismatch, the policy is not a parity policy).

Decode kernel (``decode_kernel=True``, used by the sampler under non-parity policies): a chunk of
one row (``C == 1``) in an F/D layer attends through ``kernels.paged_decode_attention`` reading
the page pool and block tables directly instead of gathering the context into ``[B, S, K, H]``.
D layers pass the pool as is; F layers still score blocks on the gathered keys
(``select_blocks``, so the selection is the chunk path's), then view the pool as pages of
``sparse_block_size`` tokens and give the kernel, per KV head, a block table of the selected
blocks in ascending order (every selected block but the query's own is complete, so they form
one contiguous virtual sequence). Not used with ``meta['keep']`` (eviction) or a ``mass``
accumulator (the kernel returns no probabilities); the numbers equal the chunk path's up to
float reduction order (not bitwise, hence never under parity policies).

Pretrained-family options (``ModelConfig``): q/k/v/o biases (``attn_bias``), RMSNorm of q and
k over ``head_dim`` before RoPE (``qk_norm``), RoPE scalings (``model.rope``), ``S`` layers
without their output gate (``window_gate=False``: plain sliding window, gpt-oss) and learned
attention sinks (``attn_sinks``): sink layers attend through ``model.sinks`` (XLA) on every
path, teacher-forced included, and never through the kernels, which have no sink term.

Sparse-attention block scorer (``select_blocks``): each key block is summarised by the mean of
its (RoPE-rotated) keys; a query's GQA group scores block j with the group-mean query dotted
with that mean key (MoBA-style mean pooling: no extra parameters, one [T, J] product per KV
head instead of [T, S]). Blocks after the query's own block are excluded (causal), the own block
is always kept, and the top ``sparse_topk_tokens / sparse_block_size`` blocks are selected;
ties go to the lower block index. Selection is not differentiated (indices).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.layers import RMSNorm, param_init
from agentrl_jax.model.paged import (  # noqa: F401 - re-exported: part of this module's API
    _int8_at,
    _sparse_decode,
    int8_page_update,
    over_live_pages,
    page_buckets,
)
from agentrl_jax.model.rope import apply_rope
from agentrl_jax.model.sinks import masked_attention, sink_attention  # noqa: F401 - re-exported
from agentrl_jax.precision import DTypePolicy

_BIG = 1e30


def select_blocks(
    q: jax.Array,
    k: jax.Array,
    *,
    block_size: int,
    topk_blocks: int,
    q_positions: jax.Array,
    k_valid: jax.Array | None = None,
) -> jax.Array:
    """Chooses key blocks per query and KV group (see module docstring).

    Args:
      q: [B, T, N, H] queries (after RoPE).
      k: [B, S, K, H] keys at absolute positions ``0..S-1`` (after RoPE).
      block_size: key block size; S is padded up to a multiple of it.
      topk_blocks: blocks kept per query (own block included).
      q_positions: int32 [B, T] absolute positions of the queries.
      k_valid: optional bool [B, S]; invalid keys do not contribute to block means.

    Returns:
      int32 [B, T, K, n_sel] block indices, ``-1`` for unused slots; n_sel = min(topk, J).
    """
    b, s, n_kv, h = k.shape
    n_q = q.shape[2]
    n_blocks = -(-s // block_size)
    pad = n_blocks * block_size - s
    valid = jnp.ones((b, s), bool) if k_valid is None else k_valid
    k32 = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
    kb = k32.reshape(b, n_blocks, block_size, n_kv, h)
    vb = valid.reshape(b, n_blocks, block_size).astype(jnp.float32)
    count = jnp.sum(vb, axis=2)  # [B, J]
    kmean = jnp.einsum("BJLKH,BJL->BJKH", kb, vb) / jnp.maximum(count, 1.0)[..., None, None]
    qg = q.astype(jnp.float32).reshape(b, q.shape[1], n_kv, n_q // n_kv, h).mean(axis=3)
    score = jnp.einsum("BTKH,BJKH->BTKJ", qg, kmean)
    j = jnp.arange(n_blocks)
    qblock = (q_positions // block_size)[:, :, None, None]
    allowed = (j <= qblock) & (count[:, None, None, :] > 0)
    score = jnp.where(allowed, score, -jnp.inf)
    score = jnp.where(j == qblock, _BIG, score)
    n_sel = min(topk_blocks, n_blocks)
    vals, idx = jax.lax.top_k(score, n_sel)
    idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
    return jax.lax.stop_gradient(idx)


def sparse_coverage(
    q: jax.Array, k: jax.Array, block_indices: jax.Array, *, block_size: int
) -> jax.Array:
    """Share of dense causal attention probability mass inside the selected blocks.

    q [B,T,N,H], k [B,T,K,H], block_indices [B,T,K,n_sel] -> float32 [B, T, N] in [0, 1].
    """
    b, t, n_q, h = q.shape
    n_kv = k.shape[2]
    g = n_q // n_kv
    logits = jnp.einsum(
        "BTKGH,BSKH->BTKGS",
        q.astype(jnp.float32).reshape(b, t, n_kv, g, h),
        k.astype(jnp.float32),
    ) / math.sqrt(h)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T, S]
    logits = jnp.where(causal[None, :, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    kblock = jnp.arange(t) // block_size  # [S]
    sel = jnp.any(block_indices[..., None] == kblock, axis=-2)  # [B, T, K, S]
    mass = jnp.sum(jnp.where(sel[:, :, :, None, :], probs, 0.0), axis=-1)
    return mass.reshape(b, t, n_q)


def ring_positions(lengths: jax.Array, window: int) -> jax.Array:
    """Absolute position held by each ring slot given ``lengths`` cached tokens; -1 if empty.

    lengths int32 [B] -> int32 [B, W]. Slot s holds the latest position p < length, p % W == s.
    """
    s = jnp.arange(window)[None, :]
    last = lengths[:, None] - 1
    p = last - jnp.mod(last - s, window)
    return jnp.where(p >= 0, p, -1)


def pool_dtype(policy: DTypePolicy):
    """dtype of the cache buffers: ``policy.kv_cache``, or the compute dtype for 'int8'.

    int8 KV is fake-quantised (``model.kv_quant``): quantised tokens are stored as their
    dequantised values, so the buffers keep a float dtype.
    """
    return policy.compute if policy.kv_cache_dtype == "int8" else policy.kv_cache


def init_layer_cache(
    kind: str,
    cfg: ModelConfig,
    policy: DTypePolicy,
    *,
    batch: int,
    n_pages: int,
    page_size: int,
) -> dict[str, jax.Array]:
    """Empty cache of one layer: ring ``{k, v}: [B, W, K, H]`` for S, pool ``[P, L, K, H]`` else.

    Buffers have :func:`pool_dtype` (the compute dtype under ``kv_cache_dtype='int8'``).
    """
    dt = pool_dtype(policy)
    if kind == "S":
        shape = (batch, cfg.window, cfg.n_kv_heads, cfg.head_dim)
    else:
        shape = (n_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


class Attention(nn.Module):
    """One attention layer of kind ``S``, ``F`` or ``D`` (see module docstring)."""

    cfg: ModelConfig
    policy: DTypePolicy
    kind: str
    decode_kernel: bool = False

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        cache: dict | None = None,
        meta: dict | None = None,
        valid: jax.Array | None = None,
        group: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """x [B,T,D] -> ([B,T,D], new layer cache or None).

        Teacher-forced when ``cache`` is None (positions must be 0..T-1). Chunked otherwise:
        ``meta`` holds ``lengths`` int32 [B] (tokens cached before this chunk) and, for F/D,
        ``block_tables`` int32 [B, max_pages], optionally ``keep`` bool [B, S] and
        ``int8_at`` int32 [B, S] (module docstring); ``valid`` bool [B,C] marks the real rows (a
        prefix of each row of the chunk). ``group``: None when ``cache`` is this layer's own
        (``init_layer_cache`` shapes); else an int32 scalar and ``cache`` holds every pattern
        group's buffers stacked on a leading axis ([G, ...]), of which this layer reads and
        updates entry ``group`` in place (see ``_chunk``).
        """
        cfg, pol = self.cfg, self.policy
        n, h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
        init = param_init(cfg.init_std)
        out_init = param_init(cfg.init_std / math.sqrt(2 * cfg.n_layers))
        q, k, v = self._project(x, positions)
        wo = self.param(
            "wo",
            nn.with_logical_partitioning(out_init, ("heads", "head_dim", "embed")),
            (n, h, d),
            pol.param,
        )
        sinks = None
        if cfg.attn_sinks:
            sinks = self.param(
                "sinks", nn.with_logical_partitioning(init, ("heads",)), (n,), pol.param
            )

        if cache is None:
            if self.is_mutable_collection("intermediates") and not self.is_initializing():
                # read by rl.attention_credit (apply with mutable=["intermediates"]); else no-op
                self.sow("intermediates", "qk", (q, k))
            out = self._teacher(q, k, v, positions, sinks)
            new_cache = None
        else:
            out, new_cache = self._chunk(q, k, v, positions, cache, meta, valid, group, sinks)

        if self.kind == "S" and cfg.window_gate:
            wg = self.param(
                "wg", nn.with_logical_partitioning(init, ("embed", "heads")), (d, n), pol.param
            )
            gate = jax.nn.sigmoid(pol.einsum("BTD,DN->BTN", x, wg).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate[..., None]).astype(pol.compute)
        y = pol.einsum("BTNH,NHD->BTD", out, wo)
        if cfg.attn_bias:
            bo = self.param(
                "bo", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                (d,), pol.param,
            )  # fmt: skip
            y = y + bo.astype(y.dtype)
        return y, new_cache

    def _project(self, x, positions):
        """q [B,T,N,H], k, v [B,T,K,H]: projections (+ biases), q/k norms, RoPE."""
        cfg, pol = self.cfg, self.policy
        n, kh, h, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        init = param_init(cfg.init_std)
        out = []
        for name, heads, axis in (("q", n, "heads"), ("k", kh, "kv_heads"), ("v", kh, "kv_heads")):
            w = self.param(
                f"w{name}",
                nn.with_logical_partitioning(init, ("embed", axis, "head_dim")),
                (d, heads, h),
                pol.param,
            )
            y = pol.einsum("BTD,DNH->BTNH", x, w)
            if cfg.attn_bias:
                bias = self.param(
                    f"b{name}",
                    nn.with_logical_partitioning(nn.initializers.zeros_init(), (axis, "head_dim")),
                    (heads, h),
                    pol.param,
                )
                y = y + bias.astype(y.dtype)
            if cfg.qk_norm and name != "v":
                y = RMSNorm(cfg, pol, axis="head_dim", name=f"{name}_norm")(y)
            out.append(y if name == "v" else apply_rope(y, positions, cfg))
        return tuple(out)

    # Teacher-forced ----------------------------------------------------------------------
    def _teacher(self, q, k, v, positions, sinks=None):
        cfg, impl = self.cfg, self.policy.kernel_impl
        t = q.shape[1]
        if sinks is not None:  # the kernels have no sink: the XLA path of ``model.sinks``
            window = cfg.window if self.kind == "S" else t
            return sink_attention(q, k, v, sinks, window=window, policy=self.policy)
        if self.kind == "S":
            return kernels.sliding_window_attention(q, k, v, window=cfg.window, impl=impl)
        if self.kind == "D":
            return kernels.sliding_window_attention(q, k, v, window=t, impl=impl)
        idx = select_blocks(
            q,
            k,
            block_size=cfg.sparse_block_size,
            topk_blocks=cfg.sparse_topk_blocks,
            q_positions=positions,
        )
        return kernels.block_sparse_attention(
            q, k, v, idx, block_size=cfg.sparse_block_size, impl=impl
        )

    # Chunked with cache ------------------------------------------------------------------
    def _chunk(self, q, k, v, positions, cache, meta, valid, group, sinks=None):
        """Chunked attention; returns (out [B,C,N,H], new cache of the same layout as ``cache``).

        Stacked layout (``group`` given): the buffers keep their [G, ...] shape and only this
        chunk's rows are scattered into entry ``group``; paged pools are addressed as one flat
        pool of G*P pages (a free reshape) with the block tables offset by ``group * P``, so
        neither the write nor the gather (nor the decode kernel) copies a whole pool. Inside the
        transformer's layer scan the stacked buffers are the loop carry, so the updates happen in
        place (a per-layer slice as scan input/output would copy every pool each step).
        """
        if group is None:  # one layer's own buffers: a stack of one
            out, new = self._chunk(
                q, k, v, positions, jax.tree.map(lambda a: a[None], cache), meta, valid, 0, sinks
            )
            return out, jax.tree.map(lambda a: a[0], new)
        cfg, pol = self.cfg, self.policy
        b, c = q.shape[:2]
        lengths = meta["lengths"]
        valid = jnp.ones((b, c), bool) if valid is None else valid
        new_len = lengths + jnp.sum(valid, axis=1).astype(lengths.dtype)
        kd, vd = k.astype(pool_dtype(pol)), v.astype(pool_dtype(pol))
        if self.kind == "S":
            w = cfg.window
            ring_k, ring_v = cache["k"][group], cache["v"][group]
            # The ring's W slots and the chunk's C rows hold positions len-W .. len+C-1, one of
            # each residue mod W+C. Keys are laid out at slot ``position mod (W+C)`` so a key
            # sits at the same index whichever chunk brought it: the softmax then reduces in the
            # same order in decode and in chunked training (bitwise parity).
            last = lengths[:, None] - 1
            ring_pos = last - jnp.mod(last - jnp.arange(w)[None, :], w)  # may be < 0: empty
            cand = jnp.concatenate([ring_pos, positions], axis=1)  # [B, W+C]
            inv = jnp.argsort(jnp.mod(cand, w + c), axis=1)
            kpos = jnp.concatenate([ring_pos, jnp.where(valid, positions, -1)], axis=1)
            kpos = jnp.take_along_axis(kpos, inv, axis=1)
            keys = jnp.take_along_axis(
                jnp.concatenate([ring_k, kd], axis=1), inv[..., None, None], axis=1
            )
            vals = jnp.take_along_axis(
                jnp.concatenate([ring_v, vd], axis=1), inv[..., None, None], axis=1
            )
            qp = positions[:, :, None]
            kp = kpos[:, None, :]
            mask = (kp >= 0) & (kp <= qp) & (kp > qp - w)  # [B, C, W+C]
            mask = jnp.broadcast_to(mask[:, :, None, :], (b, c, cfg.n_kv_heads, keys.shape[1]))
            out = masked_attention(q, keys, vals, mask, pol, sinks=sinks)
            # Write only rows among the last W of the chunk: slots are then unique.
            write = valid & (positions >= new_len[:, None] - w)
            slot = jnp.where(write, positions % w, w)  # w is out of range -> dropped
            bidx = jnp.broadcast_to(jnp.arange(b)[:, None], (b, c))
            new_k = cache["k"].at[group, bidx, slot].set(kd, mode="drop")
            new_v = cache["v"].at[group, bidx, slot].set(vd, mode="drop")
            return out, {"k": new_k, "v": new_v}

        shape = cache["k"].shape  # [G, P, L, K, H]
        n_pages, page = shape[1:3]
        flat = n_pages * shape[0]
        pool_k = cache["k"].reshape(flat, *shape[2:])
        pool_v = cache["v"].reshape(flat, *shape[2:])
        raw = meta["block_tables"]
        tables = jnp.where(raw >= 0, raw + group * n_pages, -1)  # ids in the flat pool
        page_of = jnp.take_along_axis(
            tables, jnp.clip(positions // page, 0, tables.shape[1] - 1), axis=1
        )
        page_of = jnp.where(valid & (page_of >= 0), page_of, flat)  # invalid -> dropped
        slot = positions % page
        pool_k = pool_k.at[page_of, slot].set(kd, mode="drop")
        pool_v = pool_v.at[page_of, slot].set(vd, mode="drop")
        s = tables.shape[1] * page
        int8_at = _int8_at(meta, pol, s, page)
        if int8_at is not None:  # int8 KV: decisions taking effect in this chunk, in place
            pool_k, pool_v = int8_page_update(pool_k, pool_v, tables, int8_at, lengths, new_len)

        def result(out, **extra):
            return out, {"k": pool_k.reshape(shape), "v": pool_v.reshape(shape), **extra}

        use_kernel = self.decode_kernel and c == 1 and "keep" not in meta and "mass" not in cache
        use_kernel = use_kernel and sinks is None  # sink layers: the masked XLA path below
        if use_kernel and self.kind == "D":
            out = over_live_pages(
                lambda n: kernels.paged_decode_attention(
                    q[:, 0], pool_k, pool_v, tables[:, :n], new_len, impl=pol.kernel_impl
                ),
                tables,
                new_len,
                page,
            )
            return result(out[:, None].astype(pol.compute))
        if use_kernel:  # F: block selection and the kernel over the live pages only
            sel_topk = min(cfg.sparse_topk_blocks, -(-s // cfg.sparse_block_size))

            def sparse(n):
                safe = jnp.maximum(raw[:, :n], 0) + group * n_pages
                keys = pool_k[safe].reshape(b, n * page, cfg.n_kv_heads, cfg.head_dim)
                idx = select_blocks(
                    q,
                    keys,
                    block_size=cfg.sparse_block_size,
                    topk_blocks=cfg.sparse_topk_blocks,
                    q_positions=positions,
                    k_valid=jnp.arange(n * page)[None, :] < new_len[:, None],
                )
                pad = sel_topk - idx.shape[-1]  # fewer blocks than the full width: unused (-1)
                idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=-1)
                tb = tables[:, :n]
                return _sparse_decode(q, pool_k, pool_v, tb, idx, positions, new_len, cfg, pol)

            return result(over_live_pages(sparse, tables, new_len, page))
        safe = jnp.maximum(raw, 0) + group * n_pages
        keys = pool_k[safe].reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        vals = pool_v[safe].reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
        kpos = jnp.arange(s)
        k_valid = kpos[None, :] < new_len[:, None]
        if "keep" in meta:  # eviction replay: bool [B, S] of keys still held
            k_valid = k_valid & meta["keep"]
        mask = k_valid[:, None, :] & (kpos[None, None, :] <= positions[:, :, None])  # [B,C,S]
        mask = jnp.broadcast_to(mask[:, :, None, :], (b, c, cfg.n_kv_heads, s))
        if self.kind == "F":
            idx = select_blocks(
                q,
                keys,
                block_size=cfg.sparse_block_size,
                topk_blocks=cfg.sparse_topk_blocks,
                q_positions=positions,
                k_valid=k_valid,
            )
            kblock = kpos // cfg.sparse_block_size
            sel = jnp.any(idx[..., None] == kblock, axis=-2)  # [B, C, K, S]
            mask = mask & sel
        if "mass" not in cache:
            return result(masked_attention(q, keys, vals, mask, pol, sinks=sinks))
        # rollout KV eviction: accumulate the attention mass each cached position receives
        # from valid queries (mean over heads); same numbers as without it
        out, p = masked_attention(q, keys, vals, mask, pol, return_probs=True, sinks=sinks)
        w = valid.astype(jnp.float32)[:, :, None, None, None]
        got = jnp.sum(p.astype(jnp.float32) * w, axis=(1, 2, 3)) / (p.shape[2] * p.shape[3])
        return result(out, mass=cache["mass"].at[group].add(got))
