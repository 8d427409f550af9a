"""RL update step of a ~1B-parameter config of the guide's architecture, with its MFU.

Model (``--size 1b``): narrow and deep, d_model 1536, 36 layers, 12 query heads / 3 kv heads
of 128 (GQA 4:1), SwiGLU FFN 4096, vocab 32768, tied embeddings, RoPE; pattern ``SSSF`` (gated
sliding-window layers, window 1024, and sparse GQA full layers, 8-token blocks, top 1024 tokens)
or ``DDDD`` (dense causal everywhere: the layout ``update_1b_torch.py`` builds in PyTorch).
~0.95B parameters. Step: ``rl.update.make_update_fn`` (logprob recompute, PPO loss, grads,
clip, AdamW) under the bf16 policy, batch 8 x 4096 tokens, ``remat='full'``.

MFU = model FLOPs / step time / the card's dense bf16 peak: 6 x non-embedding parameters x
tokens + the logits' 6 x d_model x vocab per token + attention's 3 x 4 x heads x head_dim x
(visible keys) per token and layer (causal: (t+1) per query; window: min(t+1, window); sparse:
the selected tokens, own block partial); rematerialisation's extra forward is not counted.

``--size tiny`` (the default on CPU) runs the same code on a 4-layer width-64 model.
One JSON line per pattern; imports jax, flax, optax and the package (not grain).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time

import jax
import numpy as np

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import make_update_fn

SIZES = {
    "1b": dict(
        model=dict(
            vocab_size=32768,
            d_model=1536,
            n_layers=36,
            n_heads=12,
            n_kv_heads=3,
            head_dim=128,
            d_ff=4096,
            window=1024,
            sparse_block_size=8,
            sparse_topk_tokens=1024,
            tie_embeddings=True,
            remat="full",
        ),
        batch=8,
        seq=4096,
        prompt=1024,
    ),
    "tiny": dict(
        model=dict(
            vocab_size=512,
            d_model=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=1,
            head_dim=16,
            d_ff=128,
            window=32,
            sparse_block_size=8,
            sparse_topk_tokens=32,
            tie_embeddings=True,
            remat="full",
        ),
        batch=2,
        seq=128,
        prompt=32,
    ),
}
# Dense bf16 peak FLOP/s by device kind (vendor datasheets, SXM parts).
PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def model_flops(cfg: ModelConfig, params, batch: int, seq: int) -> float:
    """Training FLOPs of one step (forward + backward, no remat) by the formula above."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    n_embed = sum(x.size for p, x in leaves if "embed" in jax.tree_util.keystr(p))
    n_dense = sum(x.size for _, x in leaves) - n_embed
    t = np.arange(seq)
    keys = {
        "D": (t + 1).sum(),
        "S": np.minimum(t + 1, cfg.window).sum(),
        "F": np.minimum(t + 1, cfg.sparse_topk_tokens).sum(),
    }
    per_group = sum(keys[k] for k in cfg.layer_pattern)
    attn = 3 * 4 * cfg.n_heads * cfg.head_dim * per_group * cfg.n_layers / len(cfg.layer_pattern)
    tokens = batch * seq
    return float(6 * n_dense * tokens + 6 * cfg.d_model * cfg.vocab_size * tokens + attn * batch)


def make_batch(cfg, rng, batch, seq, prompt):
    action = np.zeros((batch, seq), bool)
    action[:, prompt:] = True
    logp = np.where(action, -np.log(cfg.vocab_size) + 0.1 * rng.normal(size=(batch, seq)), 0.0)
    return {
        "tokens": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
        "valid": np.ones((batch, seq), bool),
        "action_mask": action,
        "advantages": np.where(action, rng.normal(size=(batch, seq)), 0.0).astype(np.float32),
        "rollout_logprobs": logp.astype(np.float32),
    }


def measure(pattern: str, args) -> dict:
    size = SIZES[args.size]
    batch, seq = args.batch or size["batch"], args.seq or size["seq"]
    cfg = ModelConfig(layer_pattern=pattern, **size["model"])
    policy = get_policy(args.policy)
    model = Transformer(cfg, policy)
    params = init_params(model, jax.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rl_cfg = RLConfig(lr=1e-5)
    b = make_batch(cfg, np.random.default_rng(0), batch, seq, min(size["prompt"], seq // 2))
    update = make_update_fn(model, rl_cfg)
    state = init_train_state(params, rl_cfg, jax.random.key(1))
    key = jax.random.key(2)
    t0 = time.perf_counter()
    compiled = update.lower(state, b, key).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def step():
        holder["state"], m = compiled(holder["state"], b, key)
        return float(jax.block_until_ready(m["loss"]))

    loss = step()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    step_ms = statistics.median(times)
    flops = model_flops(cfg, params, batch, seq)
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK.items() if k in kind), None)
    achieved = flops / (step_ms * 1e-3)
    return {
        "bench": "update_1b",
        "variant": f"{args.size}-{pattern}",
        "size": args.size,
        "pattern": pattern,
        "policy": policy.name,
        "params": int(n_params),
        "batch": batch,
        "seq_len": seq,
        "step_ms": round(step_ms, 2),
        "step_ms_min": round(min(times), 2),
        "step_ms_max": round(max(times), 2),
        "tokens_per_s": round(batch * seq / (step_ms * 1e-3), 1),
        "model_tflops_per_step": round(flops / 1e12, 3),
        "model_tflops_per_s": round(achieved / 1e12, 2),
        "mfu": None if peak is None else round(achieved / peak, 4),
        "peak_tflops": None if peak is None else peak / 1e12,
        "compile_s": round(compile_s, 2),
        "loss_finite": bool(np.isfinite(loss)),
        "remat": cfg.remat,
        "backend": jax.default_backend(),
        "devices": f"{jax.device_count()}x{kind}",
        "device": kind,
        "jax_version": jax.__version__,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--size", default="auto", choices=["auto", *sorted(SIZES)], help="auto: tiny on CPU"
    )
    p.add_argument("--patterns", default="DDDD,SSSF")
    p.add_argument("--policy", default="bf16")
    p.add_argument("--batch", type=int, default=0, help="default: the size's")
    p.add_argument("--seq", type=int, default=0, help="default: the size's")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if args.size == "auto":
        args.size = "tiny" if jax.default_backend() == "cpu" else "1b"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    for pattern in args.patterns.split(","):
        print(json.dumps(measure(pattern, args)), flush=True)


if __name__ == "__main__":
    main()
