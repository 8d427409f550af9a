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
from common import NEW, env_fields, load_avg, time_ms
from rollout import build

from agentrl_jax.precision import get_policy

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
