"""Rollout-vs-trainer logprob mismatch per dtype policy and KV option (one JSON line each).

A tiny MoE model plays multi-turn code-repair episodes (mixed prompt/turn lengths, continuous
batching); the trainer then recomputes the logprobs of the sampled tokens with
``trainer_logprobs`` (chunked parity pass for ``*-parity`` policies, plain teacher-forced pass
otherwise) and ``agentrl_jax.rl.mismatch.mismatch_metrics`` compares them.

Keys: bench, variant, policy, kv_option ('full' | 'evict' | 'int8': low-attention finished tool
outputs evicted, or moved to int8 in the F layers), replay (recorded KV masks replayed in
training), max_abs_dlogp, mean_abs_dlogp, routing_agreement, n_tokens, evicted_tokens,
int8_tokens, kv_bytes_ratio (KV bytes per cached token: the per-turn ``kv_bytes`` measured on
the live pools, a shared float pool with an int8 pool of its own, summed over turns and divided
by the turns' tokens, over the same of the policy's 'full' run; None when 'full' is not measured
first), decode_kernel (non-parity policies decode through
``kernels.paged_decode_attention`` unless ``--no-decode-kernel``; KV eviction runs keep the chunk
path), backend, devices, jax_version.

Usage: python benchmarks/parity.py [--tasks 6] [--slots 3] [--policies fp32-parity,bf16,...]
       [--no-decode-kernel]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import jax
import numpy as np
from common import env_fields, preset

from agentrl_jax.envs.coderepair import CodeRepairEnv, CodeTokenizer, make_task
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.mismatch import mismatch_metrics
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.kv_cache import EvictionConfig
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler

MODEL = preset("small-moe-sssf", window=16, d_expert=32, init_std=0.1)
FULL_KV: dict[str, float] = {}  # policy -> KV bytes per cached token of its 'full' run


def measure(policy_name, kv_option, args, params, tok, tasks):
    policy = get_policy(policy_name)
    model = Transformer(MODEL, policy)
    cfg = RolloutConfig(
        max_new_tokens=12,
        max_len=256,
        page_size=8,
        chunk=4,
        prefill_chunk=None if policy.parity else 16,
        decode_kernel=args.decode_kernel,
    )
    eviction = None
    if kv_option in ("evict", "int8"):
        eviction = EvictionConfig(threshold=0.5, min_block=4, int8=kv_option == "int8")
    traj = run_episodes(
        model,
        params,
        tasks,
        CodeRepairEnv,
        tok,
        cfg,
        jax.random.key(1),
        n_slots=args.slots,
        max_turns=args.turns,
        n_pages=args.slots * cfg.max_len // cfg.page_size,
        eviction=eviction,
    )
    per_token = sum(r["kv_bytes"] for r in traj.logs) / sum(r["tokens_so_far"] for r in traj.logs)
    if kv_option == "full":
        FULL_KV[policy_name] = per_token
    ratio = per_token / FULL_KV[policy_name] if policy_name in FULL_KV else None
    lines = []
    for replay in (False, True) if eviction is not None else (False,):
        lp, routes = trainer_logprobs(
            model, params, traj, sampling_cfg=cfg, n_slots=args.slots, replay_kv=replay
        )
        m = mismatch_metrics(
            lp,
            traj.rollout_logprobs,
            np.asarray(traj.action_mask),
            routes_train=routes,
            routes_rollout=traj.routes,
        )
        lines.append(
            dict(
                bench="parity",
                variant=f"{policy_name}/{kv_option}/{'replay' if replay else 'no_replay'}",
                policy=policy_name,
                kv_option=kv_option,
                replay=replay,
                decode_kernel=get_sampler(model, cfg).kernel_decode,
                max_abs_dlogp=float(m["max_abs_dlogp"]),
                mean_abs_dlogp=float(m["mean_abs_dlogp"]),
                routing_agreement=float(m["routing_agreement"]),
                n_tokens=int(m["n_tokens"]),
                evicted_tokens=int(
                    0 if traj.kv_keep_mask is None else (~np.asarray(traj.kv_keep_mask)).sum()
                ),
                int8_tokens=int(
                    0 if traj.kv_int8_mask is None else np.asarray(traj.kv_int8_mask).sum()
                ),
                kv_bytes_ratio=ratio,
                model=f"{MODEL.layer_pattern} L{MODEL.n_layers} d{MODEL.d_model} moe",
                **env_fields(),
            )
        )
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--policies", default="fp32-parity,bf16-parity,fp32,bf16")
    ap.add_argument("--kv", default="full,evict,int8")
    ap.add_argument("--no-decode-kernel", dest="decode_kernel", action="store_false")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    tok = CodeTokenizer()
    tasks = [make_task(s, 1 + s % 2) for s in range(args.tasks)]
    params = init_params(Transformer(MODEL, get_policy("fp32")), jax.random.key(0))
    for name in args.policies.split(","):
        for kv in args.kv.split(","):
            if kv != "full" and not get_policy(name).parity:
                continue  # KV replay needs the chunked parity pass
            for line in measure(name, kv, args, params, tok, tasks):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
