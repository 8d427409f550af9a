"""What bitwise parity costs in the trainer's teacher-forced pass (one JSON line per measurement).

The RL update recomputes the logprobs of rollout tokens through
``model.chunked.sequence_logprobs``: under a ``*-parity`` policy that is ``chunked_logits``, a
``lax.scan`` of the sampler's chunk function over the paged cache (chunk 4, page 16, capacity
192, like ``rollout.py``'s parity sampler; bitwise the rollout's logprobs), otherwise one plain
full-sequence forward. Two modes:

  logprobs  ``sequence_logprobs`` forward only (the update's no-gradient pre-update pass, and
            ``rollout.parity.trainer_logprobs``'s computation), jitted;
  grad      ``rl.update.make_grad_fn``'s ``grad_fn(params, minibatch)`` (the update's loss, its
            gradient and the stop-gradient logprobs; ``RLConfig()`` defaults: one micro-batch of
            the whole batch, which is the sampler's slot count, so the fused logprobs are
            bitwise the rollout's), jitted; the update adds clipping, AdamW and metrics.

Models are ``common.bench_model``'s, as in ``rollout.py`` (dense / MoE, 4 layers, d_model 256,
4 q / 2 kv heads of dim 64, vocab 1024; patterns ``D`` and ``SSSF``), sequences of 64 + 128 = 192
random tokens with the last 128 as actions. The policies of one (model, pattern, batch, mode)
are compiled first and then timed round-robin (one call of each policy per round), so machine
load hits them alike.

Keys: bench, variant, model, pattern, batch, seq_len, policy, mode, path ('chunked_scan' |
'full_sequence'), chunk (parity only), tokens_per_s (batch * seq_len / median), ms, ms_min,
ms_max (``--reps`` warm calls), compile_s (lower + compile), fast_policy and ratio_vs_fast
(tokens_per_s over that of the same policy without parity; 1.0 on the fast lines, absent when
the fast policy was not run), max_abs_dlogp_vs_fast (logprobs of the parity pass vs the fast
pass, on action tokens), backend, devices, jax_version.

Usage: python benchmarks/teacher_forced.py [--batches 8,32] [--models dense,moe]
       [--patterns D,SSSF] [--policies fp32,fp32-parity,bf16,bf16-parity]
       [--modes logprobs,grad] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import jax
import numpy as np
from common import NEW, PROMPT, Timing, bench_model, env_fields

from agentrl_jax.model.chunked import ChunkSpec, sequence_logprobs
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import RLConfig
from agentrl_jax.rl.update import make_grad_fn, prepare_batch

CHUNK, PAGE = 4, 16  # rollout.py's parity sampler geometry


def make_batch(cfg, batch: int, rng: np.random.Generator) -> dict:
    """A random rollout batch in the update's format (64 prompt + 128 action tokens)."""
    t = PROMPT + NEW
    action = np.zeros((batch, t), bool)
    action[:, PROMPT:] = True
    logp = -np.log(cfg.vocab_size) + 0.1 * rng.normal(size=(batch, t))
    out = {
        "tokens": rng.integers(0, cfg.vocab_size, (batch, t)).astype(np.int32),
        "valid": np.ones((batch, t), bool),
        "action_mask": action,
        "advantages": np.where(action, rng.normal(size=(batch, t)), 0.0).astype(np.float32),
        "rollout_logprobs": np.where(action, logp, 0.0).astype(np.float32),
    }
    if cfg.is_moe:
        k = cfg.experts_per_token
        out["routes"] = rng.integers(0, cfg.n_experts, (batch, t, cfg.n_layers, k)).astype(np.int32)
    return out


def build(cfg, policy_name: str, mode: str, params, batch: dict):
    """(compiled fn, args, compile_s, logp of the call's output) for one policy and mode."""
    policy = get_policy(policy_name)
    model = Transformer(cfg, policy)
    b = batch["tokens"].shape[0]
    spec = ChunkSpec(chunk=CHUNK, page_size=PAGE, max_len=PROMPT + NEW, n_slots=b)
    spec = spec if policy.parity else None
    rl_cfg = RLConfig()
    if mode == "logprobs":

        def fn(params, tokens, valid):
            logp, _, extras = sequence_logprobs(
                model, params, tokens, valid=valid, chunk_spec=spec, with_entropy=False
            )
            return logp, extras.get("routes")

        args = (params, batch["tokens"], batch["valid"])
        logp_of = lambda out: out[0]
    elif mode == "grad":
        grad_fn = make_grad_fn(model, rl_cfg, None, spec)
        rows = prepare_batch(batch, rl_cfg, model)
        rows.pop("rollout_routes", None)  # the update keeps these for mismatch metrics only
        fn = grad_fn
        args = (params, rows)
        logp_of = lambda out: out[2]["logp"]
    else:
        raise ValueError(f"mode={mode!r}; allowed: 'logprobs', 'grad'")
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*args))  # warm
    return compiled, args, compile_s, np.asarray(logp_of(out))


def measure(kind: str, pattern: str, b: int, mode: str, args) -> list[dict]:
    cfg = bench_model(kind, pattern)
    params = init_params(Transformer(cfg, get_policy("fp32")), jax.random.key(0))
    batch = make_batch(cfg, b, np.random.default_rng(0))
    names = args.policies.split(",")
    built = {n: build(cfg, n, mode, params, batch) for n in names}
    times = {n: [] for n in names}
    for _ in range(args.reps):
        for n in names:
            fn, fn_args = built[n][:2]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*fn_args))
            times[n].append((time.perf_counter() - t0) * 1e3)
    mask = batch["action_mask"][:, 1:]
    t = PROMPT + NEW
    lines = {}
    for n in names:
        policy = get_policy(n)
        timing = Timing.from_ms(times[n])
        fast = n.removesuffix("-parity")
        line = dict(
            bench="teacher_forced",
            variant=f"{kind}/{pattern}/b{b}/{n}/{mode}",
            model=kind,
            pattern=pattern,
            batch=b,
            seq_len=t,
            policy=n,
            mode=mode,
            path="chunked_scan" if policy.parity else "full_sequence",
            chunk=CHUNK if policy.parity else None,
            tokens_per_s=b * t / (timing.median_ms / 1e3),
            **timing.fields("ms"),
            reps=args.reps,
            compile_s=built[n][2],
            fast_policy=fast,
        )
        if fast in lines:
            line["ratio_vs_fast"] = line["tokens_per_s"] / lines[fast]["tokens_per_s"]
            d = np.abs(built[n][3] - built[fast][3])[mask]
            line["max_abs_dlogp_vs_fast"] = float(d.max())
        elif fast == n:
            line["ratio_vs_fast"] = 1.0
        line.update(env_fields())
        lines[n] = line
    return list(lines.values())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8")
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--patterns", default="D,SSSF")
    ap.add_argument(
        "--policies",
        default="fp32,fp32-parity,bf16,bf16-parity",
        help="comma list; a parity policy's ratio needs its fast policy listed before it",
    )
    ap.add_argument("--modes", default="logprobs,grad")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise ValueError(f"--reps={args.reps} must be >= 1")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    for kind in args.models.split(","):
        for pattern in args.patterns.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                for mode in args.modes.split(","):
                    for line in measure(kind, pattern, b, mode, args):
                        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
