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
    (``decode_kernel`` true); ``sparse_speedup_vs_dense`` = gather / masked on the same path.
    ``--decode-kv``: ``dense`` (no compression) and/or ``int8+evict``: the prefilled context's
    middle (after the prompt, before the last ``2 * --obs`` tokens) in spans of ``--obs``
    tokens, alternately moved to int8 pages (the int8 pool, ``int8_tables``), evicted, and
    kept in float pages (recorded decisions taking effect at the span's end, no mass
    tracking), so the kernel path reads two pools merged by log-sum-exp with a key mask.
  * ``parity``: ``--parity-contexts``: one episode under ``fp32-parity`` with the gather model,
    int8 + eviction and recorded blocks; ``max_abs_dlogp`` of the trainer's chunked pass against
    the rollout's logprobs (action tokens), replaying the KV masks and the blocks
    (``replay`` true) or the KV masks only (false). And one episode under ``fp32`` (decode
    kernel over the gathered blocks, no compression: a non-parity policy cannot replay KV
    masks) against the trainer's teacher-forced pass with and without the recorded blocks.

Usage: python benchmarks/long_context.py [--contexts 8192,32768] [--parts kv,decode,parity]
       [--reps 5] [--parity-contexts 8192] [--decode-kv dense,int8+evict]
"""

from __future__ import annotations

import argparse
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


def decode_rate(sampler, params, state, n_new, reps):
    """Median decode rate of one slot over ``reps`` calls of ``n_new`` tokens each."""
    args = (jax.random.key(2), np.zeros(1, np.int32), np.ones(1, bool))
    budget, times = np.full(1, n_new, np.int32), []
    for i in range(reps + 1):  # the first call compiles
        t0 = time.perf_counter()
        state, out = sampler.decode(params, state, *args, budget, np.int32(1))
        jax.block_until_ready(out.tokens)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing.from_ms(times)


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
    return state, int(np.sum(int8_at < n)), int(np.sum(evict_at < n))


def decode_lines(context, args, params):
    for kv in args.decode_kv.split(","):
        if kv not in ("dense", "int8+evict"):
            raise ValueError(f"--decode-kv {kv!r}; allowed: dense, int8+evict")
        yield from _decode_lines(context, args, params, kv)


def _decode_lines(context, args, params, kv):
    rates, counts = {}, {}
    for mode, gather in (("masked", False), ("gather", True)):
        model = Transformer(MODEL.replace(sparse_gather=gather), get_policy("fp32"))
        for kernel in (False, True):
            cfg = sampling(context, decode_kernel=kernel, stop_tokens=(-1,))
            sampler = Sampler(model, cfg)
            if not kernel:  # prefill once per model; the kernel path decodes from a copy
                n = context - (args.reps + 1) * args.new
                if kv == "dense":
                    state = sampler.init_state(1)
                else:
                    state, *int8_evicted = compressed_state(sampler, n, args.obs)
                    counts = dict(zip(("int8_tokens", "evicted_tokens"), int8_evicted))
                toks = np.asarray(jax.random.randint(jax.random.key(3), (1, n), 20, 400))
                t0 = time.perf_counter()
                state, _ = sampler.prefill(params, state, toks, np.full(1, n, np.int32))
                jax.block_until_ready(state.logits)
                prefill_s = time.perf_counter() - t0
            start = jax.tree.map(lambda a: a.copy(), state)
            t = decode_rate(sampler, params, start, args.new, args.reps)
            rates[mode, kernel] = args.new / (t.median_ms / 1e3)
            kv_tag = "" if kv == "dense" else f"{kv}/"
            line = dict(
                bench="long_context", variant=f"decode/{kv_tag}{mode}/"
                f"{'kernel' if kernel else 'chunk'}/{context}", context=context, kv_option=kv,
                policy="fp32", dtype="float32", sparse_read=mode, decode_kernel=kernel,
                uses_decode_kernel=sampler.uses_decode_kernel(state), **counts,
                decode_tokens_per_s=round(rates[mode, kernel], 2), **t.fields("decode_ms"),
                new_tokens=args.new, topk_tokens=MODEL.sparse_topk_tokens,
                block_size=MODEL.sparse_block_size, prefill_s=round(prefill_s, 1),
            )  # fmt: skip
            if mode == "gather":
                line["sparse_speedup_vs_dense"] = round(
                    rates[mode, kernel] / rates["masked", kernel], 3
                )
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
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    params = init_params(Transformer(MODEL, get_policy("fp32")), jax.random.key(0))
    parts = args.parts.split(",")
    for context in (int(c) for c in args.contexts.split(",")):
        for part, fn in (("kv", kv_lines), ("decode", decode_lines)):
            if part in parts:
                for line in fn(context, args, params):
                    print(json.dumps({**line, **env_fields()}), flush=True)
    if "parity" in parts:
        for context in (int(c) for c in args.parity_contexts.split(",")):
            for line in parity_lines(context, args, params):
                print(json.dumps({**line, **env_fields()}), flush=True)


if __name__ == "__main__":
    main()
