"""Where an RL update's time goes: a ``jax.profiler`` trace of ``update.py``'s step (JSON lines).

Per model, attention pattern and policy (``update.py``'s batch of 8 x 192 tokens and RLConfig),
the compiled ``update_fn`` is traced over ``--reps`` calls and the trace's XLA op events of its
module are summed per part of the model (``decode_profile.part_of``, by the op's name scope:
``attention``, ``ffn``, ``lm_head``, ``other``: norms, the loss, AdamW) and per pass: ``bwd``
for ops under the gradient's ``transpose(...)`` scope, ``fwd`` for the rest. Control flow is
left out (its events enclose the ops inside).

Keys: step_ms (median wall time of a call), ``<part>_<pass>_ms`` (op time per call),
ops_over_wall (summed op time over the wall time: XLA's CPU runtime runs independent ops at
once, so parts add up to the op time, not the wall time), eigen_threads ('pool', or 'one' when
``XLA_FLAGS`` holds ``--xla_cpu_multi_thread_eigen=false``: each op then runs on one thread, so
its time is one core's, but independent ops still run at once: ops / wall stays above 1), plus
load_avg_1m and the environment fields.

Usage: [XLA_FLAGS=--xla_cpu_multi_thread_eigen=false] python benchmarks/update_profile.py
       [--variants dense-DDDD,moe-DDDD] [--policy fp32] [--reps 3] [--micro-batch N]
"""

from __future__ import annotations

import argparse
import json
import os
import re

import numpy as np
from common import env_fields, load_avg, time_ms
from decode_profile import named_ops, part_of, trace_op_us
from update import BATCH, build_step

PARTS = ("attention", "ffn", "lm_head", "other")
PASSES = ("fwd", "bwd")


def op_passes(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (model part, pass) from a compiled module's text
    (``decode_profile.named_ops``: control flow left out)."""
    return {
        name: (part_of(op), "bwd" if "transpose(" in op else "fwd")
        for name, op in named_ops(hlo_text)
    }


def eigen_threads(xla_flags: str | None = None) -> str:
    """'one' when ``XLA_FLAGS`` (or ``xla_flags``) turns XLA CPU's multi-threaded Eigen off (the
    last setting of the flag wins, as in XLA's parser), else 'pool'."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    found = re.findall(r"--xla_cpu_multi_thread_eigen=(\w+)", flags)
    return "one" if found and found[-1].lower() in ("false", "0") else "pool"


def profile_line(
    kind: str, pattern: str, reps: int, policy: str = "fp32", micro_batch: int | None = None
) -> dict:
    step = build_step(kind, pattern, policy, np.random.default_rng(0), micro_batch)
    hlo = step.compiled.as_text()
    module = re.search(r"HloModule ([\w.\-]+)", hlo).group(1)
    step()
    step_ms = time_ms(step, reps=reps).median_ms
    per_op = trace_op_us(step, reps, module=module)
    ms = {(p, s): 0.0 for p in PARTS for s in PASSES}
    for name, (part, pass_) in op_passes(hlo).items():
        ms[(part if part in PARTS else "other", pass_)] += per_op.get(name, 0.0) / reps / 1e3
    line = dict(
        bench="update_profile",
        variant=f"{kind}-{pattern}/{policy}" + (f"/micro{micro_batch}" if micro_batch else ""),
        model=kind,
        pattern=pattern,
        policy=policy,
        micro_batch=micro_batch or BATCH,
        step_ms=step_ms,
        **{f"{p}_{s}_ms": ms[(p, s)] for p in PARTS for s in PASSES},
        ops_over_wall=sum(ms.values()) / step_ms,
        eigen_threads=eigen_threads(),
        load_avg_1m=load_avg(),
    )
    line.update(env_fields())
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="dense-DDDD,moe-DDDD", help="comma list of kind-pattern")
    ap.add_argument("--policy", default="fp32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=None, help="update.py --micro-batch")
    a = ap.parse_args(argv)
    for variant in a.variants.split(","):
        kind, pattern = variant.split("-")
        print(json.dumps(profile_line(kind, pattern, a.reps, a.policy, a.micro_batch)), flush=True)


if __name__ == "__main__":
    main()
