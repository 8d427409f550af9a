"""RL update step and one full RL iteration on the tiny dense / MoE configs (one JSON line each).

Configs (``common.bench_model``, those of the rollout benchmark): 4 layers, d_model 256, 4 query
heads and 2 KV heads of dim 64, vocab 1024, tied embeddings, fp32; dense FFN 768; MoE 8 experts
top-2 of hidden 384 with capacity_factor 1.25 (each expert computes only the tokens routed to it,
up to capacity); attention patterns 'DDDD' and 'SSSF'. Batch 8 x 192 tokens (64 prompt + 128
action tokens).

Per line:
  step_ms, step_ms_min, step_ms_max  one ``update_fn`` call (pre-update logprob recompute,
                                     loss, gradients, AdamW), median of ``--reps`` warm calls
  tokens_per_s                       8 * 192 / step time
  compile_s                          lower + compile of ``update_fn``
  rl_iteration_ms                    rollout of 8 episodes (64-token prompt prefill + 128 new
                                     tokens with the jitted sampler, no early stop) + batch
                                     assembly + update_fn (which recomputes the logprobs);
                                     median of ``--iter-reps``; also rollout_ms and
                                     rollout_compile_s
``--policy bf16`` runs the step under the bf16 mixed-precision policy (fp32 master params and
AdamW, bf16 matmul inputs with fp32 accumulation; the default experiment's policy) instead of
fp32; ``update_baseline.py --dtype bf16`` is its PyTorch counterpart (CPU autocast).

``--micro-batch N`` accumulates the gradient over micro-batches of N sequences
(``RLConfig.micro_batch``; the same gradient up to float rounding); a comma list (``8,4,2``)
builds a step per size and times them in rounds in one process, each line then with
``ratio_vs_first`` (its median over the first size's). On XLA's CPU backend micro-batches of
2-4 sequences run faster than the whole batch at once (docs/results.md);
``update_baseline.py --micro-batch`` is PyTorch's counterpart.

``--expert-matmul per-expert,batched`` (MoE variants) builds the step with each form of the
expert matmuls (``model.expert_matmul``: ``per-expert``, the default, runs bf16 expert matmuls
on the CPU backend as one 2-D matmul per expert; ``batched`` as one batched einsum, i.e.
``PER_EXPERT_MAX = 0``); with several forms or micro-batch sizes every pair is timed in rounds
in one process. Each MoE line has ``expert_matmul``, the form that ran (``batched`` wherever
``expert_matmul.per_expert_matmuls`` does not hold, e.g. fp32).

Usage: python benchmarks/update.py [--reps 5] [--iter-reps 3] [--only dense-DDDD,moe-SSSF]
       [--iteration moe-SSSF | all | none] [--policy fp32 | bf16] [--micro-batch N[,N...]]
       [--expert-matmul per-expert[,batched]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import NEW, PROMPT, bench_model, env_fields, time_interleaved, time_ms

from agentrl_jax.model import expert_matmul as expert_mm
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy, policy_names
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import make_update_fn
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler

BATCH = 8


def model_config(kind: str, pattern: str) -> ModelConfig:
    """The benchmark model; the MoE computes each expert's tokens up to capacity 1.25."""
    return bench_model(kind, pattern, **({"capacity_factor": 1.25} if kind == "moe" else {}))


def make_batch(cfg: ModelConfig, rng: np.random.Generator, tokens=None, logp=None, routes=None):
    t = PROMPT + NEW
    if tokens is None:
        tokens = rng.integers(0, cfg.vocab_size, (BATCH, t))
    action = np.zeros((BATCH, t), bool)
    action[:, PROMPT:] = True
    if logp is None:
        logp = np.where(action, -np.log(cfg.vocab_size) + 0.1 * rng.normal(size=(BATCH, t)), 0.0)
    batch = {
        "tokens": np.asarray(tokens, np.int32),
        "valid": np.ones((BATCH, t), bool),
        "action_mask": action,
        "advantages": np.where(action, rng.normal(size=(BATCH, t)), 0.0).astype(np.float32),
        "rollout_logprobs": np.asarray(logp, np.float32),
    }
    if cfg.is_moe:
        if routes is None:
            routes = rng.integers(0, cfg.n_experts, (BATCH, t, cfg.n_layers, 2))
        batch["routes"] = np.asarray(routes, np.int32)
    return batch


def rollout(sampler, params, prompts, rng_key):
    """Prefill 64-token prompts and decode 128 tokens for 8 slots -> numpy trajectory arrays."""
    state = sampler.init_state(BATCH)
    width = sampler.prefill_width(PROMPT)
    toks = np.zeros((BATCH, width), np.int32)
    toks[:, :PROMPT] = prompts
    n_new = jnp.full((BATCH,), PROMPT, jnp.int32)
    state, routes_p = sampler.prefill(params, state, jnp.asarray(toks), n_new)
    uids = jnp.arange(BATCH, dtype=jnp.int32)
    active = jnp.ones((BATCH,), bool)
    budget = jnp.full((BATCH,), NEW, jnp.int32)
    state, out = sampler.decode(params, state, rng_key, uids, active, budget, jnp.int32(BATCH))
    tokens = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    logp = np.concatenate([np.zeros((BATCH, PROMPT), np.float32), np.asarray(out.logprobs)], 1)
    routes = None
    if out.routes is not None:
        routes = np.concatenate([np.asarray(routes_p)[:, :PROMPT], np.asarray(out.routes)], 1)
    return tokens, logp, routes


@dataclasses.dataclass
class Step:
    """The benchmark's ``update_fn`` compiled on a random batch of ``model``; a call runs one
    step on ``batch`` (default the random one), carries the state and returns the metrics once
    they are ready (``state.params`` the current parameters)."""

    model: Transformer
    params: dict  # the initial parameters (the state holds a copy)
    batch: dict
    compiled: Any
    compile_s: float
    state: Any
    key: jax.Array

    def __call__(self, batch=None):
        self.state, m = self.compiled(self.state, self.batch if batch is None else batch, self.key)
        jax.block_until_ready(m["loss"])
        return m


# form -> expert_matmul.PER_EXPERT_MAX while the step is traced
EXPERT_MATMULS = {"per-expert": expert_mm.PER_EXPERT_MAX, "batched": 0}


def build_step(
    kind: str,
    pattern: str,
    policy: str,
    rng: np.random.Generator,
    micro_batch: int | None = None,
    expert_matmul: str = "per-expert",
) -> Step:
    """``update.py``'s model, batch (drawn from ``rng``), RLConfig (``micro_batch`` sequences
    per gradient-accumulation micro-batch; None: the whole batch at once) and compiled step,
    its MoE expert matmuls in the form ``expert_matmul`` (``EXPERT_MATMULS``)."""
    cfg = model_config(kind, pattern)
    model = Transformer(cfg, get_policy(policy))
    params = init_params(model, jax.random.key(0))
    rl_cfg = RLConfig(lr=1e-5, micro_batch=micro_batch)
    batch = make_batch(cfg, rng)
    state = init_train_state(jax.tree.map(jnp.copy, params), rl_cfg, jax.random.key(1))
    key = jax.random.key(2)
    t0 = time.perf_counter()
    default = expert_mm.PER_EXPERT_MAX
    expert_mm.PER_EXPERT_MAX = EXPERT_MATMULS[expert_matmul]
    try:  # read when the step is traced
        compiled = make_update_fn(model, rl_cfg).lower(state, batch, key).compile()
    finally:
        expert_mm.PER_EXPERT_MAX = default
    return Step(model, params, batch, compiled, time.perf_counter() - t0, state, key)


def measure(kind: str, pattern: str, args) -> list[dict]:
    """One line per (expert-matmul form, micro-batch size) of ``args`` (dense models: the first
    form only); several are timed in rounds in one process (``common.time_interleaved``) and
    carry ``ratio_vs_first``."""
    rng = np.random.default_rng(0)
    forms = args.expert_matmul if kind == "moe" else args.expert_matmul[:1]
    configs = [(m, e) for e in forms for m in args.micro_batch]
    # every config gets the same batch (the first draws it from rng, as a single one does)
    steps = [
        build_step(kind, pattern, args.policy, rng if i == 0 else np.random.default_rng(0), m, e)
        for i, (m, e) in enumerate(configs)
    ]
    metrics = [step() for step in steps]  # warm
    timings = time_interleaved(steps, reps=args.reps, warmup=0)
    lines = []
    for (m, e), step, st, met in zip(configs, steps, timings, metrics):
        lines.append({
            "bench": "update",
            "variant": f"{kind}-{pattern}",
            "model": kind,
            "pattern": pattern,
            "policy": step.model.policy.name,
            "batch": BATCH,
            "micro_batch": m or BATCH,
            "seq_len": PROMPT + NEW,
            **st.fields("step_ms", digits=2),
            "tokens_per_s": round(BATCH * (PROMPT + NEW) / (st.median_ms / 1e3), 1),
            "compile_s": round(step.compile_s, 2),
            "loss_finite": bool(np.isfinite(float(met["loss"]))),
        })  # fmt: skip
        if kind == "moe":  # the form that ran: per-expert only where moe uses it (bf16 on CPU)
            per_expert = e == "per-expert" and expert_mm.per_expert_matmuls(
                step.model.policy, step.model.cfg.n_experts
            )
            lines[-1]["expert_matmul"] = "per-expert" if per_expert else "batched"
        if len(steps) > 1:
            lines[-1]["ratio_vs_first"] = round(st.median_ms / timings[0].median_ms, 3)
            lines[-1]["interleaved_micro_batches"] = [m or BATCH for m in args.micro_batch]
            if len(forms) > 1:
                lines[-1]["interleaved_expert_matmuls"] = forms
    step, line = steps[0], lines[0]
    model, params, cfg, key = step.model, step.params, step.model.cfg, step.key

    if args.iteration == "all" or f"{kind}-{pattern}" in args.iteration.split(","):
        scfg = RolloutConfig(max_new_tokens=NEW, chunk=4, page_size=16, max_len=256)
        sampler = get_sampler(model, scfg)
        prompts = rng.integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
        t0 = time.perf_counter()
        rollout(sampler, params, prompts, jax.random.key(3))  # compile + warm
        line["rollout_compile_s"] = round(time.perf_counter() - t0, 2)

        rollout_times = []

        def iteration():
            t0 = time.perf_counter()
            toks, logp, routes = rollout(sampler, step.state.params, prompts, key)
            rollout_times.append((time.perf_counter() - t0) * 1e3)
            step(make_batch(cfg, rng, toks, logp, routes))

        it = time_ms(iteration, reps=args.iter_reps, warmup=0, sync=lambda _: None)
        line["rollout_ms"] = round(statistics.median(rollout_times), 2)
        line |= {
            **it.fields("rl_iteration_ms", digits=2),
            "rollout_variant": "rollout.sampler prefill+decode (chunk 4), no early stop",
        }
    return [ln | env_fields() for ln in lines]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iter-reps", type=int, default=3)
    parser.add_argument("--policy", default="fp32", choices=policy_names())
    parser.add_argument(
        "--micro-batch",
        default=str(BATCH),
        help="RLConfig.micro_batch: sequences per gradient-accumulation micro-batch "
        f"(divides {BATCH}; default the whole batch); a comma list times each size in rounds "
        "in one process",
    )
    parser.add_argument(
        "--expert-matmul",
        default="per-expert",
        help="MoE expert matmul forms, comma list of per-expert, batched; several are timed in "
        "rounds in one process",
    )
    parser.add_argument("--only", default="", help="comma list of kind-pattern, e.g. moe-SSSF")
    parser.add_argument(
        "--iteration",
        default="moe-SSSF",
        help="variants that also time a full RL iteration: comma list, 'all' or 'none' "
        "(each costs a sampler compile; the default keeps the run near 5 CPU minutes)",
    )
    args = parser.parse_args(argv)
    try:
        micro = [int(m) for m in args.micro_batch.split(",")]
    except ValueError:
        micro = [0]
    if any(m < 1 or BATCH % m for m in micro):
        parser.error(f"--micro-batch {args.micro_batch}: each must divide the batch of {BATCH}")
    args.micro_batch = [None if m == BATCH else m for m in micro]
    args.expert_matmul = args.expert_matmul.split(",")
    if unknown := sorted(set(args.expert_matmul) - set(EXPERT_MATMULS)):
        parser.error(f"--expert-matmul {unknown}: known forms are {sorted(EXPERT_MATMULS)}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    variants = [(k, p) for k in ("dense", "moe") for p in ("DDDD", "SSSF")]
    if args.only:
        keep = set(args.only.split(","))
        variants = [(k, p) for k, p in variants if f"{k}-{p}" in keep]
    for kind, pattern in variants:
        for line in measure(kind, pattern, args):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
