"""The ~1B update step of ``update_1b.py`` in PyTorch + transformers (``torch.compile``).

``LlamaForCausalLM`` with ``update_1b.py``'s ``DDDD`` layout (d_model 1536, 36 layers, 12 / 3
heads of 128, SwiGLU 4096, vocab 32768, tied embeddings, RoPE, RMSNorm), fp32 parameters,
forward under bf16 autocast, gradient checkpointing per layer (``remat='full'``'s
counterpart), batch 8 x 4096. One step as ``update_baseline.py`` defines it (one forward with
grad, logprobs, PPO loss, backward, grad clip 1.0, AdamW, no-grad metrics); compiled: the loss
function (forward + backward through AOTAutograd) and the clip + AdamW step, each through
``torch.compile``; the finiteness check stays in Python (one host sync, as ``update_fn``'s
skip has none). transformers has no gated sliding-window / block-sparse layers, so the
``SSSF`` layout has no counterpart here.

torch and transformers are not dependencies of the project: run with a python that has them
(the GPU image's python3 does). Without them: one ``skipped`` line, exit 0.

Usage: python benchmarks/update_1b_torch.py [--size auto|1b|tiny] [--reps 5] [--no-compile]
(auto: 1b on CUDA, tiny on CPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# This directory's kernels.py would shadow the `kernels` package transformers probes.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # pragma: no cover - depends on the environment
    print(json.dumps({"bench": "update_1b_torch", "skipped": f"needs torch + transformers: {e}"}))
    sys.exit(0)


def _baseline_module():
    spec = importlib.util.spec_from_file_location(
        "update_baseline", os.path.join(_HERE, "update_baseline.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UB = _baseline_module()
SIZES = {
    "1b": dict(d=1536, layers=36, heads=12, kv=3, ffn=4096, vocab=32768, batch=8, seq=4096),
    "tiny": dict(d=64, layers=4, heads=4, kv=1, ffn=128, vocab=512, batch=2, seq=128),
}
PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def build(size: dict, device: str):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["d"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"],
        head_dim=128 if size["d"] > 64 else 16,
        intermediate_size=size["ffn"],
        hidden_act="silu",
        max_position_embeddings=size["seq"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.float32).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch_of(size: dict, device: str) -> dict:
    b, t, v = size["batch"], size["seq"], size["vocab"]
    prompt = min(1024, t // 2)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    action = torch.zeros((b, t), dtype=torch.bool)
    action[:, prompt:] = True
    adv = torch.where(action, torch.randn((b, t), generator=gen), 0.0)
    logp = torch.where(action, -math.log(v) + 0.1 * torch.randn((b, t), generator=gen), 0.0)
    out = {
        "tokens": tokens,
        "targets": tokens[:, 1:].contiguous(),
        "mask": action[:, 1:].contiguous(),
        "adv": adv[:, 1:].contiguous(),
        "logp_rollout": logp[:, 1:].contiguous(),
    }
    return {k: x.to(device) for k, x in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="auto", choices=["auto", *sorted(SIZES)])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    args = ap.parse_args(argv)
    if args.size == "auto":  # the tiny model on CPU
        args.size = "1b" if args.device == "cuda" else "tiny"
    size, device = SIZES[args.size], args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = build(size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = UB.make_optimizer(model)
    b = batch_of(size, device)
    loss_fn = UB.make_loss_fn(model, "fused", "bf16", device)

    def clip_and_step():
        gnorm = torch.nn.utils.clip_grad_norm_(params, UB.GRAD_CLIP, foreach=True)
        return gnorm

    if args.compile:
        loss_fn = torch.compile(loss_fn)
        clip_and_step = torch.compile(clip_and_step)
        opt_step = torch.compile(opt.step)
    else:
        opt_step = opt.step
    holder = {}

    def step():
        loss, aux = loss_fn(b["tokens"], b["targets"], b["adv"], b["mask"])
        loss.backward()
        gnorm = clip_and_step()
        if bool(torch.isfinite(loss)) and bool(torch.isfinite(gnorm)):
            opt_step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            holder["m"] = UB.metrics(aux, b)
        holder["loss"] = float(loss.detach())

    t0 = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - t0
    step()
    step_ms, step_min, step_max = UB.timed(step, args.reps, sync)
    n_params = sum(p.numel() for p in params)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    tokens = size["batch"] * size["seq"]
    print(
        json.dumps(
            {
                "bench": "update_1b_torch",
                "variant": f"{args.size}-DDDD/hf-llama/bf16"
                + ("/compiled" if args.compile else ""),
                "size": args.size,
                "pattern": "DDDD",
                "params": n_params,
                "batch": size["batch"],
                "seq_len": size["seq"],
                "step_ms": round(step_ms, 2),
                "step_ms_min": round(step_min, 2),
                "step_ms_max": round(step_max, 2),
                "tokens_per_s": round(tokens / (step_ms * 1e-3), 1),
                "first_step_s": round(first_s, 2),
                "compiled": args.compile,
                "loss_finite": math.isfinite(holder["loss"]),
                "gradient_checkpointing": True,
                "backend": f"torch-{device}",
                "device": name,
                "peak_tflops": next((v / 1e12 for k, v in PEAK.items() if k in name), None),
                "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
