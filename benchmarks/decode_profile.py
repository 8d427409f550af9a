"""Where a rollout's time goes: a ``jax.profiler`` trace of the benchmark rollout (JSON lines).

Per model and batch (``rollout.build``: prompt 64, 128 new tokens, pattern ``D``, the policy's
fast path), the compiled call is traced over ``--reps`` calls and the trace's XLA op events of
the decode call are summed per part of the model, by the op's name scope in the compiled HLO
(``op_name`` metadata): ``attention`` (``attn``: projections, the paged decode kernel, the
cache writes), ``ffn`` (``mlp`` / ``moe``), ``lm_head`` (``embed``: the embedding and the tied
unembedding), ``sampling`` (``sample``: the Gumbel draw, the argmax, the logprob) and ``other``
(norms, residuals, the loop's bookkeeping).

Keys: step_us (decode time per step: the call's time less prefill's, over the steps),
prefill_ms, decode_share (of the call), ``<part>_us`` (op time per step), ``<part>_share`` (of
the summed op time; ops of the two threads can overlap, so the parts add up to the ops' time,
not the wall time), ops_over_wall (summed op time over the decode's wall time), plus
load_avg_1m and the environment fields.

The memory floor: every decode step reads all the weights (the MoE's experts run as one
batched matmul over every expert) and each sequence's cached keys and values. weight_mb (the
parameters as stored), kv_mb_per_step (the cached rows of every layer, averaged over the
steps: PROMPT + t + 1 rows at step t), stream_gb_per_s (the fastest read this process gets
from memory: a jitted sum over STREAM_MB of float32, well past the last-level cache, best of
STREAM_REPS), floor_us ((weight + kv) bytes at that rate: a step that only read its operands
once from memory) and step_over_floor (step_us over it).

Usage: python benchmarks/decode_profile.py [--models dense,moe] [--batches 8,32] [--reps 3]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
from common import NEW, PROMPT, env_fields, load_avg, time_ms
from rollout import build

from agentrl_jax.precision import get_policy

STREAM_MB, STREAM_REPS = 256, 10
PARTS = ("attention", "ffn", "lm_head", "sampling", "other")
_SCOPES = (("/sample/", "sampling"), ("/attn/", "attention"), ("/mlp/", "ffn"), ("/moe/", "ffn"),
           ("/embed.", "lm_head"))  # fmt: skip
_OP = re.compile(r"^\s*%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", re.M)


def part_of(op_name: str) -> str:
    """The model part an HLO op's ``op_name`` scope belongs to (module docstring)."""
    for scope, part in _SCOPES:
        if scope in op_name:
            return part
    return "other"


def named_ops(hlo_text: str) -> list[tuple[str, str]]:
    """(HLO instruction name, ``op_name`` scope) of a compiled module's ops. Control flow
    (``while``, ``cond``, ``call``) is left out: its events enclose those of the ops inside."""
    return [
        (name, op)
        for name, op in _OP.findall(hlo_text)
        if not name.startswith(("while", "cond", "call", "closed_call"))
    ]


def op_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> model part, from a compiled module's text (``named_ops``)."""
    return {name: part_of(op) for name, op in named_ops(hlo_text)}


def trace_op_us(fn, reps: int, module: str) -> dict[str, float]:
    """Summed duration (us) per XLA op of HLO module ``module`` over ``reps`` traced calls."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn())
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    out: dict[str, float] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module:
            out[e["name"]] += e["dur"]
    return out


def stream_gb_per_s(mb: int = STREAM_MB, reps: int = STREAM_REPS) -> float:
    """The fastest read from memory this process gets: a jitted sum over ``mb`` MB of float32
    (random, so nothing folds), in GB/s, best of ``reps`` (module docstring)."""
    x = jax.random.normal(jax.random.key(0), (mb * 2**18,), jnp.float32)
    total = jax.jit(jnp.sum)
    best = time_ms(lambda: total(x), reps=reps).min_ms
    return x.nbytes / (best / 1e3) / 1e9


def kv_bytes_per_token(cache) -> float:
    """Bytes of keys and values one cached token holds over all layers: each pool leaf is
    [groups, pages, page_size, ...]."""
    return sum(
        leaf.nbytes / (leaf.shape[1] * leaf.shape[2])
        for leaf in jax.tree_util.tree_leaves(cache["layers"])
    )


def memory_floor(run, batch: int, step_us: float, stream: float) -> dict:
    """The memory-floor keys of a line (module docstring)."""
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(run.params))
    rows = PROMPT + (NEW + 1) / 2  # mean of PROMPT + t + 1 over t < NEW
    kv = batch * rows * kv_bytes_per_token(run.sampler.init_state(batch).cache)
    floor_us = (weights + kv) / (stream * 1e3)
    return dict(
        weight_mb=weights / 1e6,
        kv_mb_per_step=kv / 1e6,
        stream_gb_per_s=stream,
        floor_us=floor_us,
        step_over_floor=step_us / floor_us,
    )


def profile_line(kind: str, batch: int, reps: int, policy: str = "fp32") -> dict:
    run = build(kind, "D", batch, get_policy(policy), 1, True)
    hlo = run.decode.as_text()
    parts = op_parts(hlo)
    jax.block_until_ready(run.full())
    t_full = time_ms(run.full, reps=reps).median_ms
    t_pre = time_ms(run.prefill_only, reps=reps).median_ms
    per_op = trace_op_us(run.full, reps, module="jit__decode")
    by_part = dict.fromkeys(PARTS, 0.0)
    for name, us in per_op.items():
        if name in parts:
            by_part[parts[name]] += us / reps / NEW
    total = sum(by_part.values())
    step_us = 1e3 * (t_full - t_pre) / NEW
    line = dict(
        bench="decode_profile",
        variant=f"{kind}/D/b{batch}/{policy}",
        model=kind,
        batch=batch,
        policy=policy,
        step_us=step_us,
        prefill_ms=t_pre,
        decode_share=(t_full - t_pre) / t_full,
        **{f"{p}_us": by_part[p] for p in PARTS},
        **{f"{p}_share": by_part[p] / total for p in PARTS},
        ops_over_wall=total / step_us,
        **memory_floor(run, batch, step_us, stream_gb_per_s()),
        load_avg_1m=load_avg(),
    )
    line.update(env_fields())
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    for kind in a.models.split(","):
        for batch in (int(x) for x in a.batches.split(",")):
            print(json.dumps(profile_line(kind, batch, a.reps, a.policy)), flush=True)


if __name__ == "__main__":
    main()
