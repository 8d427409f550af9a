"""Compile time vs depth: the layer-pattern group is scanned, so depth must not cost compile time.

Prints one JSON line: compile seconds of the jitted training gradient (forward + backward) for
4, 32 and 96 layers of a tiny SSSF config (MoE on), and ``ratio_96_vs_4`` (goal <= 1.5); wall
seconds (``compile_s_*``) and the compiling process's CPU seconds (``compile_cpu_s_*``, which
other load on a shared machine does not inflate).
Parameters are abstract (``jax.eval_shape``): nothing is allocated or run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
from common import env_fields, preset
from flax import linen as nn

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, token_logprobs
from agentrl_jax.precision import get_policy


def compile_seconds(cfg: ModelConfig, policy, batch: int, seq: int, reps: int) -> list[float]:
    model = Transformer(cfg, policy)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = nn.unbox(boxed)

    def loss(p, t):
        logits, _, extras = model.apply(p, t)
        return -jnp.mean(token_logprobs(logits[:, :-1], t[:, 1:])) + extras.get("aux_loss", 0.0)

    times, cpu = [], []
    for _ in range(reps):
        fn = jax.jit(jax.grad(loss))  # a fresh function: no in-memory cache hit
        t0, c0 = time.perf_counter(), time.process_time()
        fn.lower(params, tokens).compile()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--depths", default="4,32,96")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--policy", default="bf16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    jax.config.update("jax_enable_compilation_cache", False)
    policy = get_policy(args.policy)
    base = preset("small-moe-sssf", capacity_factor=1.25)
    out = {"bench": "compile_depth", "variant": f"tiny-SSSF-moe-{args.policy}-grad"}
    for depth in [int(d) for d in args.depths.split(",")]:
        t, cpu = compile_seconds(
            base.replace(n_layers=depth), policy, batch=2, seq=64, reps=args.reps
        )
        t.sort()
        cpu.sort()
        out[f"compile_s_{depth}"] = round(t[len(t) // 2], 3)
        # CPU seconds of the compiling process: robust to other load on a shared machine
        out[f"compile_cpu_s_{depth}"] = round(cpu[len(cpu) // 2], 3)
        logging.info("depth %d: wall %s cpu %s", depth, t, cpu)
    depths = [int(d) for d in args.depths.split(",")]
    out[f"ratio_{depths[-1]}_vs_{depths[0]}"] = round(
        out[f"compile_s_{depths[-1]}"] / out[f"compile_s_{depths[0]}"], 3
    )
    out[f"ratio_cpu_{depths[-1]}_vs_{depths[0]}"] = round(
        out[f"compile_cpu_s_{depths[-1]}"] / out[f"compile_cpu_s_{depths[0]}"], 3
    )
    out.update(env_fields())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
