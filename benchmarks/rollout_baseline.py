"""Rollout throughput of an established sampler on the shapes of ``rollout.py`` (JSON lines).

The reference for issue 4's "1.5x the best established sampler": HuggingFace transformers
``LlamaForCausalLM.generate`` on PyTorch, eager, with its KV cache (``use_cache=True``). The model
is randomly initialised with the shapes of ``rollout.py``'s tiny dense ``D`` model: 4 layers,
d_model 256, 4 query heads and 2 KV heads of dim 64, SwiGLU FFN 768, RMSNorm, RoPE, vocab 1024,
tied embeddings, fp32. Prompt 64 random tokens, exactly 128 new tokens (no EOS token: nothing
stops early, nothing is masked), full-vocabulary sampling at temperature 1 (``top_k=0``,
``top_p=1.0``).

Threads: ``--threads`` sets ``torch.set_num_threads`` (default 2, the machine's cores). On a
shared, loaded machine PyTorch's OpenMP workers wait on each other at every op and generate()
slows down more than tenfold (docs/results.md has the measurement); compare
against the faster of ``--threads 1`` and ``--threads 2`` and report the load average.

Keys as in ``rollout.py``: tokens_per_s (prompt + new tokens over one generate call, as there),
decode_tokens_per_s (new tokens over generate minus a separately timed prefill forward),
prefill_ms, total_ms (+ _min/_max), plus bench/variant/backend/devices/threads and the
torch/transformers versions. Warm-up call excluded; median of ``--reps``.

torch and transformers are not dependencies of this project; install them in a separate
environment, e.g.::

    python3 -m venv /tmp/bvenv
    /tmp/bvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/bvenv/bin/pip install transformers
    /tmp/bvenv/bin/python benchmarks/rollout_baseline.py --threads 2

Usage: python benchmarks/rollout_baseline.py [--batches 8,32] [--reps 5] [--threads 2|1]
       [--attn sdpa|eager]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common import NEW, PRESETS, PROMPT, time_ms

SHAPES = PRESETS["bench-dense"]  # rollout.py's dense model: the same sizes, read from one place

# This directory's kernels.py / env.py / update.py would shadow modules that transformers probes.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # pragma: no cover - depends on the environment
    sys.stderr.write(
        f"rollout_baseline.py needs torch and transformers ({e}); they are not dependencies of "
        "agentrl_jax. Install them in a separate venv, e.g.\n"
        "  python3 -m venv /tmp/bvenv && /tmp/bvenv/bin/pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu && /tmp/bvenv/bin/pip install "
        "transformers\n  /tmp/bvenv/bin/python benchmarks/rollout_baseline.py\n"
    )
    # A "skipped" line and exit 0 (as update_baseline.py): `make bench` runs every script.
    print(json.dumps({"bench": "rollout_baseline", "skipped": f"needs torch + transformers: {e}"}))
    sys.exit(0)


def build_model(attn: str) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=SHAPES["vocab_size"],
        hidden_size=SHAPES["d_model"],
        intermediate_size=SHAPES["d_ff"],
        num_hidden_layers=SHAPES["n_layers"],
        num_attention_heads=SHAPES["n_heads"],
        num_key_value_heads=SHAPES["n_kv_heads"],
        head_dim=SHAPES["head_dim"],
        hidden_act="silu",
        max_position_embeddings=PROMPT + NEW,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=SHAPES["tie_embeddings"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def bench_one(model, batch: int, args) -> dict:
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, SHAPES["vocab_size"], (batch, PROMPT), generator=gen)
    mask = torch.ones_like(prompt)

    def full():
        torch.manual_seed(1)
        return model.generate(
            input_ids=prompt,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=NEW,
            max_new_tokens=NEW,
            use_cache=True,
        )

    def prefill_only():
        # What generate's first step runs: the prompt through the model, filling a fresh cache;
        # logits of the last position only where this transformers version supports it.
        try:
            return model(input_ids=prompt, attention_mask=mask, use_cache=True, logits_to_keep=1)
        except TypeError:
            return model(input_ids=prompt, attention_mask=mask, use_cache=True)

    host = lambda _: None  # CPU tensors are ready when the call returns
    with torch.inference_mode():
        out = full()  # warm-up
        t = time_ms(full, reps=args.reps, warmup=0, sync=host)
        t_pre = time_ms(prefill_only, reps=args.reps, sync=host).median_ms / 1e3
    t_full = t.median_ms / 1e3
    if tuple(out.shape) != (batch, PROMPT + NEW):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, want {(batch, PROMPT + NEW)}")
    t_dec = max(t_full - t_pre, 1e-9)
    return dict(
        bench="rollout_baseline",
        variant=f"hf-llama/D/b{batch}/fp32",
        impl="transformers.LlamaForCausalLM.generate",
        model="dense",
        pattern="D",
        batch=batch,
        prompt=PROMPT,
        new_tokens=NEW,
        policy="fp32",
        attn_implementation=args.attn,
        tokens_per_s=batch * (PROMPT + NEW) / t_full,
        decode_tokens_per_s=batch * NEW / t_dec,
        prefill_ms=1e3 * t_pre,
        **t.fields("total_ms"),
        generated_per_seq=int(out.shape[1]) - PROMPT,
        reps=args.reps,
        backend="torch-cpu",
        devices=1,
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.attn)
    for batch in (int(b) for b in args.batches.split(",")):
        print(json.dumps(bench_one(model, batch, args)), flush=True)


if __name__ == "__main__":
    main()
