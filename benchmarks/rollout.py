"""Rollout throughput: jitted prefill + while_loop decode vs a no-cache decoder (JSON lines).

Per model (``common.bench_model``: 4 layers, d_model 256, 4 query heads, 2 KV heads of dim 64,
vocab 1024, tied embeddings, fp32; dense FFN 768; MoE 8 experts top-2, hidden 384), layer pattern
(``D`` all dense, ``SSSF`` hybrid) and batch: prompt 64, 128 new tokens without early stop,
full-vocabulary sampling at temperature 1.

Keys: new_tokens_per_s (generated tokens over prefill + decode time: how other engines and
``benchmarks/vs_peers.sh`` count), tokens_per_s (prompt + generated tokens over the same time),
decode_tokens_per_s, prefill_ms, compile_s,
nocache_tokens_per_s (full forward recomputed every step), speedup_vs_nocache,
kv_bytes_per_seq and kv_bytes_ratio_vs_dense at 8k context (a one-slot sampler cache of 8k
tokens: the pages the allocator holds for 8k tokens x the page bytes of the live buffers, plus
the rings; against the same for an all-``D`` model of the same sizes), pool_waste_pages_per_seq
(shared page pool after the run), policy, chunk, decode_kernel (decode of F/D layers through
``kernels.paged_decode_attention``; non-parity policies only, ``--no-decode-kernel`` measures
the chunk path), load_avg_1m (the 1-minute load average after the timed calls: the machine is
shared, a loaded line is not a quiet one), plus bench/variant/backend/devices/jax_version.

Usage: python benchmarks/rollout.py [--batches 8,32] [--patterns D,SSSF] [--models dense,moe]
       [--policy fp32] [--reps 3] [--no-nocache] [--no-decode-kernel]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from common import NEW, PROMPT, bench_model, env_fields, load_avg, time_ms

from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.kv_cache import KVLayout, PagePool
from agentrl_jax.rollout.sampler import RolloutConfig, Sampler, sample_tokens, token_keys


def nocache_fn(model, cfg: RolloutConfig, batch: int):
    """Decoder without a cache: every step runs the full forward over the whole buffer."""
    total = PROMPT + NEW

    @jax.jit
    def run(params, prompt, rng):
        buf = jnp.zeros((batch, total), jnp.int32).at[:, :PROMPT].set(prompt)

        def body(i, buf):
            logits, _, _ = model.apply(params, buf)
            p = PROMPT + i
            lg = jax.lax.dynamic_index_in_dim(logits, p - 1, axis=1, keepdims=False)
            keys = token_keys(rng, jnp.arange(batch), jnp.full((batch,), p))
            tok, _ = sample_tokens(lg, keys, cfg)
            return jax.lax.dynamic_update_index_in_dim(buf, tok[:, None], p, axis=1)

        return jax.lax.fori_loop(0, NEW, body, buf)

    return run


def kv_bytes_8k(mcfg, policy, page_size: int = 16, n_tokens: int = 8192) -> int:
    """KV bytes one sequence of ``n_tokens`` holds in a sampler cache: its pages in the shared
    pool x the page bytes of the allocated buffers, plus the per-slot rings."""
    cfg = RolloutConfig(max_len=n_tokens, page_size=page_size, chunk=4)
    state = Sampler(Transformer(mcfg, policy), cfg).init_state(1, n_tokens // page_size)
    pool = PagePool(1, n_tokens // page_size, page_size, n_tokens)
    pool.ensure(0, n_tokens)
    layout = KVLayout.from_cache(state.cache, mcfg.layer_pattern)
    return layout.slot_bytes(pool.owned(0))


class Run(NamedTuple):
    """One shape's compiled rollout: ``full()`` (prefill + decode: (tokens, lengths)),
    ``prefill_only()``, the compiled decode call (``decode``, a ``jax.stages.Compiled``), its
    inputs (``params``, ``prompt``, sampling key ``rng``) and what the line reports about it."""

    full: Callable[[], Any]
    prefill_only: Callable[[], Any]
    decode: Any
    compile_s: float
    sampler: Sampler
    params: Any
    prompt: np.ndarray
    rng: jax.Array
    model_cfg: Any
    chunk: int


def build(
    kind: str,
    pattern: str,
    batch: int,
    policy,
    chunk: int,
    decode_kernel: bool,
    rollout: dict | None = None,
) -> Run:
    """The benchmark's rollout of ``batch`` prompts of PROMPT tokens and NEW new ones under
    ``policy`` (a ``DTypePolicy``; parity policies decode in chunks of 4), compiled;
    ``rollout``: further ``RolloutConfig`` fields (e.g. ``transpose_head=False``)."""
    mcfg = bench_model(kind, pattern)
    model = Transformer(mcfg, policy)
    params = init_params(model, jax.random.key(0))
    chunk = 4 if policy.parity else chunk
    cfg = RolloutConfig(
        max_new_tokens=NEW,
        max_len=PROMPT + NEW,
        page_size=16,
        chunk=chunk,
        prefill_chunk=None if policy.parity else PROMPT,
        stop_tokens=(),
        decode_kernel=decode_kernel,
        **(rollout or {}),
    )
    sampler = Sampler(model, cfg)
    rng = jax.random.key(1)
    prompt = np.asarray(jax.random.randint(jax.random.key(2), (batch, PROMPT), 0, 1024))
    n_new = np.full((batch,), PROMPT, np.int32)
    width = sampler.prefill_width(PROMPT)
    toks = np.zeros((batch, width), np.int32)
    toks[:, :PROMPT] = prompt
    uids = np.arange(batch, dtype=np.int32)
    active = np.ones(batch, bool)
    budget = np.full((batch,), NEW, np.int32)

    t0 = time.perf_counter()
    st = sampler.init_state(batch)
    pre = sampler.prefill.lower(params, st, toks, n_new).compile()
    st2, _ = pre(params, sampler.init_state(batch), toks, n_new)
    dec = sampler.decode.lower(params, st2, rng, uids, active, budget, np.int32(batch)).compile()
    compile_s = time.perf_counter() - t0

    def prefill_only():
        return pre(params, sampler.init_state(batch), toks, n_new)[0].logits

    def full():
        s, _ = pre(params, sampler.init_state(batch), toks, n_new)
        s, out = dec(params, s, rng, uids, active, budget, np.int32(batch))
        return out.tokens, s.cache["lengths"]

    return Run(full, prefill_only, dec, compile_s, sampler, params, prompt, rng, mcfg, chunk)


def bench_one(kind, pattern, batch, args):
    policy = get_policy(args.policy)
    full, prefill_only, _, compile_s, sampler, params, prompt, rng, mcfg, chunk = build(
        kind, pattern, batch, policy, args.chunk, args.decode_kernel
    )
    cfg, model = sampler.cfg, sampler.model

    gen, lengths = full()  # warm; the timed calls sample the same tokens
    t = time_ms(full, reps=args.reps, warmup=0)
    t_pre = time_ms(prefill_only, reps=args.reps).median_ms / 1e3
    t_full = t.median_ms / 1e3
    t_dec = max(t_full - t_pre, 1e-9)
    assert_len = int(np.asarray(lengths)[0])
    pool = PagePool(batch, batch * cfg.max_len // cfg.page_size, cfg.page_size, cfg.max_len)
    for b in range(batch):
        pool.ensure(b, assert_len)
    line = dict(
        bench="rollout",
        variant=f"{kind}/{pattern}/b{batch}/{args.policy}"
        + ("/kernel" if sampler.kernel_decode else ""),
        model=kind,
        pattern=pattern,
        batch=batch,
        prompt=PROMPT,
        new_tokens=NEW,
        policy=args.policy,
        chunk=chunk,
        decode_kernel=sampler.kernel_decode,
        new_tokens_per_s=batch * NEW / t_full,
        tokens_per_s=batch * (PROMPT + NEW) / t_full,
        decode_tokens_per_s=batch * NEW / t_dec,
        prefill_ms=1e3 * t_pre,
        **t.fields("total_ms"),
        compile_s=compile_s,
        generated_per_seq=int(np.asarray(gen).shape[1]),
        kv_bytes_per_seq=kv_bytes_8k(mcfg, policy),
        kv_bytes_ratio_vs_dense=kv_bytes_8k(mcfg, policy)
        / kv_bytes_8k(mcfg.replace(layer_pattern="D"), policy),
        pool_waste_pages_per_seq=pool.waste_tokens([assert_len] * batch) / batch / cfg.page_size,
    )
    if args.nocache:
        fn = nocache_fn(model, cfg, batch)
        t0 = time.perf_counter()
        fn = fn.lower(params, prompt, rng).compile()
        line["nocache_compile_s"] = time.perf_counter() - t0
        t_nc = time_ms(lambda: fn(params, prompt, rng), reps=max(1, args.reps // 2))
        line["nocache_tokens_per_s"] = batch * NEW / (t_nc.median_ms / 1e3)
        line["speedup_vs_nocache"] = line["decode_tokens_per_s"] / line["nocache_tokens_per_s"]
    line["load_avg_1m"] = load_avg()
    line.update(env_fields())
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--patterns", default="D,SSSF")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--chunk", type=int, default=1, help="decode chunk of non-parity policies")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-nocache", dest="nocache", action="store_false")
    ap.add_argument("--no-decode-kernel", dest="decode_kernel", action="store_false")
    args = ap.parse_args(argv)
    for kind in args.models.split(","):
        for pattern in args.patterns.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                print(json.dumps(bench_one(kind, pattern, batch, args)), flush=True)


if __name__ == "__main__":
    main()
