"""RL update step of an established trainer stack on the shapes of ``update.py`` (JSON lines).

The reference for issue 6's "an update step at most 0.67x the time of the best established
framework's": PyTorch + HuggingFace transformers, eager (``torch.compile`` optional), fp32, on
``update.py``'s tiny models, randomly initialised:
  dense  ``LlamaForCausalLM``: 4 layers, d_model 256, 4 query heads and 2 KV heads of dim 64,
         SwiGLU FFN 768, RMSNorm, RoPE, vocab 1024, tied embeddings.
  moe    ``MixtralForCausalLM`` with the same attention and 8 experts top-2 of hidden 384
         (softmax router, top-2 gates renormalised; dropless, no load-balance loss).
Attention is dense causal in every layer (``update.py``'s ``DDDD``; transformers has no
equivalent of the gated sliding-window / block-sparse ``SSSF`` layers).

MoE experts (``--experts``; transformers 5.x picks ``grouped_mm`` by default): all three compute
only routed (token, expert) pairs, dropless. ``grouped_mm`` sorts the N*k pairs by expert,
gathers the rows and runs ``torch.nn.functional.grouped_mm`` over per-expert offsets (fwd and
bwd, CPU kernel since torch 2.9); ``eager`` loops over the experts that got a token
(``torch.where`` + row gather, two linears, ``index_add_``); ``batched_mm`` gathers one weight
matrix per pair and runs ``bmm``: N*k = 3072 copies of the expert weights, 3.6 GB per layer
kept for backward here, so it is not measured by default (pass it explicitly; needs > 20 GB of
memory, docs/results.md). ``update.py``'s MoE instead fills
``[E, C, D]`` buffers with capacity ``C = ceil(1.25 * N * k / E)`` (480 rows per expert here,
so 1.25x the routed rows are computed) and drops overflow pairs.

One step (``step_ms``) does what ``update.py``'s ``update_fn`` does with its RLConfig (1 PPO
epoch, 1 minibatch, no micro-batching unless ``--micro-batch N``: gradient accumulation over
micro-batches of N sequences, as ``update.py --micro-batch N``; old_logprobs='recompute', lr
1e-5, clip 0.2/0.2, token-mean, grad clip 1.0, AdamW b 0.9/0.999, eps 1e-8, weight decay 0)
on batch 8 x 192 tokens (64 prompt + 128 action tokens):
  recompute 'fused' (default; what ``update_fn`` does for 1 epoch x 1 minibatch): ONE forward
    with grad; logp = log_softmax(logits[:, :-1]) gathered at tokens[:, 1:]; the PPO anchor is
    logp.detach() (ratio 1, as the recompute with the pre-update parameters would give);
  recompute 'separate' (variant suffix ``/recompute``; what verl/OpenRLHF-style trainers do): a
    ``torch.no_grad`` forward for the anchor, then the forward with grad;
then ratio = exp(clamp(logp - anchor, +-20)), loss = token-mean over the action mask of
max(-A r, -A clip(r, 0.8, 1.2)); no-grad metrics like ``update_fn``'s (entropy of the full
softmax, clip fractions, ratio mean/min/max, approx KL, mean/max |logp - rollout logp|);
backward; ``clip_grad_norm_(1.0)``; skip the step if loss or grad norm is not finite (as
``update_fn``); ``torch.optim.AdamW`` (``fused=True``) step; ``zero_grad(set_to_none=True)``.
Not replicated from ``update_fn``: the update-norm finiteness check, ratio quantiles / ESS /
routing agreement of the mismatch metrics, the MoE load-balance and z losses (coefficient 0
in ``update.py``; ours still computes them).

``--compile`` adds ``/compiled`` lines: the loss function (model forward + logprobs + PPO loss)
through ``torch.compile`` (default inductor, C++ codegen with the system gcc on CPU), backward
via AOTAutograd; clip, AdamW and the metrics stay eager. It works with torch 2.13 on CPU
without graph breaks reported; ``compile_s`` is the first (compiling) step, a minute or more
with a cold inductor cache and seconds once its on-disk cache (/tmp/torchinductor_$USER) holds
the graphs. Under dynamo transformers' ``grouped_mm``
experts path takes its opaque fp32 fallback op (``transformers::grouped_mm_fallback``: one
``torch.mm`` per expert over its sorted rows, fwd and bwd), so inductor compiles the graph
around the experts.

Threads: ``--threads`` is a comma list for ``torch.set_num_threads``, each measured in turn
(default ``1,2``). As ``rollout_baseline.py`` notes, OpenMP workers wait on each other at
every op on a loaded 2-core machine; compare against the faster setting and report the load
average (key ``load_avg``: /proc/loadavg when each line's timing starts). Results and ratios
against ``update.py``: docs/results.md.

Keys as in ``update.py`` where they mean the same: step_ms (+ _min/_max, median of ``--reps``
warm steps after one warm-up step), tokens_per_s (8 * 192 / step), compile_s (compiled
variants), loss_finite; plus bench/variant/backend/devices/threads, experts_implementation,
attn_implementation, recompute, n_forward, torch/transformers versions.

torch and transformers are not dependencies of this project (this script is not imported by
the package or tests); install them in a separate environment, e.g.::

    python3 -m venv /tmp/bvenv
    /tmp/bvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/bvenv/bin/pip install transformers
    /tmp/bvenv/bin/python benchmarks/update_baseline.py --threads 1,2

Without them (e.g. under the project's venv, as ``make bench`` runs it) it prints one
``skipped`` line and exits 0.

Usage: python benchmarks/update_baseline.py [--models dense,moe] [--reps 5] [--threads 1,2]
       [--recompute fused,separate] [--experts grouped_mm,eager,batched_mm] [--attn sdpa|eager]
       [--compile] [--compile-mode default|reduce-overhead|max-autotune-no-cudagraphs]
       [--dtype fp32|bf16] [--device cpu|cuda] [--micro-batch N]

``--device cuda`` runs model, batch and AdamW on the GPU (``torch.cuda.synchronize`` around
each timed step; ``--dtype bf16`` then autocasts on CUDA); threads only affect host work there.

``--dtype bf16`` runs the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (fp32
parameters, gradients and AdamW), the mixed precision ``update.py --policy bf16`` uses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from common import NEW, PRESETS, PROMPT, load_avg, time_ms

BATCH = 8
T = PROMPT + NEW
SHAPES = PRESETS["bench-dense"]  # update.py's models: the same sizes, read from one place
VOCAB = SHAPES["vocab_size"]
CLIP_LOW, CLIP_HIGH, LOG_RATIO_CAP = 0.2, 0.2, 20.0
LR, GRAD_CLIP = 1e-5, 1.0

# This directory's kernels.py / env.py / update.py would shadow modules that transformers probes.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
except ImportError as e:  # pragma: no cover - depends on the environment
    sys.stderr.write(
        f"update_baseline.py needs torch and transformers ({e}); they are not dependencies of "
        "agentrl_jax. Install them in a separate venv, e.g.\n"
        "  python3 -m venv /tmp/bvenv && /tmp/bvenv/bin/pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu && /tmp/bvenv/bin/pip install "
        "transformers\n  /tmp/bvenv/bin/python benchmarks/update_baseline.py\n"
    )
    # A "skipped" line and exit 0, as kernels.py off TPU: `make bench` runs every script with
    # the project's venv and this one sorts last, so its status is the loop's.
    print(json.dumps({"bench": "update_baseline", "skipped": f"needs torch + transformers: {e}"}))
    sys.exit(0)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=SHAPES["d_model"],
    num_hidden_layers=SHAPES["n_layers"],
    num_attention_heads=SHAPES["n_heads"],
    num_key_value_heads=SHAPES["n_kv_heads"],
    head_dim=SHAPES["head_dim"],
    hidden_act="silu",
    max_position_embeddings=T,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=SHAPES["tie_embeddings"],
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
    use_cache=False,
)


def build_model(kind: str, attn: str, experts: str, device: str = "cpu"):
    """Randomly initialised fp32 model in train mode (dropout 0) on ``device`` -> nn.Module."""
    torch.manual_seed(0)
    if kind == "dense":
        cfg = LlamaConfig(intermediate_size=SHAPES["d_ff"], attn_implementation=attn, **COMMON)
        model = LlamaForCausalLM(cfg)
    else:
        moe = PRESETS["bench-moe"]
        cfg = MixtralConfig(
            intermediate_size=moe["d_expert"],
            num_local_experts=moe["n_experts"],
            num_experts_per_tok=moe["experts_per_token"],
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
            attn_implementation=attn,
            experts_implementation=experts,
            **COMMON,
        )
        model = MixtralForCausalLM(cfg)
    model = model.to(device=device, dtype=torch.float32).train()
    if kind == "moe" and model.config._experts_implementation != experts:
        raise RuntimeError(
            f"experts_implementation {experts!r} requested, model uses "
            f"{model.config._experts_implementation!r}"
        )
    return model


def make_batch(device: str = "cpu") -> dict:
    """Random batch with update.py's layout, already shifted to the logprob alignment [B, T-1]."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    action = torch.zeros((BATCH, T), dtype=torch.bool)
    action[:, PROMPT:] = True
    adv = torch.where(action, torch.randn((BATCH, T), generator=gen), 0.0)
    noise = 0.1 * torch.randn((BATCH, T), generator=gen)
    logp_rollout = torch.where(action, -math.log(VOCAB) + noise, 0.0)
    batch = {
        "tokens": tokens,
        "targets": tokens[:, 1:].contiguous(),
        "mask": action[:, 1:].contiguous(),
        "adv": adv[:, 1:].contiguous(),
        "logp_rollout": logp_rollout[:, 1:].contiguous(),
    }
    return {k: v.to(device) for k, v in batch.items()}


def token_logprobs(model, tokens, targets):
    """(logp [B, T-1] of targets, log_softmax [B, T-1, V]) from one teacher-forced forward."""
    logits = model(input_ids=tokens, use_cache=False).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logp_all


def ppo_loss(logp, anchor, adv, mask):
    """Token-mean PPO clipped surrogate -> (loss scalar, ratio [B, T-1])."""
    m = mask.float()
    ratio = torch.exp(torch.clamp(logp - anchor, -LOG_RATIO_CAP, LOG_RATIO_CAP))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - CLIP_LOW, 1.0 + CLIP_HIGH)
    loss = (torch.maximum(l1, l2) * m).sum() / m.sum().clamp(min=1.0)
    return loss, ratio, l1, l2


def make_loss_fn(model, recompute: str, dtype: str = "fp32", device: str = "cpu"):
    """loss_fn(batch) -> (loss, no-grad tensors for metrics): the step's differentiated part.

    ``dtype="bf16"``: the forward runs under ``torch.autocast(device, torch.bfloat16)`` (fp32
    parameters and optimiser; linear layers / matmuls take bf16 inputs), PyTorch's counterpart
    of ``update.py --policy bf16``; logits are upcast to fp32 before the log-softmax either way.
    """

    def loss_fn(tokens, targets, adv, mask):
        if dtype == "bf16":
            with torch.autocast(device, dtype=torch.bfloat16):
                return _loss(tokens, targets, adv, mask)
        return _loss(tokens, targets, adv, mask)

    def _loss(tokens, targets, adv, mask):
        if recompute == "separate":
            with torch.no_grad():
                anchor, _ = token_logprobs(model, tokens, targets)
        logp, logp_all = token_logprobs(model, tokens, targets)
        if recompute == "fused":
            anchor = logp.detach()
        loss, ratio, l1, l2 = ppo_loss(logp, anchor, adv, mask)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return loss, (logp.detach(), ratio.detach(), (l2 > l1).detach(), entropy)

    return loss_fn


def metrics(aux, batch) -> dict:
    """update_fn-like no-grad metrics (masked means over action tokens)."""
    logp, ratio, clipped, entropy = aux
    mask = batch["mask"]
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    d = (logp - batch["logp_rollout"]).abs()
    return {
        "entropy": (entropy * m).sum() / n,
        "clipped_frac": (clipped.float() * m).sum() / n,
        "ratio_mean": (ratio * m).sum() / n,
        "ratio_max": ratio[mask].max(),
        "ratio_min": ratio[mask].min(),
        "approx_kl": ((ratio - 1.0 - torch.log(ratio)) * m).sum() / n,
        "mean_abs_dlogp": (d * m).sum() / n,
        "max_abs_dlogp": d[mask].max(),
    }


def make_optimizer(model):
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kw)
    except (RuntimeError, TypeError):  # pragma: no cover - older torch without the CPU kernel
        return torch.optim.AdamW(model.parameters(), foreach=True, **kw)


def measure(kind, experts, recompute, threads, compiled, args) -> dict:
    torch.set_num_threads(threads)
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = build_model(kind, args.attn, experts, device)
    opt = make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = make_batch(device)
    loss_fn = make_loss_fn(model, recompute, args.dtype, device)
    if compiled:
        mode = None if args.compile_mode == "default" else args.compile_mode
        loss_fn = torch.compile(loss_fn, mode=mode)
    holder = {}

    micro = args.micro_batch or BATCH
    n_tok = batch["mask"].float().sum().clamp(min=1.0)

    def step():
        # gradient accumulation: each micro-batch's token-mean loss weighted by its share of
        # the batch's action tokens, so the summed gradient is the whole batch's token mean
        losses, auxes = [], []
        for i in range(0, BATCH, micro):
            mb = {k: v[i : i + micro] for k, v in batch.items()}
            loss, aux = loss_fn(mb["tokens"], mb["targets"], mb["adv"], mb["mask"])
            loss = loss * (mb["mask"].float().sum() / n_tok) if micro < BATCH else loss
            loss.backward()
            losses.append(loss.detach())
            auxes.append(aux)
        loss = sum(losses)
        aux = tuple(torch.cat(parts) for parts in zip(*auxes))
        gnorm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
        if bool(torch.isfinite(loss)) and bool(torch.isfinite(gnorm)):
            opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            holder["m"] = metrics(aux, batch)
        holder["loss"] = float(loss)

    t0 = time.perf_counter()
    step()  # warm-up (compiles when compiled)
    sync()
    first_s = time.perf_counter() - t0
    step()  # a second warm step (CUDA: allocator and autotuning caches settle)
    load = load_avg()
    timing = time_ms(step, reps=args.reps, warmup=0, sync=lambda _: sync())
    step_ms = timing.median_ms
    n_params = sum(p.numel() for p in params)
    line = {
        "bench": "update_baseline",
        "variant": f"hf-{'llama' if kind == 'dense' else 'mixtral'}-DDDD"
        + (f"/{experts}" if kind == "moe" else "")
        + ("/recompute" if recompute == "separate" else "")
        + ("/bf16" if args.dtype == "bf16" else "")
        + (f"/micro{micro}" if micro < BATCH else "")
        + f"/t{threads}"
        + ("/compiled" if compiled else "")
        + (f"-{args.compile_mode}" if compiled and args.compile_mode != "default" else ""),
        "impl": f"transformers.{type(model).__name__} + torch.optim.AdamW",
        "model": kind,
        "pattern": "DDDD",
        "policy": args.dtype,
        "batch": BATCH,
        "micro_batch": micro,
        "seq_len": T,
        **timing.fields("step_ms", digits=2),
        "tokens_per_s": round(BATCH * T / (step_ms / 1e3), 1),
        "loss_finite": math.isfinite(holder["loss"]),
        "recompute": recompute,
        "n_forward": 2 if recompute == "separate" else 1,
        "experts_implementation": experts if kind == "moe" else None,
        "attn_implementation": args.attn,
        "compiled": compiled,
        "compile_mode": args.compile_mode if compiled else None,
        "first_step_s": round(first_s, 2),
        "params": n_params,
        "reps": args.reps,
        "load_avg": load,
        "backend": f"torch-{device}",
        "devices": 1,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else None,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    if compiled:
        line["compile_s"] = line["first_step_s"]
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: forward under CPU autocast (update.py --policy bf16's counterpart)",
    )
    ap.add_argument("--threads", default="1,2", help="comma list for torch.set_num_threads")
    ap.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help=f"sequences per gradient-accumulation micro-batch (divides {BATCH}; default the "
        "whole batch): update.py --micro-batch's counterpart",
    )
    ap.add_argument("--recompute", default="fused", help="comma list of fused, separate")
    ap.add_argument(
        "--experts", default="grouped_mm", help="comma list: grouped_mm,eager,batched_mm"
    )
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="cuda: time on the GPU"
    )
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd steps")
    ap.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        help="torch.compile mode (reduce-overhead: CUDA graphs on GPU)",
    )
    args = ap.parse_args(argv)
    for field, allowed in (
        ("models", {"dense", "moe"}),
        ("recompute", {"fused", "separate"}),
        ("experts", {"grouped_mm", "eager", "batched_mm"}),
    ):
        bad = set(getattr(args, field).split(",")) - allowed
        if bad:
            raise ValueError(f"--{field} {sorted(bad)} not in {sorted(allowed)}")
    if args.micro_batch is not None and (args.micro_batch < 1 or BATCH % args.micro_batch):
        raise ValueError(f"--micro-batch {args.micro_batch} must divide the batch of {BATCH}")
    threads = [int(t) for t in args.threads.split(",")]
    if any(t < 1 for t in threads):
        raise ValueError(f"--threads {args.threads} must be ints >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    for kind in args.models.split(","):
        for experts in args.experts.split(",") if kind == "moe" else ["-"]:
            for recompute in args.recompute.split(","):
                for compiled in (False, True) if args.compile else (False,):
                    for t in threads:
                        try:
                            line = measure(kind, experts, recompute, t, compiled, args)
                        except Exception as e:  # compile failures are a result, not a crash
                            if not compiled:
                                raise
                            line = {
                                "bench": "update_baseline",
                                "variant": f"{kind}/{experts}/{recompute}/t{t}/compiled",
                                "error": f"{type(e).__name__}: {str(e)[:300]}",
                            }
                        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
