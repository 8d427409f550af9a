"""One sampler fast path off and on, in one process (JSON lines).

Each switch names a fast path and the options that turn it off (``SWITCHES``): ``PACK_WEIGHTS``,
the one-row decode's weight matmuls through the skinny-matmul kernel (off: the experiment's
``kernels.decode_matmul='xla'``, a policy field); ``TRANSPOSE_HEAD``, the tied head against its
table transposed once (off: ``RolloutConfig.transpose_head=False``); ``LAST_ROW_LOGITS``, the
prefill's head on each sequence's last row only (off: ``RolloutConfig.last_row_logits=False``).
Per model and batch the benchmark rollout (``rollout.build``: prompt 64, 128 new tokens,
pattern ``D``, fp32) is compiled with the switch off, then on, and the two calls alternate
(``common.time_interleaved``), so a shared machine's drift hits both alike.

Keys: switch, off_ms and on_ms (median call time: prefill + decode), their spread
(``*_min``, ``*_max``), ratio (on over off), same_tokens (both sampled the same tokens), reps,
load_avg_1m, plus the environment fields.

Usage: python benchmarks/rollout_ab.py --switch PACK_WEIGHTS [--models dense,moe]
       [--batches 8,32] [--reps 11]
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from common import env_fields, load_avg, time_interleaved
from rollout import build

from agentrl_jax.precision import get_policy

# switch -> (policy fields, RolloutConfig fields) that turn its fast path off; on: the defaults
SWITCHES = {
    "PACK_WEIGHTS": ({"kernels": {"decode_matmul": "xla"}}, {}),
    "TRANSPOSE_HEAD": ({}, {"transpose_head": False}),
    "LAST_ROW_LOGITS": ({}, {"last_row_logits": False}),
}


def ab_line(switch: str, kind: str, batch: int, reps: int) -> dict:
    """The line of one switch at one model and batch (module docstring)."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r}; one of {tuple(SWITCHES)}")
    policy_off, rollout_off = SWITCHES[switch]
    runs = [
        build(kind, "D", batch, get_policy("fp32", **policy_off), 1, True, rollout_off),
        build(kind, "D", batch, get_policy("fp32"), 1, True),
    ]
    tokens = [np.asarray(jax.device_get(r.full()[0])) for r in runs]
    off, on = time_interleaved([r.full for r in runs], reps=reps)
    line = dict(
        bench="rollout_ab",
        variant=f"{kind}/D/b{batch}/{switch}",
        model=kind,
        batch=batch,
        switch=switch,
        off_ms=off.median_ms,
        off_ms_min=off.min_ms,
        off_ms_max=off.max_ms,
        on_ms=on.median_ms,
        on_ms_min=on.min_ms,
        on_ms_max=on.max_ms,
        ratio=on.median_ms / off.median_ms,
        same_tokens=bool(np.array_equal(tokens[0], tokens[1])),
        reps=reps,
        load_avg_1m=load_avg(),
    )
    line.update(env_fields())
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, choices=tuple(SWITCHES))
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--reps", type=int, default=11)
    a = ap.parse_args(argv)
    for kind in a.models.split(","):
        for batch in (int(x) for x in a.batches.split(",")):
            print(json.dumps(ab_line(a.switch, kind, batch, a.reps)), flush=True)


if __name__ == "__main__":
    main()
