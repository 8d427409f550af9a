"""Parity with ``transformers`` per HF family and dtype policy (one JSON line each).

For each family (Qwen3, Qwen3-MoE, gpt-oss) a tiny random model is built and saved by
``transformers`` (``agentrl_jax.hf.tiny``), loaded with ``hf.load_pretrained`` and compared with
the float32 ``transformers`` model:

  max_abs_logit_diff    logits on a random [2, 64] token batch, our policy vs HF fp32
  greedy_tokens_equal   tokens of our sampler's greedy 32-token continuation equal to HF
                        ``generate``'s before the first difference (of 32, 2 prompts: the min)
  max_abs_logprob_diff  teacher-forced logprobs of a sampled 32-token continuation
  load_s                ``load_pretrained`` wall time (median of 5, after one warm load)
  params                parameter count

Keys: bench, variant (family/policy), family, policy, the four measures, load_s_min,
load_s_max, params, backend, devices, jax_version, torch_version, transformers_version, cpu.

Usage: python benchmarks/hf_parity.py [--policies fp32,bf16] [--families qwen3,...]
       [--out benchmarks/results/cpu-DATE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time

# transformers imports the PyPI package `kernels`; benchmarks/kernels.py (this script's
# directory is first on sys.path) would shadow it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from agentrl_jax.hf import load_pretrained  # noqa: E402
from agentrl_jax.hf.tiny import FAMILY_NAMES, make_tiny_hf  # noqa: E402
from agentrl_jax.model.transformer import Transformer, param_count, token_logprobs  # noqa: E402
from agentrl_jax.precision import get_policy  # noqa: E402
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler  # noqa: E402

N_NEW = 32


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def generate(cfg, policy, params, prompt, *, greedy: bool, seed: int = 0) -> np.ndarray:
    """The project's sampler: ``N_NEW`` tokens after ``prompt`` [B, T] (no stop token)."""
    sampler = get_sampler(Transformer(cfg, policy), RolloutConfig(max_new_tokens=N_NEW))
    b, t = prompt.shape
    state = sampler.init_state(b)
    toks = np.zeros((b, sampler.prefill_width(t)), np.int32)
    toks[:, :t] = prompt
    state, _ = sampler.prefill(params, state, toks, np.full(b, t, np.int32))
    _, out = sampler.decode(
        params, state, jax.random.key(seed), np.arange(b, dtype=np.int32), np.ones(b, bool),
        np.full(b, N_NEW, np.int32), np.int32(b), np.full(b, greedy),
    )  # fmt: skip
    return np.asarray(out.tokens)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def measure(family: str, policies: list[str], tmp: str) -> list[dict]:
    path = f"{tmp}/{family}"
    hf = make_tiny_hf(family, path, seed=0)
    rng = np.random.default_rng(0)
    cfg, _ = load_pretrained(path)  # warm (imports, eval_shape compile)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        cfg, params = load_pretrained(path)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
    tokens = rng.integers(0, cfg.vocab_size, (2, 64))
    ref_logits = hf_logits(hf, tokens)
    prompt = rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    with torch.no_grad():
        ref_greedy = hf.generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=N_NEW, do_sample=False,
            min_new_tokens=N_NEW, pad_token_id=0,
        )[:, 16:].numpy()  # fmt: skip
    sampled = np.concatenate(
        [prompt, generate(cfg, get_policy("fp32"), params, prompt, greedy=False, seed=1)], 1
    )
    ref_lp = torch.log_softmax(torch.as_tensor(hf_logits(hf, sampled)), -1).numpy()
    ref_lp = np.take_along_axis(ref_lp[:, 15:-1], sampled[:, 16:, None], -1)[..., 0]
    lines = []
    for name in policies:
        policy = get_policy(name)
        cfg_p, params_p = load_pretrained(path, policy)
        model = Transformer(cfg_p, policy)
        logits = np.asarray(jax.jit(model.apply)(params_p, jnp.asarray(tokens))[0])
        greedy = generate(cfg_p, policy, params_p, prompt, greedy=True)
        differs = greedy != ref_greedy
        equal = [int(np.argmax(d)) if d.any() else N_NEW for d in differs]
        lp_logits = jax.jit(model.apply)(params_p, jnp.asarray(sampled))[0]
        lp = np.asarray(token_logprobs(lp_logits[:, :-1], jnp.asarray(sampled[:, 1:])))[:, 15:]
        lines.append(
            {
                "bench": "hf_parity",
                "variant": f"{family}/{name}",
                "family": family,
                "policy": name,
                "max_abs_logit_diff": float(np.abs(logits - ref_logits).max()),
                "greedy_tokens_equal": int(min(equal)),
                "max_abs_logprob_diff": float(np.abs(lp - ref_lp).max()),
                "load_s": statistics.median(times),
                "load_s_min": min(times),
                "load_s_max": max(times),
                "params": param_count(params),
                "backend": jax.default_backend(),
                "devices": jax.device_count(),
                "jax_version": jax.__version__,
                "torch_version": torch.__version__,
                "transformers_version": transformers.__version__,
                "cpu": cpu_model(),
            }
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="fp32,bf16")
    parser.add_argument("--families", default=",".join(FAMILY_NAMES))
    parser.add_argument("--out", default=None, help="also append the lines to this JSONL file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            for line in measure(family, args.policies.split(","), tmp):
                text = json.dumps(line)
                print(text, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
