"""Long-context KV memory and sparse decode: measured device bytes, context per pool, decode speed
of sparse full attention reading its top-k blocks, rollout/trainer parity with replay.

Model: ``common.bench_model('dense', 'SSSF')`` (the rollout benchmark's model: 4 layers, d_model
256, 4 query / 2 KV heads of dim 64, vocab 1024, window 64) with the guide's sparse attention
sizes unscaled: blocks of 8 tokens, top-k 4096 tokens (512 blocks), i.e. 1/2 of the keys at 8k
and 1/8 at 32k; the tiny model changes widths, not token counts. dtype float32 (``fp32``,
``fp32-parity``): bf16 matmuls are slower than fp32 on the CPUs measured here.

Parts (``--parts``), each at every ``--contexts`` size (tokens):
  * ``kv``: one agent-loop episode of tool outputs (``--obs`` tokens each) and model turns (16
    new tokens) up to the context size, one slot, a shared page pool. ``kv_option``: ``dense``
    (no compression), ``int8`` (finished low-attention tool outputs moved to int8 pages, their
    float pages freed), ``evict`` (evicted, pages freed); threshold 1.0 (``EvictionConfig``).
    ``kv_device_bytes``: the episode's KV bytes on the live pools at its last turn (pages held
    in each pool x page bytes + the S rings; ``rollout.kv_cache.KVLayout``), with a pool that
    holds the whole context. ``max_context_in_pool``: tokens the episode reaches with a pool of
    the bytes of half the context in float pages (``int8``: half of those bytes as float pages,
    half as int8 pages); ``episode_completed``: it reached the episode's end
    (``episode_tokens``, just under the context size) instead of running out of pages.
  * ``decode``: one slot holding the context (prefilled), then ``--new`` tokens decoded per
    call, median of ``--reps`` calls: ``decode_tokens_per_s`` of the F layer reading the whole
    context masked to its blocks (``masked``: ``select_blocks`` on every key) against reading
    only its top-k blocks scored on stored block means (``gather``, ``ModelConfig.sparse_gather``),
    both through the chunk path (``decode_kernel`` false) and through the paged decode kernel
    (``decode_kernel`` true; ``--decode-paths`` picks them); ``sparse_speedup_vs_dense`` =
    gather / masked on the same path.
    ``--decode-kv``: ``dense`` (no compression) and/or ``int8+evict``: the prefilled context's
    middle (after the prompt, before the last ``2 * --obs`` tokens) in spans of ``--obs``
    tokens, alternately moved to int8 pages (the int8 pool, ``int8_tables``), evicted, and
    kept in float pages (recorded decisions taking effect at the span's end, no mass
    tracking), so the kernel path reads two pools merged by log-sum-exp, each call over its own
    pool's pages (blocks) holding a visible key. ``whole_context_*``: pages and KV bytes a
    whole-context read of the start state visits per pool, against both calls over every live
    page slot (``whole_context_read``).
    ``--decode-fill``: the slot's context comes from ``prefill`` (the model run over random
    tokens; ``prefill_s``) and/or ``random`` (``random_fill``, ``fill_s``; variants
    ``decode/random/...``): normal K/V at the per-layer mean and std of a real 1k-token
    prefill (``kv_stats``) written into the pools and rings, the recorded int8 decisions
    applied (int8 codes and scales), the F layer's block means of the stored keys, the
    lengths. Decode cost does not depend on the values, and the shapes, live pages, visible and
    selected block counts, int8 pages and eviction mask equal the prefilled ones, so both fills
    time the same work; ``random`` skips the masked full-attention prefill, whose cost grows
    with the square of the context. Every decode line carries ``decode_fill``.
  * ``parity``: ``--parity-contexts``: one episode under ``fp32-parity`` with the gather model,
    int8 + eviction and recorded blocks; ``max_abs_dlogp`` of the trainer's chunked pass against
    the rollout's logprobs (action tokens), replaying the KV masks and the blocks
    (``replay`` true) or the KV masks only (false). And one episode under ``fp32`` (decode
    kernel over the gathered blocks, no compression: a non-parity policy cannot replay KV
    masks) against the trainer's teacher-forced pass with and without the recorded blocks.

Usage: python benchmarks/long_context.py [--contexts 8192,32768] [--parts kv,decode,parity]
       [--reps 5] [--parity-contexts 8192] [--decode-kv dense,int8+evict]
       [--decode-fill prefill,random] [--decode-paths chunk,kernel]
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import Timing, bench_model, env_fields

from agentrl_jax.envs.base import StepResult
from agentrl_jax.envs.coderepair import CodeTokenizer
from agentrl_jax.model.paged import Int8Pool, int8_page_update, int8_pages_read, read_tokens
from agentrl_jax.model.paged_attention import INT8_KEYS
from agentrl_jax.model.sparse_blocks import update_block_means
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.kv_cache import EvictionConfig, KVLayout
from agentrl_jax.rollout.loop_state import RolloutStats
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import RolloutConfig, Sampler

log = logging.getLogger("long_context")
PAGE, NEW_PER_TURN, PROMPT = 16, 16, 32
MODEL = bench_model("dense", "SSSF", sparse_block_size=8, sparse_topk_tokens=4096)
OPTIONS = {
    "dense": None,
    "int8": EvictionConfig(threshold=1.0, int8=True),
    "evict": EvictionConfig(threshold=1.0),
}


class ToolEnv:
    """A short prompt, then one tool output of ``obs`` tokens per model turn until ``context``
    tokens (done when the next output would not fit)."""

    def __init__(self, tok: CodeTokenizer, obs: int, context: int):
        self.tok, self.obs, self.context = tok, obs, context

    def reset(self, seed):
        self.rng, self.n = random.Random(seed), PROMPT
        return [self.tok.bos_id, *(self.rng.randrange(20, 400) for _ in range(PROMPT - 1))]

    def step(self, action):
        self.n += len(action) + self.obs
        done = self.n + self.obs + NEW_PER_TURN > self.context
        obs = [self.tok.obs_start_id, *(self.rng.randrange(20, 400) for _ in range(self.obs - 2))]
        obs.append(self.tok.obs_end_id)
        log_ = {"tool": "read", "args": (), "output": "", "error": False, "success": done}
        return obs, StepResult(done=done, outcome_reward=float(done), process={}, log=log_)


def sampling(context: int, parity: bool = False, **kw) -> RolloutConfig:
    max_len = -(-(context + 2 * PAGE) // PAGE) * PAGE
    return RolloutConfig(
        max_new_tokens=NEW_PER_TURN, max_len=max_len, page_size=PAGE, chunk=4,
        prefill_chunk=None if parity else 128, **kw,
    )  # fmt: skip


def episode(model, params, context, obs, eviction, n_pages, int8_pages=None, **cfg_kw):
    """One episode of ``ToolEnv``; returns (trajectory, stats, seconds)."""
    tok, stats = CodeTokenizer(), RolloutStats()
    cfg = sampling(context, model.policy.parity, **cfg_kw)
    t0 = time.perf_counter()
    traj = run_episodes(
        model, params, [0], lambda: ToolEnv(tok, obs, context), tok, cfg, jax.random.key(1),
        n_slots=1, max_turns=10_000, n_pages=n_pages, int8_pages=int8_pages,
        eviction=eviction, stats=stats,
    )  # fmt: skip
    return traj, stats, time.perf_counter() - t0


def page_bytes(model, context) -> KVLayout:
    state = Sampler(model, sampling(context)).init_state(1, 1, int8_pages=1)
    return KVLayout.from_cache(state.cache, MODEL.layer_pattern)


def kv_lines(context, args, params):
    model = Transformer(MODEL, get_policy("fp32"))
    layout = page_bytes(model, context)
    full_pages = -(-(context + 2 * PAGE) // PAGE)
    budget = layout.float_page * (context // 2 // PAGE)  # bytes of half the context in float
    for option, eviction in OPTIONS.items():
        traj, stats, secs = episode(model, params, context, args.obs, eviction, full_pages)
        last = traj.logs[-1]
        if option == "int8":
            small = dict(n_pages=budget // 2 // layout.float_page)
            small["int8_pages"] = budget // 2 // layout.int8_page
        else:
            small = dict(n_pages=budget // layout.float_page)
        tight, _, secs_t = episode(model, params, context, args.obs, eviction, **small)
        reached = int(tight.valid.sum())
        yield dict(
            bench="long_context", variant=f"kv/{option}/{context}", context=context,
            kv_option=option, policy="fp32", dtype="float32",
            kv_device_bytes=int(last["kv_bytes"]),
            kv_bytes_float=int(last["kv_bytes_float"]), kv_bytes_int8=int(last["kv_bytes_int8"]),
            tokens_at_last_turn=int(last["tokens_so_far"]),
            kv_peak_pool_bytes=int(stats.max_kv_bytes),
            evicted_tokens=stats.evicted_tokens, int8_tokens=stats.int8_tokens,
            max_context_in_pool=reached, episode_completed=not bool(tight.truncated[0]),
            episode_tokens=int(traj.valid.sum()),
            pool_bytes=int(small["n_pages"] * layout.float_page
                           + small.get("int8_pages", 0) * layout.int8_page),
            float_page_bytes=layout.float_page, int8_page_bytes=layout.int8_page,
            episode_s=round(secs, 1), tight_episode_s=round(secs_t, 1),
        )  # fmt: skip


def decode_rates(runs: dict, params, n_new: int, reps: int) -> dict:
    """Median decode rate of one slot per entry of ``runs`` (``{key: (sampler, state)}``), over
    ``reps`` calls of ``n_new`` tokens each, the entries timed in alternation (round by round,
    so load that drifts during the measurement falls on all of them alike). Each entry decodes
    on from its own copy of its state; its first call compiles. Returns ``{key: Timing}``."""
    args = (jax.random.key(2), np.zeros(1, np.int32), np.ones(1, bool))
    budget = np.full(1, n_new, np.int32)
    states = {k: jax.tree.map(lambda a: a.copy(), st) for k, (_, st) in runs.items()}
    times = {k: [] for k in runs}
    for i in range(reps + 1):
        for k, (sampler, _) in runs.items():
            t0 = time.perf_counter()
            states[k], out = sampler.decode(params, states[k], *args, budget, np.int32(1))
            jax.block_until_ready(out.tokens)
            if i:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: Timing.from_ms(v) for k, v in times.items()}


def compressed_state(sampler, n: int, obs: int):
    """A one-slot decode state whose first ``n`` tokens will carry recorded int8 / eviction
    decisions (``--decode-kv int8+evict``); returns (state, int8 tokens, evicted tokens)."""
    max_len = sampler.cfg.max_len
    state = sampler.init_state(1, int8_pages=max_len // PAGE)
    pos = np.arange(max_len)
    span = (pos - PROMPT) // obs
    middle = (pos >= PROMPT) & (pos < n - 2 * obs)
    done = ((span + 1) * obs + PROMPT + 127) // 128 * 128  # the next prefill chunk start
    never = np.iinfo(np.int32).max
    int8_at = np.where(middle & (span % 3 == 0), done, never).astype(np.int32)
    evict_at = np.where(middle & (span % 3 == 1), done, never).astype(np.int32)
    tables8 = np.arange(max_len // PAGE, dtype=np.int32)[None, :]  # one int8 page per page
    cache = {**state.cache, "int8_tables": jnp.asarray(tables8)}
    state = state._replace(
        cache=cache, int8_at=jnp.asarray(int8_at[None]),
        evict_at=jnp.asarray(evict_at[None]),
    )  # fmt: skip
    # decode starts at position n: keys with evict_at <= n are hidden from it, and int8
    # decisions at positions <= n are in effect in its first chunk
    return state, int(np.sum(int8_at <= n)), int(np.sum(evict_at <= n))


def _live_tokens(pool: jax.Array, tables: jax.Array, n: int) -> jax.Array:
    """Slot 0's first ``n`` tokens of one group's pool [P, L, K, H] -> [n, K, H]."""
    return pool[jnp.maximum(tables[0], 0)].reshape(-1, *pool.shape[2:])[:n]


def kv_stats(model, params, n: int = 1024) -> dict:
    """``stored_stats`` after a real prefill of ``n`` random tokens (one slot), for
    ``random_fill``."""
    sampler = Sampler(model, sampling(n))
    state = sampler.init_state(1)
    toks = np.asarray(jax.random.randint(jax.random.key(4), (1, n), 20, 400))
    state, _ = sampler.prefill(params, state, toks, np.full(1, n, np.int32))
    return stored_stats(state, model.cfg.layer_pattern)


def stored_stats(state, pattern: str) -> dict:
    """Mean and std of what slot 0 of ``state`` stores.

    Returns ``{layer name: {'k' | 'v': (mean, std) float64 [G] per pattern group}}`` over the
    stored keys and values (S layers: the ring; paged layers: the first ``lengths[0]``
    positions) and ``{'logits': (mean, std)}`` of its next-token logits.
    """
    n, tables, out = int(state.cache["lengths"][0]), state.cache["block_tables"], {}
    for name, layer in state.cache["layers"].items():
        out[name] = {}
        for key in ("k", "v"):
            x = layer[key][:, :1]  # [G, 1, W, K, H] ring, or [G, P, L, K, H] pool
            if pattern[int(name[6:])] != "S":
                x = jnp.stack([_live_tokens(pool, tables, n) for pool in layer[key]])
            x = np.asarray(x, np.float64).reshape(x.shape[0], -1)
            out[name][key] = (x.mean(axis=1), x.std(axis=1))
    logits = np.asarray(state.logits[0], np.float64)
    out["logits"] = (logits.mean(), logits.std())
    return out


def _normal(key, shape, mean_std, dtype) -> jax.Array:
    mean, std = mean_std
    return (jax.random.normal(key, shape, jnp.float32) * std + mean).astype(dtype)


def _block_means(kmean, pool, tables, lengths, cfg) -> jax.Array:
    """f32 [B, K, J, H]: every block's mean of the keys stored in ``pool`` [P, L, K, H] below
    ``lengths`` (``update_block_means`` over one row per block)."""
    bs, kh = cfg.sparse_block_size, pool.shape[2]
    b, s = tables.shape[0], tables.shape[1] * pool.shape[1]
    starts = jnp.broadcast_to(jnp.arange(0, s, bs)[None, :], (b, s // bs))
    heads = jnp.arange(kh)[None, None, :]

    def read_keys(pos):  # [B, X] -> [B, X, K, H]
        return read_tokens(pool, tables, pos[:, :, None], heads)

    return update_block_means(kmean, read_keys, starts, starts < lengths[:, None], lengths, bs)


def _fill_paged(layer, key, stats, tables, state, lengths, cfg):
    """One paged layer's groups: random live tokens written through the block tables, the
    recorded int8 decisions applied (codes and scales in the int8 pool), block means."""
    out = {name: [] for name in layer}
    n_pages, page, kh, h = layer["k"].shape[1:]
    s = tables.shape[1] * page
    pos = jnp.arange(s)[None, :]
    dst = jnp.where(pos < lengths[:, None], jnp.repeat(tables, page, axis=1), n_pages)
    dst = jnp.where(dst >= 0, dst, n_pages)  # no page or past the length: dropped
    for g in range(layer["k"].shape[0]):
        pools = []
        for i, name in enumerate(("k", "v")):
            x = _normal(
                jax.random.fold_in(key, 2 * g + i), (tables.shape[0], s, kh, h),
                (stats[name][0][g], stats[name][1][g]), layer[name].dtype,
            )  # fmt: skip
            pools.append(layer[name][g].at[dst, pos % page].set(x, mode="drop"))
        if "k8" in layer:
            pool8 = Int8Pool(*(layer[k][g] for k in INT8_KEYS), tables=state.cache["int8_tables"])
            *pools, pool8 = int8_page_update(
                *pools, tables, state.int8_at, jnp.zeros_like(lengths), lengths, pool8
            )
            for k, a in zip(INT8_KEYS, pool8[:4], strict=True):
                out[k].append(a)
        out["k"].append(pools[0])
        out["v"].append(pools[1])
        if "kmean" in layer:  # the means of the stored keys, as the cached path keeps them
            out["kmean"].append(_block_means(layer["kmean"][g], pools[0], tables, lengths, cfg))
    return {name: jnp.stack(arrays) for name, arrays in out.items()}


def random_fill(sampler, state, n: int, stats: dict, key: jax.Array):
    """``state`` (empty slots, ``compressed_state`` decisions kept) as if every slot had been
    prefilled with ``n`` tokens, without running the model: random K/V at the magnitudes of a
    real prefill (``kv_stats``).

    Filled: ``lengths`` (n), the S rings (their first ``min(n, W)`` slots), the paged pools'
    first ``n`` positions through the block tables, the int8 pool (the recorded decisions in
    effect by ``n`` applied by ``model.paged.int8_page_update``: codes and scales of the pages
    that are all int8, their float pages fake-quantised), the F layers' block means of the
    stored keys (``model.sparse_blocks.update_block_means``) and the next-token logits. Decode
    then does exactly the work it does after a prefill: same shapes, live pages, visible and
    selected block counts, int8 pages and eviction mask; only the values differ, which decode
    cost does not depend on.

    Args:
      sampler: the Sampler that made ``state`` (its model config).
      state: a DecodeState with ``lengths`` 0.
      n: tokens per slot (<= ``max_len``).
      stats: ``kv_stats`` of the model.
      key: PRNG key.

    Returns:
      The filled DecodeState.

    Raises:
      ValueError: ``n`` outside [1, max_len].
    """
    if not 0 < n <= sampler.cfg.max_len:
        raise ValueError(f"random_fill n={n} must be in [1, max_len={sampler.cfg.max_len}]")
    return _random_fill(sampler.model.cfg, state, jnp.int32(n), stats, key)


@functools.partial(jax.jit, static_argnums=0)
def _random_fill(cfg, state, n, stats, key):
    cache = state.cache
    tables, (key, logit_key) = cache["block_tables"], jax.random.split(key)
    lengths = jnp.full(tables.shape[:1], n, jnp.int32)
    layers = {}
    for name, layer in cache["layers"].items():
        i = int(name[6:])
        kind, lkey = cfg.layer_pattern[i], jax.random.fold_in(key, i)
        if kind != "S":
            layers[name] = _fill_paged(layer, lkey, stats[name], tables, state, lengths, cfg)
            continue
        live = jnp.arange(layer["k"].shape[2])[None, None, :, None, None] < n
        layers[name] = {}
        for j, kv in enumerate(("k", "v")):
            mean, std = (jnp.asarray(a, jnp.float32)[:, None, None, None, None]
                         for a in stats[name][kv])  # fmt: skip
            x = jax.random.normal(jax.random.fold_in(lkey, j), layer[kv].shape) * std + mean
            layers[name][kv] = jnp.where(live, x, 0).astype(layer[kv].dtype)
    logits = _normal(logit_key, state.logits.shape, stats["logits"], jnp.float32)
    cache = {**cache, "layers": layers, "lengths": lengths}
    return state._replace(cache=cache, logits=logits)


def whole_context_read(state, n: int, pattern: str = MODEL.layer_pattern) -> dict:
    """KV bytes a whole-context decode read of the paged layers visits for the token at
    position ``n`` of slot 0 (a D layer's read; the F layer reads its selected blocks only):
    each pool's call over the pages of its pool holding a visible key
    (``model.paged.pool_call``), against both calls over every live page slot (one call and
    the same pages without an int8 pool). From the live tables, the recorded decisions and
    ``KVLayout``'s page bytes."""
    layout = KVLayout.from_cache(state.cache, pattern)
    tables = np.asarray(state.cache["block_tables"])[:1]
    s = tables.shape[1] * PAGE
    visible = np.arange(s)[None, :] <= n
    if state.evict_at is not None:  # keep: keys whose eviction is not yet in effect
        visible &= n < np.asarray(state.evict_at)[:1, :s]
    use8 = np.zeros(tables.shape, bool)
    if "int8_tables" in state.cache and state.int8_at is not None:
        pool = Int8Pool(None, None, None, None, jnp.asarray(state.cache["int8_tables"])[:1])
        use8 = np.asarray(int8_pages_read(pool, state.int8_at[:1, :s], jnp.full(1, n + 1)))
    held = visible.reshape(1, -1, PAGE).any(axis=2)
    live = -(-(n + 1) // PAGE)
    both = layout.float_page + (layout.int8_page if use8.any() else 0)
    return dict(
        whole_context_float_pages=int((held & ~use8).sum()),
        whole_context_int8_pages=int((held & use8).sum()),
        whole_context_read_bytes=int((held & ~use8).sum() * layout.float_page
                                     + (held & use8).sum() * layout.int8_page),
        whole_context_read_bytes_all_slots=live * both,
    )  # fmt: skip


def decode_lines(context, args, params, stats=None):
    """The decode part's lines at ``context`` for each ``--decode-kv`` and ``--decode-fill``
    (``stats``: ``kv_stats``, needed by the random fill)."""
    for kv in args.decode_kv.split(","):
        if kv not in ("dense", "int8+evict"):
            raise ValueError(f"--decode-kv {kv!r}; allowed: dense, int8+evict")
        for fill in args.decode_fill.split(","):
            yield from _decode_lines(context, args, params, kv, fill, stats)


def decode_start(sampler, params, n, kv, fill, obs, stats=None):
    """One slot holding ``n`` tokens of context, ready to decode.

    Args:
      sampler: the decode sampler (its model and ``max_len``).
      params: model parameters.
      n: context tokens.
      kv: 'dense' or 'int8+evict' (``compressed_state``).
      fill: 'prefill' (the model run over ``n`` random tokens) or 'random' (``random_fill``
        with ``stats``).
      obs: tokens per tool output (the int8 / eviction spans).
      stats: ``kv_stats`` of the model (fill 'random').

    Returns:
      (state, {int8_tokens, evicted_tokens} or {}, seconds to build the state).

    Raises:
      ValueError: ``fill`` unknown, or 'random' without ``stats``.
    """
    if fill not in ("prefill", "random") or (fill == "random" and stats is None):
        raise ValueError(f"--decode-fill {fill!r}; allowed: prefill, random (with kv_stats)")
    counts = {}
    if kv == "dense":
        state = sampler.init_state(1)
    else:
        state, *int8_evicted = compressed_state(sampler, n, obs)
        counts = dict(zip(("int8_tokens", "evicted_tokens"), int8_evicted, strict=True))
    t0 = time.perf_counter()
    if fill == "prefill":
        toks = np.asarray(jax.random.randint(jax.random.key(3), (1, n), 20, 400))
        state, _ = sampler.prefill(params, state, toks, np.full(1, n, np.int32))
    else:
        state = random_fill(sampler, state, n, stats, jax.random.key(3))
    jax.block_until_ready(state)
    return state, counts, time.perf_counter() - t0


def _decode_lines(context, args, params, kv, fill, stats):
    n = context - (args.reps + 1) * args.new
    runs, starts = {}, {}
    for mode, gather in (("masked", False), ("gather", True)):
        model = Transformer(MODEL.replace(sparse_gather=gather), get_policy("fp32"))
        for kernel in (False, True):
            if ("kernel" if kernel else "chunk") not in args.decode_paths.split(","):
                continue
            cfg = sampling(context, decode_kernel=kernel, stop_tokens=(-1,))
            sampler = Sampler(model, cfg)
            if mode not in starts:  # one start state per model; each path decodes from a copy
                state, counts, setup_s = decode_start(sampler, params, n, kv, fill, args.obs, stats)
                starts[mode] = state, {**counts, **whole_context_read(state, n)}, setup_s
            runs[mode, kernel] = sampler, starts[mode][0]
    timings = decode_rates(runs, params, args.new, args.reps)
    rates = {key: args.new / (t.median_ms / 1e3) for key, t in timings.items()}
    for (mode, kernel), (sampler, state) in runs.items():
        _, counts, setup_s = starts[mode]
        t = timings[mode, kernel]
        tags = ("" if fill == "prefill" else "random/") + ("" if kv == "dense" else f"{kv}/")
        line = dict(
            bench="long_context", variant=f"decode/{tags}{mode}/"
            f"{'kernel' if kernel else 'chunk'}/{context}", context=context, kv_option=kv,
            policy="fp32", dtype="float32", sparse_read=mode, decode_kernel=kernel,
            decode_fill=fill, uses_decode_kernel=sampler.uses_decode_kernel(state),
            **counts, decode_tokens_per_s=round(rates[mode, kernel], 2),
            **t.fields("decode_ms"), new_tokens=args.new, context_tokens=n,
            topk_tokens=MODEL.sparse_topk_tokens, block_size=MODEL.sparse_block_size,
            timed="interleaved",
            **{"prefill_s" if fill == "prefill" else "fill_s": round(setup_s, 1)},
        )  # fmt: skip
        if mode == "gather" and ("masked", kernel) in rates:
            speedup = rates[mode, kernel] / rates["masked", kernel]
            line["sparse_speedup_vs_dense"] = round(speedup, 3)
        yield line


def parity_lines(context, args, params):
    yield from _parity_lines(context, args, params, "fp32-parity")
    yield from _parity_lines(context, args, params, "fp32")


def _parity_lines(context, args, params, policy):
    model = Transformer(MODEL.replace(sparse_gather=True), get_policy(policy))
    parity = model.policy.parity
    eviction = EvictionConfig(threshold=1.0, int8=True, drop_threshold=0.5) if parity else None
    full_pages = -(-(context + 2 * PAGE) // PAGE)
    traj, stats, secs = episode(
        model, params, context, args.obs, eviction, full_pages, record_blocks=True
    )
    cfg = sampling(context, parity, record_blocks=True)
    act = np.asarray(traj.action_mask)
    for replay in (True, False):
        t0 = time.perf_counter()
        lp, _ = trainer_logprobs(
            model, params, traj, sampling_cfg=cfg, n_slots=1, replay_kv=parity,
            replay_blocks=replay,
        )  # fmt: skip
        dl = np.abs(lp[act] - np.asarray(traj.rollout_logprobs)[act])
        yield dict(
            bench="long_context", variant=f"parity/{policy}/{'replay' if replay else 'no_replay'}"
            f"/{context}", context=context, kv_option="int8+evict" if parity else "dense",
            policy=policy, dtype="float32", replay=replay, max_abs_dlogp=float(dl.max()),
            mean_abs_dlogp=float(dl.mean()),
            action_tokens=int(act.sum()), tokens=int(traj.valid.sum()),
            int8_tokens=stats.int8_tokens, evicted_tokens=stats.evicted_tokens,
            episode_s=round(secs, 1), trainer_s=round(time.perf_counter() - t0, 1),
        )  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--parity-contexts", default="8192")
    ap.add_argument("--parts", default="kv,decode,parity")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=32, help="tokens per timed decode call")
    ap.add_argument("--obs", type=int, default=480, help="tokens per tool output")
    ap.add_argument(
        "--decode-kv", default="dense,int8+evict",
        help="decode part's KV: dense and/or int8+evict (comma-separated)",
    )  # fmt: skip
    ap.add_argument(
        "--decode-paths",
        default="chunk,kernel",
        help="decode part's paths: chunk (decode_kernel false) and/or kernel (comma-separated)",
    )
    ap.add_argument(
        "--decode-fill", default="prefill",
        help="decode part's starting context: prefill (the model over it) and/or random "
        "(random K/V at a real prefill's magnitudes, no model run; comma-separated)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    for fill in args.decode_fill.split(","):
        if fill not in ("prefill", "random"):
            raise ValueError(f"--decode-fill {fill!r}; allowed: prefill, random")
    if not args.decode_paths or not set(args.decode_paths.split(",")) <= {"chunk", "kernel"}:
        raise ValueError(f"--decode-paths {args.decode_paths!r}; allowed: chunk, kernel")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    model = Transformer(MODEL, get_policy("fp32"))
    params = init_params(model, jax.random.key(0))
    parts = args.parts.split(",")
    stats = None
    if "decode" in parts and "random" in args.decode_fill.split(","):
        stats = kv_stats(model, params)
    for context in (int(c) for c in args.contexts.split(",")):
        decode = functools.partial(decode_lines, stats=stats)
        for part, fn in (("kv", kv_lines), ("decode", decode)):
            if part in parts:
                for line in fn(context, args, params):
                    print(json.dumps({**line, **env_fields()}), flush=True)
    if "parity" in parts:
        for context in (int(c) for c in args.parity_contexts.split(",")):
            for line in parity_lines(context, args, params):
                print(json.dumps({**line, **env_fields()}), flush=True)


if __name__ == "__main__":
    main()
