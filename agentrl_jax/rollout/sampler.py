"""Jitted chunked prefill and ``lax.while_loop`` decode over the model's KV cache.

Legend: B slots (sequences decoded together), C decode chunk rows, Cp prefill chunk rows,
N max new tokens per decode call, V vocab, S cache capacity (``max_len``), L_moe MoE layers,
k experts per token.

Both paths call the model's chunk function ``model.apply(params, tokens[B, C'], cache=...,
valid=...)``: decode feeds one valid row padded to ``C`` rows, prefill feeds ``Cp``-row chunks.
With ``Cp == C`` (forced for ``policy.parity``) every token's logits are computed exactly as
``model.chunked.chunked_logits`` with the same chunk, page size and ``max_len`` computes them
in training (bitwise).

Decode kernel: where ``model.dispatch.one_row_decode`` says so (``RolloutConfig.decode_kernel``,
non-parity policy, no attention-mass tracking) decode feeds one row per step to a model built
with ``decode_kernel=True``: F/D layers attend through ``kernels.paged_decode_attention`` (impl
by ``model.dispatch``) reading the page pool and block tables directly, S layers keep their
rings; an int8 pool and recorded eviction / int8 decisions go through it too (float and int8
calls merged by log-sum-exp). Tokens and logprobs equal the chunk path's up to fp32 reduction
order (tested). Otherwise decode runs the chunk path (the kernel returns no probabilities).

Decode parameters: the one-row decode reads its parameters rewritten once per weight version
(``model.decode_params``); :meth:`Sampler.prepare` makes that ``DecodeParams`` value and
:meth:`Sampler.decode` takes it (given plain parameters, it prepares them inside each call).

int8 pool (``init_state(int8_pages=...)``): F/D layers get a second pool of int8 pages with its
own block tables (``cache['int8_tables']``, filled by the agent loop); pages whose tokens are all
int8 are stored there and their float pages freed (``rollout.kv_cache``), with the same numbers.

Block records (``RolloutConfig.record_blocks``): every F layer's block selection of every
computed token (prefill and decode) is kept in ``DecodeState.blocks`` by position, for the agent
loop to copy into the trajectory (``Trajectory.sparse_blocks``) and the trainer to replay.

Prefill of a few slots: the agent loop calls :meth:`Sampler.prefill_slots`, which computes only
the slots with new tokens (a tool output usually arrives for one or a few of them) instead of
every slot's rows; under parity policies it is the all-slot prefill (its docstring says why).

Prefill chunks are aligned to multiples of ``Cp`` in absolute position (the first chunk of a
call may be partial): a chunk never straddles a multiple of ``Cp``, which is where recorded KV
eviction / int8 quantisation takes effect (see ``kv_cache.py``), so training replays the same
visibility and the same int8 round trips per chunk.

Logprobs: each sampled token's logprob is ``log_softmax(logits / temperature)[token]`` of the
fp32 logits (``chunked.tempered``) *before* top-k / top-p, i.e. the tempered policy that the
trainer differentiates (its teacher-forced logits tempered by the same temperature, carried in
``ChunkSpec.temperature``). Without filtering this is exactly the behaviour distribution; top-k
/ top-p draw from a truncated one, a deliberate off-policy gap the RL loss sees.

Randomness: the key of the token at position p of episode ``uid`` is
``fold_in(fold_in(rng, uid), p)``, so tokens do not depend on slot, batch composition or
scheduling (preempted and re-prefilled sequences resample the same tokens).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.chunked import NEVER, fixed_order_logprobs, tempered
from agentrl_jax.model.decode_params import DecodeParams, prepare_decode
from agentrl_jax.model.dispatch import one_row_decode
from agentrl_jax.model.layers import DecodeForm
from agentrl_jax.model.transformer import CacheSpec, Transformer, init_cache
from agentrl_jax.rollout import slots, threefry
from agentrl_jax.rollout.cache_sharding import place_decode_state
from agentrl_jax.rollout.rollout_config import RolloutConfig  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)


class DecodeState(NamedTuple):
    """Device state of B slots between sampler calls.

    Attributes:
      cache: the model cache (``lengths`` int32 [B] = tokens cached per slot).
      logits: float32 [B, V] next-token logits of each slot (after its last cached token).
      evict_at: int32 [B, S] per cached position, the first chunk-start position from which it
        is no longer visible in full/sparse layers (``int32 max`` = never evicted).
      int8_at: int32 [B, S] per cached position, the chunk-aligned position from which its K/V
        in full/sparse layers are int8 (``int32 max`` = never; see ``model.attention``).
      blocks: int32 [B, S, L_F, K, n_sel] block selection of the token at each position, per F
        layer and kv head (-1 unused), or None (``record_blocks`` off).
    """

    cache: dict
    logits: jax.Array
    evict_at: jax.Array
    int8_at: jax.Array
    blocks: jax.Array | None = None


class DecodeOut(NamedTuple):
    """What one decode call generated (rows generate contiguously from column 0).

    Attributes:
      tokens: int32 [B, N] sampled tokens (first ``n_new[b]`` valid).
      logprobs: float32 [B, N] logprobs of those tokens (``sample_tokens``).
      routes: int32 [B, N, L_moe, k] routes of each token's own forward (MoE) or None.
      n_new: int32 [B] tokens generated per slot in this call.
      finished: bool [B] the slot's turn ended (stop token or budget) in this call.
    """

    tokens: jax.Array
    logprobs: jax.Array
    routes: jax.Array | None
    n_new: jax.Array
    finished: jax.Array


def filter_logits(logits: jax.Array, cfg: RolloutConfig) -> jax.Array:
    """Sampling logits: fp32 [..., V] / temperature, top-k then top-p masked to -inf."""
    x = tempered(logits, cfg.temperature)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1.0:
        srt = -jnp.sort(-x, axis=-1)  # descending
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each entry
        cutoff = jnp.min(jnp.where(before < cfg.top_p, srt, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def token_keys(rng: jax.Array, uids: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-slot keys ``fold_in(fold_in(rng, uid), position)``: [B] uids/positions -> [B] keys."""
    return jax.vmap(lambda u, p: jax.random.fold_in(jax.random.fold_in(rng, u), p))(uids, positions)


def episode_keys(rng: jax.Array, uids: jax.Array) -> jax.Array:
    """``fold_in(rng, uid)`` per slot ([B] keys): :func:`token_keys` without the position, so
    a decode loop folds in only the position per step (the same keys)."""
    return jax.vmap(lambda u: jax.random.fold_in(rng, u))(uids)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; a NaN counts as the maximum), as two plain
    reductions: XLA CPU emits the variadic (value, index) reduce behind ``jnp.argmax`` as a
    scalar loop, and fuses the Gumbel noise's logs into that loop; a max and a min over the
    indices that reach it vectorise (the sampler's [B, V] argmax: 4-6x less time)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == m) | (jnp.isnan(x) & jnp.isnan(m))
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, x.shape[-1]), axis=-1)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.vmap(jax.random.categorical)(keys, logits)``, the same tokens: the Gumbel-max draw
    per row ([B] keys, [B, V] logits -> int32 [B]) with :func:`first_argmax`, its noise drawn
    by ``threefry.gumbel`` (``jax.random``'s numbers)."""
    noise = threefry.gumbel(keys, logits.shape[-1], logits.dtype)
    return first_argmax(noise + logits)


def sample_tokens(
    logits: jax.Array, keys: jax.Array, cfg: RolloutConfig, greedy_rows: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row. logits fp32 [B, V], keys [B] -> (int32 [B], logprob f32 [B]).

    ``greedy_rows`` (bool [B], optional): rows that take the argmax even when ``cfg`` samples
    (the other rows' tokens are unchanged). The logprob is of the tempered, unfiltered
    distribution (module docstring; greedy decoding: the untempered one).
    """
    with jax.named_scope("sample"):  # the scope ``benchmarks/decode_profile.py`` reads
        logits = logits.astype(jnp.float32)
        if cfg.greedy:
            tok = first_argmax(logits)
        else:
            x = filter_logits(logits, cfg)
            tok = categorical(keys, x)
            if greedy_rows is not None:
                tok = jnp.where(greedy_rows, first_argmax(logits), tok)
        tok = tok.astype(jnp.int32)
        if not cfg.greedy and cfg.temperature != 1.0:
            logits = tempered(logits, cfg.temperature)
        return tok, fixed_order_logprobs(logits, tok)


def _with_keep(cache: dict, state: DecodeState) -> dict:
    """Cache whose ``keep`` mask hides keys evicted before this chunk's first position, with the
    recorded int8 decisions (``int8_at``)."""
    out = dict(cache)
    out["keep"] = cache["lengths"][:, None] < state.evict_at
    out["int8_at"] = state.int8_at
    return out


def _strip_keep(cache: dict) -> dict:
    return {k: v for k, v in cache.items() if k not in ("keep", "int8_at")}


class Sampler:
    """Jitted prefill/decode for one (model config, dtype policy, sampling config).

    Build with :func:`get_sampler` (cached, so tests and loops share compiles).
    """

    def __init__(self, model: Transformer, cfg: RolloutConfig):
        mcfg = model.cfg
        if "F" in mcfg.layer_pattern and cfg.page_size % mcfg.sparse_block_size:
            raise ValueError(
                f"RolloutConfig.page_size={cfg.page_size} must be a multiple of "
                f"sparse_block_size={mcfg.sparse_block_size}"
            )
        record = cfg.record_blocks and "F" in mcfg.layer_pattern
        self.model = model.clone(record_blocks=True) if record else model
        self.cfg = cfg
        self.prefill_rows = cfg.prefill_rows(model.policy.parity)
        self.is_moe = mcfg.is_moe
        self.record = record
        # the one-row decode where the state allows it (``uses_decode_kernel``)
        self.kernel_decode = one_row_decode(model.policy, cfg.decode_kernel, tracks_mass=False)
        # Non-parity prefill: the LM head on each sequence's last new row only (``logits_rows``),
        # not on every row of the chunk. Parity policies keep every row: the trainer's chunks run
        # the head on as many rows, so both pick the same matmul kernel.
        self.last_row_logits = cfg.last_row_logits and not model.policy.parity
        self.decode_options = cfg.decode_options()
        self._logged_form = None
        self.prefill = jax.jit(self._prefill, donate_argnums=1)
        self.prefill_rows_of = jax.jit(self._prefill_rows_of, donate_argnums=1)
        copy = functools.partial(slots.copy_slots, pattern=mcfg.layer_pattern)
        self._copy = jax.jit(copy, donate_argnums=0)
        self.decode = jax.jit(self._decode, donate_argnums=1)

    def decode_model(self, form: DecodeForm) -> Transformer:
        """The one-row decode's model, reading parameters of layout ``form``."""
        return Transformer(
            self.model.cfg,
            self.model.policy,
            decode_kernel=True,
            record_blocks=self.record,
            form=form,
        )

    def prepare(self, params, *, track_mass: bool = False) -> DecodeParams:
        """The parameters :meth:`decode` reads, prepared once per weight version: rewritten for
        the one-row decode (``decode_params.prepare_decode`` with ``RolloutConfig``'s options)
        where decodes of a state with ``track_mass`` take it, else as they are."""
        if not one_row_decode(self.model.policy, self.cfg.decode_kernel, track_mass):
            return DecodeParams(params)
        mcfg, policy = self.model.cfg, self.model.policy
        prepared = prepare_decode(params, policy, cfg=mcfg, options=self.decode_options)
        if prepared.form != self._logged_form:
            self._logged_form = prepared.form
            logger.info("one-row decode parameters: %s", prepared.form.describe())
        return prepared

    # State ----------------------------------------------------------------------------------
    def init_state(
        self,
        batch: int,
        n_pages: int | None = None,
        *,
        track_mass: bool = False,
        int8_pages: int = 0,
    ) -> DecodeState:
        """Empty state of ``batch`` slots (shared pool of ``n_pages`` pages if given), placed
        on the ambient mesh if there is one (``rollout.cache_sharding``).

        ``track_mass``: F/D layers accumulate the attention mass each cached position gets
        (:meth:`attention_mass`, needed by KV eviction; decode then uses the chunk path).
        ``int8_pages``: F/D layers get an int8 pool of that many pages (module docstring).
        """
        spec = CacheSpec(batch, self.cfg.max_len, self.cfg.page_size, n_pages, int8_pages)
        cache = init_cache(self.model.cfg, self.model.policy, spec)
        layers = {}
        for name, layer in cache["layers"].items():
            kind = self.model.cfg.layer_pattern[int(name[6:])]
            if track_mass and layer["k"].ndim == 5 and kind != "S":
                layer = {**layer, "mass": jnp.zeros((layer["k"].shape[0], batch, spec.max_len))}
            layers[name] = layer
        cache["layers"] = layers
        blocks = None
        if self.model.record_blocks:
            mcfg = self.model.cfg
            n_f = mcfg.layer_counts()["F"]
            n_sel = min(mcfg.sparse_topk_blocks, spec.max_len // mcfg.sparse_block_size)
            shape = (batch, spec.max_len, n_f, mcfg.n_kv_heads, n_sel)
            blocks = jnp.full(shape, -1, jnp.int32)
        state = DecodeState(
            cache=cache,
            logits=jnp.zeros((batch, self.model.cfg.vocab_size), jnp.float32),
            evict_at=jnp.full((batch, self.cfg.max_len), NEVER, jnp.int32),
            int8_at=jnp.full((batch, self.cfg.max_len), NEVER, jnp.int32),
            blocks=blocks,
        )
        # Under an ambient mesh: slots over data, KV heads over tensor (``cache_sharding``).
        return place_decode_state(state)

    @property
    def n_paged_layers(self) -> int:
        counts = self.model.cfg.layer_counts()
        return counts["F"] + counts["D"]

    def reset_slots(
        self, state: DecodeState, mask, block_tables=None, int8_tables=None
    ) -> DecodeState:
        """Empties the slots where ``mask`` (bool [B]) is set; optionally new block tables of
        the float and int8 pools (``slots.reset_slots``)."""
        return slots.reset_slots(state, mask, block_tables, int8_tables)

    @staticmethod
    def tracks_mass(state: DecodeState) -> bool:
        """Whether ``state`` accumulates attention mass (``init_state(track_mass=True)``)."""
        return any("mass" in layer for layer in state.cache["layers"].values())

    def uses_decode_kernel(self, state: DecodeState) -> bool:
        """Whether :meth:`decode` on ``state`` is the one-row decode through the paged decode
        kernel (``model.dispatch.one_row_decode``)."""
        mass = self.tracks_mass(state)
        return one_row_decode(self.model.policy, self.cfg.decode_kernel, mass)

    @staticmethod
    def attention_mass(state: DecodeState) -> jax.Array:
        """float32 [B, S]: attention each cached position got, summed over queries and F/D
        layers (mean over heads), since the slot was reset."""
        total = 0.0
        for layer in state.cache["layers"].values():
            if "mass" in layer:
                total = total + jnp.sum(layer["mass"], axis=0)
        return jnp.asarray(total)

    # Prefill --------------------------------------------------------------------------------
    def _prefill(self, params, state: DecodeState, tokens, n_new):
        """Appends ``tokens[b, :n_new[b]]`` to each slot in position-aligned chunks.

        tokens int32 [B, Tp] (Tp fixed by the caller, see ``prefill_width``); n_new int32 [B]
        (0 leaves a slot untouched). The number of chunks run is dynamic (one compile). Returns
        (new state, routes int32 [B, Tp, L_moe, k] of the new tokens, or None). Slots with
        n_new > 0 get the logits after their last new token.
        """
        cp = self.prefill_rows
        b, tp = tokens.shape
        start = state.cache["lengths"]
        first = cp - start % cp  # rows of the (partial) first chunk
        # chunk j >= 1 holds new tokens first + (j-1)*cp ...; chunk 0 holds 0 .. first-1
        need = jnp.where(n_new > 0, 1 + jnp.maximum(0, -(-(n_new - first) // cp)), 0)
        n_chunks = jnp.max(need)
        pad = jnp.pad(tokens, ((0, 0), (0, cp)))
        mcfg = self.model.cfg
        routes0 = (
            jnp.zeros((b, tp + cp, mcfg.n_layers, mcfg.experts_per_token), jnp.int32)
            if self.is_moe
            else None
        )

        def body(j, carry):
            cache, last, routes, blocks = carry
            off = jnp.where(j == 0, 0, first + (j - 1) * cp)  # [B]
            cnt = jnp.where(j == 0, first, cp)
            idx = off[:, None] + jnp.arange(cp)  # [B, Cp]
            val = (jnp.arange(cp)[None, :] < cnt[:, None]) & (idx < n_new[:, None])
            tok = jnp.take_along_axis(pad, jnp.minimum(idx, tp + cp - 1), axis=1)
            n_val = jnp.sum(val, axis=1)
            row = jnp.maximum(n_val - 1, 0)
            last_only = self.last_row_logits
            logits, cache, extras = self.model.apply(
                params,
                tok,
                cache=_with_keep(cache, state),
                valid=val,
                logits_rows=row if last_only else None,
            )
            lg = (
                logits[:, 0]
                if last_only
                else jnp.take_along_axis(logits, row[:, None, None], 1)[:, 0]
            )
            last = jnp.where((n_val > 0)[:, None], lg, last)
            bi = jnp.broadcast_to(jnp.arange(b)[:, None], (b, cp))
            if routes is not None:
                dst = jnp.where(val, idx, tp + cp)  # invalid rows dropped
                routes = routes.at[bi, dst].set(extras["routes"], mode="drop")
            if blocks is not None:  # by absolute position
                dst = jnp.where(val, start[:, None] + idx, blocks.shape[1])
                blocks = blocks.at[bi, dst].set(extras["blocks"], mode="drop")
            return _strip_keep(cache), last, routes, blocks

        cache, last, routes, blocks = jax.lax.fori_loop(
            0, n_chunks, body, (state.cache, state.logits, routes0, state.blocks)
        )
        if routes is not None:
            routes = routes[:, :tp]
        return state._replace(cache=cache, logits=last, blocks=blocks), routes

    def _prefill_rows_of(self, params, state: DecodeState, rows, tokens, n_new):
        """:meth:`_prefill` of the slots ``rows`` only: the others are not computed at all.

        rows int32 [R] distinct slot ids; tokens int32 [R, Tp] and n_new int32 [R] in the order
        of ``rows`` (n_new 0 leaves that slot untouched, so padding rows are harmless). The R
        slots' per-slot state (lengths, block tables, rings, logits, eviction positions) is
        gathered, prefilled as a batch of R against the shared page pool, and scattered back.
        Returns (new state, routes int32 [R, Tp, L_moe, k] in the order of ``rows``, or None).
        """
        pattern = self.model.cfg.layer_pattern
        sub, routes = self._prefill(params, slots.gather_slots(state, rows, pattern), tokens, n_new)
        return slots.scatter_slots(state, rows, sub, pattern), routes

    def prefill_slots(self, params, state: DecodeState, tokens, n_new):
        """Prefill of the slots with ``n_new > 0`` only (tokens int32 [B, Tp], n_new int32 [B]).

        :meth:`prefill` runs every slot's rows, new tokens or not: in an agent loop most calls
        carry one or a few slots' tool outputs, so most of its work is discarded. Here the slots
        with new tokens are padded with idle ones to R in {1, 4, 16, ...} (capped at B, few
        compiles) and run through :meth:`prefill_rows_of`. The values equal :meth:`prefill`'s up
        to fp32 rounding: XLA picks matmul kernels by row count, so fewer rows can round the
        projections differently in the last bit; under a parity policy, whose bits must match
        the trainer's recompute at the rollout's batch size, this is :meth:`prefill`. Returns
        (new state, routes [B, Tp, L_moe, k] numpy with the rows of untouched slots zero, or
        None).
        """
        n_new = np.asarray(n_new, np.int32)
        b = n_new.shape[0]
        busy = np.flatnonzero(n_new > 0)
        r = slots.bucket(len(busy), b)
        if r == b or self.model.policy.parity:
            state, routes = self.prefill(params, state, tokens, n_new)
            return state, None if routes is None else np.array(routes)  # writable
        idle = np.setdiff1d(np.arange(b), busy)[: r - len(busy)]
        rows = np.concatenate([busy, idle]).astype(np.int32)
        state, sub_routes = self.prefill_rows_of(
            params, state, rows, np.asarray(tokens)[rows], n_new[rows]
        )
        if sub_routes is None:
            return state, None
        routes = np.zeros((b, *sub_routes.shape[1:]), np.int32)
        routes[rows] = np.asarray(sub_routes)
        return state, routes

    def copy_slots(self, state: DecodeState, src, dst) -> DecodeState:
        """Makes slot ``dst[i]`` a copy of slot ``src[i]`` (no dst may also be a src).

        For slots whose token streams are equal (a GRPO group's prompt, and the same tool
        output after the same actions): prefill one, copy the rest. The pairs are padded to
        M in {1, 4, 16, ...} with no-op pairs (few compiles).
        """
        src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
        if src.shape != dst.shape or src.ndim != 1 or not len(src):
            raise ValueError(f"src {src.shape} and dst {dst.shape} must be equal non-empty [M]")
        if np.intersect1d(src, dst).size or len(set(dst.tolist())) != len(dst):
            raise ValueError(f"dst {dst.tolist()} must be distinct and disjoint from src")
        pad = np.full(slots.bucket(len(src)) - len(src), src[0], np.int32)
        return self._copy(state, np.concatenate([src, pad]), np.concatenate([dst, pad]))

    def prefill_width(self, n_max: int) -> int:
        """Token-array width for a prefill of at most ``n_max`` new tokens per slot.

        Widths are powers of two, at least ``min(128, max_len)``, so few shapes are compiled.
        """
        return max(min(128, self.cfg.max_len), 1 << max(0, int(n_max) - 1).bit_length())

    # Decode ---------------------------------------------------------------------------------
    def _decode(
        self, params, state: DecodeState, rng, uids, active, budget, stop_after, greedy_rows=None
    ):
        """Generates for active slots until each stops, or ``stop_after`` slots stopped.

        Args:
          params: :meth:`prepare` of the model parameters (a ``DecodeParams``: made once per
            weight version), or the parameters themselves (prepared inside this call).
          state: DecodeState; ``logits`` must hold each active slot's next-token logits.
          rng: base PRNG key; uids int32 [B] episode ids (see module docstring).
          active: bool [B] slots that generate. budget: int32 [B] most tokens each may emit.
          stop_after: int32 scalar; return once this many active slots have finished.
          greedy_rows: optional bool [B]: slots that decode greedily under a sampling config
            (``sample_tokens``).

        Returns:
          (new state, DecodeOut).

        Raises:
          ValueError: parameters prepared for the one-row decode given with a state whose
            decode runs in chunks (it tracks attention mass: ``prepare(track_mass=True)``).
        """
        cfg, model = self.cfg, self.model
        b = active.shape[0]
        n = cfg.max_new_tokens
        c = cfg.chunk
        mass = self.tracks_mass(state)  # static: from the state's structure
        if not isinstance(params, DecodeParams):
            params = self.prepare(params, track_mass=mass)
        if self.uses_decode_kernel(state):  # one row per step
            model, c = self.decode_model(params.form), 1
        elif params.form != DecodeForm():
            raise ValueError(
                f"decode parameters prepared for the one-row decode ({params.form.describe()}) "
                "given with a state that tracks attention mass: prepare(track_mass=True)"
            )
        params = params.params
        stops = jnp.asarray(cfg.stop_tokens or (-1,), jnp.int32)
        mcfg = model.cfg
        out_tok = jnp.zeros((b, n), jnp.int32)
        out_lp = jnp.zeros((b, n), jnp.float32)
        out_rt = (
            jnp.zeros((b, n, mcfg.n_layers, mcfg.experts_per_token), jnp.int32)
            if self.is_moe
            else None
        )
        live = active & (budget > 0)
        ep_keys = episode_keys(rng, uids)  # loop-invariant half of ``token_keys``
        init = (0, state, live, jnp.zeros((b,), jnp.int32), out_tok, out_lp, out_rt)

        def cond(carry):
            i, _, live, _, *_ = carry
            n_done = jnp.sum(active & ~live)
            return (i < n) & jnp.any(live) & (n_done < stop_after)

        def body(carry):
            i, st, live, count, out_tok, out_lp, out_rt = carry
            pos = st.cache["lengths"]
            keys = threefry.fold_in(ep_keys, pos)  # = token_keys(rng, uids, pos)
            tok, lp = sample_tokens(st.logits, keys, cfg, greedy_rows)
            toks = jnp.zeros((b, c), jnp.int32).at[:, 0].set(tok)
            valid = jnp.zeros((b, c), bool).at[:, 0].set(live)
            cache = _with_keep(st.cache, st)
            logits, cache, extras = model.apply(params, toks, cache=cache, valid=valid)
            new_logits = jnp.where(live[:, None], logits[:, 0], st.logits)
            out_tok = out_tok.at[:, i].set(jnp.where(live, tok, 0))
            out_lp = out_lp.at[:, i].set(jnp.where(live, lp, 0.0))
            if out_rt is not None:
                out_rt = out_rt.at[:, i].set(
                    jnp.where(live[:, None, None], extras["routes"][:, 0], 0)
                )
            count = count + live.astype(jnp.int32)
            ended = jnp.any(tok[:, None] == stops[None, :], axis=1) | (count >= budget)
            st = st._replace(cache=_strip_keep(cache), logits=new_logits)
            if st.blocks is not None:
                dst = jnp.where(live, pos, st.blocks.shape[1])
                st = st._replace(
                    blocks=st.blocks.at[jnp.arange(b), dst].set(extras["blocks"][:, 0], mode="drop")
                )
            return i + 1, st, live & ~ended, count, out_tok, out_lp, out_rt

        _, state, live_end, count, out_tok, out_lp, out_rt = jax.lax.while_loop(cond, body, init)
        finished = active & ~live_end
        return state, DecodeOut(out_tok, out_lp, out_rt, count, finished)


@functools.cache
def _cached_sampler(model_cfg, policy, cfg: RolloutConfig) -> Sampler:
    return Sampler(Transformer(model_cfg, policy), cfg)


def get_sampler(model: Transformer, cfg: RolloutConfig) -> Sampler:
    """The (cached) :class:`Sampler` of ``model`` (its config and policy) and ``cfg``."""
    return _cached_sampler(model.cfg, model.policy, cfg)
