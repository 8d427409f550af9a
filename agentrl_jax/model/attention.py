"""Attention layers: gated sliding-window (S), sparse GQA full (F), dense full (D).

Legend: B batch, T query time, C chunk length, S key time, D model dim, N query heads,
K kv heads, G query heads per kv head, H head dim, J key blocks, P pages, L page size, W window.

Two ways to run one layer, sharing parameters and the projections:
  * teacher-forced: ``x [B,T,D]`` at positions ``0..T-1``; attention through
    ``agentrl_jax.kernels`` (the path and each kernel op's impl chosen by ``model.dispatch``).
  * chunked with a cache: ``x [B,C,D]`` appended after the ``lengths[b]`` tokens already
    cached. ``S`` layers keep a ring buffer of ``W`` tokens per sequence; ``F``/``D`` layers
    keep a paged pool ``[P, L, K, H]`` addressed through per-sequence ``block_tables``
    (``model.paged_attention``). The chunk's keys are written first, then the chunk attends
    over the gathered context with a mask (fixed shapes: decode and chunked training compute
    identical numbers).

KV compression hooks of the chunked path (F/D layers; replayed by the trainer's chunked pass):
``meta['keep']`` bool [B, S] hides evicted keys; ``meta['int8_at']`` int32 [B, S] moves keys to
int8 (per logical page and KV head, ``model.kv_quant``) in place from the chunk containing that
position on. A cache made with an int8 pool (``init_layer_cache(int8_pages=...)``, with
``meta['int8_tables']``) stores the pages that are all int8 there as int8 codes with f32
scales, so their float pages can be freed; the values read are the same (``model.paged``). A
``kv_cache_dtype='int8'`` policy quantises every page of F/D layers once the next page starts
(S rings stay in the compute dtype); its teacher-forced pass does not quantise (the difference
is measured as rollout/trainer mismatch, the policy is not a parity policy).

Which way a layer attends (teacher-forced, ring, decode kernel, gathered, live pages, masked)
is ``model.dispatch.attention_path``'s table; this module and ``model.paged_attention`` run the
path it names.

Decode kernel (``decode_kernel=True``, used by the sampler under non-parity policies): a chunk of
one row (``C == 1``) in an F/D layer attends through ``kernels.paged_decode_attention`` reading
the page pool and block tables directly instead of gathering the context into ``[B, S, K, H]``.
D layers pass the pool as is; F layers score blocks (on the gathered live keys with
``select_blocks``, or on the stored block means with ``sparse_gather``), then view the pool as
pages of ``sparse_block_size`` tokens and give the kernel, per KV head, a block table of the
selected blocks in ascending order (every selected block but the query's own is complete, so
they form one contiguous virtual sequence). ``meta['keep']`` becomes the kernel's key mask; an
int8 pool is read by a second kernel call merged by log-sum-exp (``model.paged_attention``).
Not used with a ``mass`` accumulator (the kernel returns no probabilities) or sinks; the
numbers equal the chunk path's up to float reduction order (not bitwise, hence never under
parity policies).

Sparse full attention (F): blocks are chosen by ``model.select.select_blocks`` (mean-pooled
keys, top-k, own block kept). With ``ModelConfig.sparse_gather`` the chunked path keeps the
block means in the cache and reads only the selected blocks (``model.sparse_blocks``). The
selection of every query can be recorded (``record_blocks``: returned in the layer cache under
``"blocks"``) and replayed (``replay_blocks``) in either path, so training attends to exactly
the blocks the rollout attended to.

Pretrained-family options (``ModelConfig``): q/k/v/o biases (``attn_bias``), RMSNorm of q and
k over ``head_dim`` before RoPE (``qk_norm``), RoPE scalings (``model.rope``), ``S`` layers
without their output gate (``window_gate=False``: plain sliding window, gpt-oss) and learned
attention sinks (``attn_sinks``): sink layers attend through ``model.sinks`` (XLA) on every
path, teacher-forced included, and never through the kernels, which have no sink term.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.dispatch import AttentionCall, attention_path
from agentrl_jax.model.layers import DecodeForm, RMSNorm, param_init, weight_product
from agentrl_jax.model.paged import (  # noqa: F401 - re-exported: part of this module's API
    int8_page_update,
    over_live_pages,
    page_buckets,
)
from agentrl_jax.model.paged_attention import fit_blocks, paged_chunk
from agentrl_jax.model.rope import apply_rope
from agentrl_jax.model.select import select_blocks, sparse_coverage  # noqa: F401 - re-exported
from agentrl_jax.model.sinks import masked_attention, sink_attention  # noqa: F401 - re-exported
from agentrl_jax.precision import DTypePolicy


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
    int8_pages: int = 0,
    max_len: int | None = None,
) -> dict[str, jax.Array]:
    """Empty cache of one layer: ring ``{k, v}: [B, W, K, H]`` for S, pool ``[P, L, K, H]`` else.

    Float buffers have :func:`pool_dtype` (the compute dtype under ``kv_cache_dtype='int8'``).
    Paged layers get an int8 pool of ``int8_pages`` pages when it is > 0: ``k8``, ``v8`` int8
    [P8, L, K, H] and ``ks``, ``vs`` f32 [P8, K]. F layers of a ``sparse_gather`` model get
    ``kmean`` f32 [B, K, max_len / sparse_block_size, H] (``max_len`` required then: the
    sequence capacity, a multiple of ``page_size``).

    Raises:
      ValueError: ``int8_pages`` < 0, or ``sparse_gather`` without ``max_len``.
    """
    dt = pool_dtype(policy)
    kh, h = cfg.n_kv_heads, cfg.head_dim
    if kind == "S":
        shape = (batch, cfg.window, kh, h)
        return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}
    if int8_pages < 0:
        raise ValueError(f"init_layer_cache int8_pages={int8_pages} must be >= 0")
    shape = (n_pages, page_size, kh, h)
    out = {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}
    if int8_pages:
        shape8 = (int8_pages, page_size, kh, h)
        out.update(k8=jnp.zeros(shape8, jnp.int8), v8=jnp.zeros(shape8, jnp.int8))
        out.update(ks=jnp.zeros((int8_pages, kh), jnp.float32))
        out.update(vs=jnp.zeros((int8_pages, kh), jnp.float32))
    if kind == "F" and cfg.sparse_gather:
        if max_len is None:
            raise ValueError("init_layer_cache of a sparse_gather F layer needs max_len")
        out["kmean"] = jnp.zeros((batch, kh, max_len // cfg.sparse_block_size, h), jnp.float32)
    return out


class Attention(nn.Module):
    """One attention layer of kind ``S``, ``F`` or ``D`` (see module docstring); ``form`` says
    how its projections' weights are laid out (``layers.DecodeForm``)."""

    cfg: ModelConfig
    policy: DTypePolicy
    kind: str
    decode_kernel: bool = False
    record_blocks: bool = False
    form: DecodeForm = DecodeForm()

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
        replay_blocks: jax.Array | None = None,
    ) -> tuple[jax.Array, dict | None]:
        """x [B,T,D] -> ([B,T,D], new layer cache or None).

        Teacher-forced when ``cache`` is None (positions must be 0..T-1). Chunked otherwise:
        ``meta`` holds ``lengths`` int32 [B] (tokens cached before this chunk) and, for F/D,
        ``block_tables`` int32 [B, max_pages], optionally ``int8_tables`` int32 [B, max_pages]
        (with an int8 pool), ``keep`` bool [B, S] and ``int8_at`` int32 [B, S] (module
        docstring); ``valid`` bool [B,C] marks the real rows (a prefix of each row of the
        chunk). ``group``: None when ``cache`` is this layer's own (``init_layer_cache`` shapes);
        else an int32 scalar and ``cache`` holds every pattern group's buffers stacked on a
        leading axis ([G, ...]), of which this layer reads and updates entry ``group`` in place
        (see ``_chunk``). ``replay_blocks`` (F layers): int32 [B, T, K, n] block selection to
        use instead of scoring (-1 unused). With ``record_blocks`` the chunked path of an F
        layer returns its selection in the new cache under ``"blocks"`` [B, T, K, n_sel].
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
            out = self._teacher(q, k, v, positions, sinks, replay_blocks)
            new_cache = None
        else:
            out, new_cache = self._chunk(
                q, k, v, positions, cache, meta, valid, group, sinks, replay_blocks
            )

        if self.kind == "S" and cfg.window_gate:
            wg = self.param(
                "wg", nn.with_logical_partitioning(init, ("embed", "heads")), (d, n), pol.param
            )
            gate = jax.nn.sigmoid(pol.einsum("BTD,DN->BTN", x, wg).astype(jnp.float32))
            out = (out.astype(jnp.float32) * gate[..., None]).astype(pol.compute)
        y = weight_product(self, "wo", "BTNH,NHD->BTD", out, wo, pol, self.form)
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
            y = weight_product(self, f"w{name}", "BTD,DNH->BTNH", x, w, pol, self.form)
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
    def _teacher(self, q, k, v, positions, sinks=None, replay=None):
        """Teacher-forced attention by the path ``model.dispatch.attention_path`` picks."""
        cfg, pol = self.cfg, self.policy
        t = q.shape[1]
        path = attention_path(AttentionCall(self.kind, cached=False, sinks=sinks is not None))
        if path == "sinks":  # the kernels have no sink: the XLA path of ``model.sinks``
            window = cfg.window if self.kind == "S" else t
            return sink_attention(q, k, v, sinks, window=window, policy=pol)
        if path == "sliding_window":
            window = cfg.window if self.kind == "S" else t
            impl = pol.kernel_choice("sliding_window")
            return kernels.sliding_window_attention(q, k, v, window=window, impl=impl)
        if replay is not None:
            idx = fit_blocks(replay, min(cfg.sparse_topk_blocks, -(-t // cfg.sparse_block_size)))
        else:
            idx = select_blocks(
                q,
                k,
                block_size=cfg.sparse_block_size,
                topk_blocks=cfg.sparse_topk_blocks,
                q_positions=positions,
            )
        return kernels.block_sparse_attention(
            q, k, v, idx, block_size=cfg.sparse_block_size, impl=pol.kernel_choice("block_sparse")
        )

    # Chunked with cache ------------------------------------------------------------------
    def _chunk(self, q, k, v, positions, cache, meta, valid, group, sinks=None, replay=None):
        """Chunked attention; returns (out [B,C,N,H], new cache of the same layout as ``cache``).

        Stacked layout (``group`` given): the buffers keep their [G, ...] shape and only this
        chunk's rows are scattered into entry ``group``; paged pools are addressed as one flat
        pool of G*P pages (a free reshape) with the block tables offset by ``group * P``, so
        neither the write nor the gather (nor the decode kernel) copies a whole pool. Inside the
        transformer's layer scan the stacked buffers are the loop carry, so the updates happen in
        place (a per-layer slice as scan input/output would copy every pool each step).
        """
        if group is None:  # one layer's own buffers: a stack of one
            stacked = jax.tree.map(lambda a: a[None], cache)
            out, new = self._chunk(q, k, v, positions, stacked, meta, valid, 0, sinks, replay)
            blocks = new.pop("blocks", None)
            new = jax.tree.map(lambda a: a[0], new)
            return out, new if blocks is None else {**new, "blocks": blocks}
        b, c = q.shape[:2]
        lengths = meta["lengths"]
        valid = jnp.ones((b, c), bool) if valid is None else valid
        new_len = lengths + jnp.sum(valid, axis=1).astype(lengths.dtype)
        kd, vd = k.astype(pool_dtype(self.policy)), v.astype(pool_dtype(self.policy))
        if attention_path(AttentionCall(self.kind, cached=True)) == "ring":  # S layers
            return self._ring(q, kd, vd, positions, cache, lengths, valid, new_len, group, sinks)
        return paged_chunk(
            q, kd, vd, positions, cache, meta, valid, new_len, group,
            cfg=self.cfg, policy=self.policy, kind=self.kind, decode_kernel=self.decode_kernel,
            sinks=sinks, replay=replay, record=self.record_blocks,
        )  # fmt: skip

    def _ring(self, q, kd, vd, positions, cache, lengths, valid, new_len, group, sinks):
        """S layer: the chunk attends over its ring (the last W tokens) and its own rows."""
        cfg, pol = self.cfg, self.policy
        b, c = q.shape[:2]
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
