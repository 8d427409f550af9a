"""The paged decode kernel's implementations side by side on CPU (JSON lines): XLA's (each call's
pages gathered into a copy, then multiplied) against the C++ kernel (``impl='cpu'``, pages read
in place: ``kernels/paged_decode_cpu.py``). Each pair is built in one process, checked to sample
the same tokens, and timed in alternation, round by round, so load that drifts during the
measurement falls on both alike.

Rows (``variant``):
  * ``rollout/<model>/b<batch>``: ``rollout.py``'s rollout (pattern D, prompt 64 + 128 new
    tokens, fp32, one row per decode step through the kernel): ``xla_new_tokens_per_s``,
    ``cpu_new_tokens_per_s`` and ``speedup_cpu_vs_xla`` (median of ``--reps`` prefill + decode
    calls each).
  * ``sparse/<context>``: ``long_context.py``'s one-slot decode (random fill, ``--new`` tokens
    per call, dense KV) through the kernel, the F layer's masked read and its gathered read:
    ``{xla,cpu}_{masked,gather}_tokens_per_s``, ``speedup_cpu_vs_xla_{masked,gather}`` and
    each impl's ``sparse_speedup_vs_dense`` (``xla_sparse_vs_dense``, ``cpu_sparse_vs_dense``).
``same_tokens``: both impls sampled the same tokens.

Usage: python benchmarks/decode_impls.py [--models dense,moe] [--batches 8,32]
       [--contexts 32768] [--reps 7] [--new 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import jax
import long_context
import numpy as np
import rollout
from agentrl_jax.kernels import paged_decode_cpu
from common import NEW, Timing, env_fields, load_avg

from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.sampler import Sampler

IMPLS = {"xla": "xla", "cpu": "auto"}  # the policy's kernel_impl for each; auto -> the C++ one


def policy(impl: str):
    return dataclasses.replace(get_policy("fp32"), kernel_impl=IMPLS[impl])


def rollout_line(kind: str, batch: int, reps: int) -> dict:
    runs = {i: rollout.build(kind, "D", batch, policy(i), 1, True) for i in IMPLS}
    tokens = {i: np.asarray(r.full()[0]) for i, r in runs.items()}  # also the warm-up call
    times = {i: [] for i in IMPLS}
    for _ in range(reps):
        for i, r in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(r.full())
            times[i].append((time.perf_counter() - t0) * 1e3)
    rate = {i: batch * NEW / (Timing.from_ms(t).median_ms / 1e3) for i, t in times.items()}
    line = dict(
        bench="decode_impls", variant=f"rollout/{kind}/b{batch}", model=kind, batch=batch,
        same_tokens=bool(np.array_equal(tokens["xla"], tokens["cpu"])),
        speedup_cpu_vs_xla=round(rate["cpu"] / rate["xla"], 3), reps=reps,
    )  # fmt: skip
    for i, t in times.items():
        line[f"{i}_new_tokens_per_s"] = round(rate[i], 1)
        line.update(Timing.from_ms(t).fields(f"{i}_total_ms"))
    return line


def sparse_line(context: int, reps: int, n_new: int) -> dict:
    model = Transformer(long_context.MODEL, get_policy("fp32"))
    params = init_params(model, jax.random.key(0))
    stats = long_context.kv_stats(model, params)
    n = context - (reps + 1) * n_new
    runs = {}
    for mode in ("masked", "gather"):
        start = None
        for i in IMPLS:
            m = Transformer(long_context.MODEL.replace(sparse_gather=mode == "gather"), policy(i))
            cfg = long_context.sampling(context, decode_kernel=True, stop_tokens=(-1,))
            sampler = Sampler(m, cfg)
            if start is None:  # one start state per mode; each impl decodes from a copy
                start = long_context.decode_start(sampler, params, n, "dense", "random", 480,
                                                  stats)[0]  # fmt: skip
            runs[i, mode] = sampler, start
    tokens = {}
    args = (jax.random.key(2), np.zeros(1, np.int32), np.ones(1, bool))
    for key, (sampler, st) in runs.items():
        copy = jax.tree.map(lambda a: a.copy(), st)
        tokens[key] = np.asarray(sampler.decode(params, copy, *args, np.full(1, n_new, np.int32),
                                                np.int32(1))[1].tokens)  # fmt: skip
    timings = long_context.decode_rates(runs, params, n_new, reps)
    rate = {k: n_new / (t.median_ms / 1e3) for k, t in timings.items()}
    line = dict(
        bench="decode_impls", variant=f"sparse/{context}", context=context, new_tokens=n_new,
        same_tokens=all(np.array_equal(tokens["xla", m], tokens["cpu", m])
                        for m in ("masked", "gather")), reps=reps,
    )  # fmt: skip
    for (i, mode), r in rate.items():
        line[f"{i}_{mode}_tokens_per_s"] = round(r, 1)
    for mode in ("masked", "gather"):
        line[f"speedup_cpu_vs_xla_{mode}"] = round(rate["cpu", mode] / rate["xla", mode], 3)
    for i in IMPLS:
        line[f"{i}_sparse_vs_dense"] = round(rate[i, "gather"] / rate[i, "masked"], 3)
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--contexts", default="32768", help="sparse rows ('' for none)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--new", type=int, default=32, help="tokens per timed sparse decode call")
    args = ap.parse_args(argv)
    if jax.default_backend() != "cpu" or not paged_decode_cpu.available():
        why = paged_decode_cpu.unavailable_reason() or f"backend {jax.default_backend()}"
        raise SystemExit(f"decode_impls.py compares the C++ kernel on CPU: unavailable ({why})")
    jobs = [
        functools.partial(rollout_line, m, int(b), args.reps)
        for m in args.models.split(",")
        if m
        for b in args.batches.split(",")
    ]
    jobs += [functools.partial(sparse_line, int(c), args.reps, args.new)
             for c in args.contexts.split(",") if c]  # fmt: skip
    for job in jobs:
        print(json.dumps({**job(), "load_avg_1m": load_avg(), **env_fields()}), flush=True)


if __name__ == "__main__":
    main()
