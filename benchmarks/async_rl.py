"""Asynchronous RL: throughput at max_staleness 0, 1, 2, held-out success, resume, mismatch.

Prints one JSON line per measurement (``variant``):
  * ``throughput`` (one per ``env`` and ``max_staleness``; ``env_overlap`` marks k=0 with
    ``train.overlap_env``: environment steps overlapping the model, no staleness):
    ``steps_per_hour``, ``tokens_per_s`` (rolled-out tokens over step wall time), ``step_s``
    (median, min, max over the measured steps), what each side takes per step (``rollout_s``:
    the rollouts' wall time, ``update_s``, ``tool_s``: wall time inside ``env.step``, summed
    over calls, and each over ``step_s`` as ``*_share``), the CPU time per step of this
    process (``cpu_s``) and of its finished subprocesses (``child_cpu_s``: the sandboxed test
    runs) and ``cores_busy`` (both over the measured wall time: 2.0 is two full cores), the
    async waits and lag, and ``speedup_async_vs_sync`` (steps per hour over the k=0 line's,
    same env);
  * ``heldout``: held-out success after the same RL steps at k=0 and k=1 from the same start
    (the coderepair runs above), the paired difference and its standard error;
  * ``resume``: ``resume_bitwise`` of an async run (k=2, mid-batch switches) checkpointed and
    continued by a new run object against an uninterrupted one (the SIGKILL version is
    ``tests/train/test_async_rl.py``);
  * ``mismatch``: the four sources of one async run (``mismatch_lag``, ``mismatch_numerics``,
    ``mismatch_routing``, ``mismatch_kv``: mean |dlogp| over action tokens, and their shares),
    on a small MoE under the fp32-parity policy with KV eviction, and the extra passes' cost.

Environments: ``coderepair`` is the default experiment (its SFT checkpoint with
``--init-from RUN_DIR``, e.g. a ``make train`` run; else random weights); ``pyrepair`` is the
Python repair environment (tests run in the sandbox, ~0.1-0.3 s each) with a small
sliding-window model warm-started here on crops of the scripted expert's turns (a few minutes),
so it calls ``run_tests`` / ``submit`` as a trained agent would.

With ``--switch-rounds N`` (default 16) one more ``throughput`` line per env: k=1 with a weight
switch every N agent-loop rounds (partial rollouts, ``continue``).

Usage: python benchmarks/async_rl.py [--envs coderepair,pyrepair] [--init-from RUN_DIR]
  [--steps 6] [--warmup 2] [--ks 0,1,2] [--switch-rounds 16] [--no-heldout]
  [--heldout-episodes 512] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import load_config
from agentrl_jax.data.pipeline import TaskPipeline
from agentrl_jax.experiment import build
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.rl.state import TrainState
from agentrl_jax.train import stages
from agentrl_jax.train.demos import demo_episode, pad_batch
from agentrl_jax.train.eval_stats import paired_gain
from agentrl_jax.train.rl_loop import RLRun
from agentrl_jax.train.sft import SFTConfig, make_train_step, sft_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = ["rl.loss.tis_cap=2.0"]  # the importance correction of the lag
SETTINGS = {
    "coderepair": (
        "experiments/toy.py",
        ["train.sft=False", "train.eval_before=False", "eval.modes=('greedy',)"],
    ),
    "pyrepair": (
        "experiments/pyrepair.py:smoke=True",
        [
            "train.sft=False",
            "train.eval_before=False",
            "model.d_model=64",
            "model.layer_pattern=SS",  # local attention: crops teach what whole episodes need
            "model.window=64",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.head_dim=16",
            "model.d_ff=128",
            "train.max_turns=4",
            "rollout.max_new_tokens=96",
            "data.batch_size=4",
            "data.group_size=4",
            "rl.micro_batch=4",
        ],
    ),
}


def _machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "jax_version": jax.__version__,
    }


def emit(line: dict) -> None:
    line = {"bench": "async_rl", **line, **_machine(), "loadavg_1m": os.getloadavg()[0]}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


class TimedEnv:
    """An environment whose ``step`` wall time is added to ``clock`` (thread-safe)."""

    def __init__(self, env, clock: list, lock: threading.Lock):
        self._env, self._clock, self._lock = env, clock, lock
        self.tokenizer = env.tokenizer

    def reset(self, task):
        return self._env.reset(task)

    def step(self, action):
        t0 = time.perf_counter()
        out = self._env.step(action)
        with self._lock:
            self._clock[0] += time.perf_counter() - t0
        return out


def timed_sections(sections, clock: list):
    lock = threading.Lock()
    spec = sections.env
    env = dataclasses.replace(spec, env=lambda tok: TimedEnv(spec.env(tok), clock, lock))
    return dataclasses.replace(sections, env=env)


def warm_start_pyrepair(sections, steps: int, seed: int = 0):
    """Parameters trained on crops of the expert's turns: the 160 tokens ending with each
    turn (loss on that turn only), ``steps`` AdamW steps of 32 crops."""
    tok = sections.env.tokenizer()
    specs = TaskPipeline(sections.data, "train", adaptive=False).next_batch(48)
    crops = []
    for spec in specs:
        d = demo_episode(spec, tok, env=sections.env)
        act, turns = d["action_mask"], d["turn_ids"]
        for k in np.unique(turns[act]):
            end = int(np.flatnonzero(act & (turns == k))[-1]) + 1
            c = {key: d[key][max(0, end - 160) : end] for key in ("tokens", "action_mask")}
            c["turn_ids"] = turns[max(0, end - 160) : end]
            c["action_mask"] = c["action_mask"] & (c["turn_ids"] == k)
            c["fix_mask"] = np.zeros_like(c["action_mask"])
            crops.append(c)
    model = Transformer(sections.model, sections.policy)
    params = init_params(model, jax.random.key(seed))
    cfg = SFTConfig(steps=steps, lr=3e-3, warmup_steps=20, batch_size=32)
    opt = sft_optimizer(cfg)
    zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = TrainState(zero(), params, opt.init(params), jax.random.key(seed), zero(), zero())
    train_step = make_train_step(model, opt, 0.0)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        pick = rng.integers(0, len(crops), cfg.batch_size)
        state, _ = train_step(state, pad_batch([crops[j] for j in pick], (160,), tok.pad_id))
    return state.params


def cached(directory: str, name: str, make, template):
    """``make()``'s parameters, saved as ``directory/name`` (npz) and read back next time."""
    path = os.path.join(directory, name) if directory else ""
    if path and os.path.exists(path):
        with np.load(path) as f:
            leaves = [jnp.asarray(f[f"a{i}"]) for i in range(len(f.files))]
        return jax.tree.unflatten(jax.tree.structure(template), leaves)
    params = make()
    if path:
        os.makedirs(directory, exist_ok=True)
        leaves = jax.tree.leaves(params)
        np.savez(path, **{f"a{i}": np.asarray(x) for i, x in enumerate(leaves)})
    return params


def throughput(env_name, sections, params, k, steps, warmup) -> tuple[dict, RLRun]:
    """Trains ``warmup + steps`` steps at staleness ``k``; measures the last ``steps``."""
    clock = [0.0]
    s = timed_sections(sections, clock)
    run_dir = tempfile.mkdtemp(prefix=f"async_rl_{env_name}_k{k}_")
    run = RLRun(s, run_dir, params, seed=0, resume=False)
    walls, rows = [], []
    for step in range(warmup + steps):
        if step == warmup:
            tool0, cpu0 = clock[0], os.times()
        t0 = time.perf_counter()
        m = run.step(step)
        walls.append(time.perf_counter() - t0)
        rows.append(m)
    cpu1 = os.times()
    measured, ms = walls[warmup:], rows[warmup:]
    total = sum(measured)
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    child = (cpu1.children_user - cpu0.children_user) + (
        cpu1.children_system - cpu0.children_system
    )
    med = lambda key: statistics.median(m.get(key, 0.0) for m in ms)  # noqa: E731
    tokens = sum(m["rollout_tokens_per_s"] * m["rollout_s"] for m in ms)
    step_s = statistics.median(measured)
    line = {
        "variant": "throughput",
        "env": env_name,
        "max_staleness": k,
        "env_overlap": bool(k > 0 or sections.train.overlap_env),
        "sync_every_rounds": sections.rl.sync_every_rounds,
        "partial_rollout": sections.rl.partial_rollout,
        "steps": steps,
        "warmup_steps": warmup,
        "steps_per_hour": round(3600 * steps / total, 1),
        "tokens_per_s": round(tokens / total, 1),
        "step_s": round(step_s, 3),
        "step_s_min": round(min(measured), 3),
        "step_s_max": round(max(measured), 3),
        "rollout_s": round(med("rollout_s"), 3),
        "update_s": round(med("update_s"), 3),
        "tool_s": round((clock[0] - tool0) / steps, 3),
        "cpu_s": round(cpu / steps, 3),
        "child_cpu_s": round(child / steps, 3),
        "cores_busy": round((cpu + child) / total, 2),
    }
    for key in ("rollout_s", "update_s", "tool_s"):
        line[f"{key[:-2]}_share"] = round(line[key] / step_s, 3)
    for key in ("learner_wait_s", "rollout_wait_s", "lag_mean", "mixed_version_episodes"):
        line[key] = round(med(f"async/{key}"), 3)
    line["success"] = round(statistics.mean(m["success"] for m in ms), 4)
    line["episode_tokens"] = round(med("episode_tokens"), 1)
    run.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return line, run


def heldout(sections, runs: dict) -> dict:
    """Held-out success of the k=0 and k=1 runs' parameters (same tasks), paired."""
    res = {k: stages.evaluate_run(sections, runs[k].state.params) for k in (0, 1)}
    mode = stages.main_mode(res[0])
    gain = paired_gain(res[0][mode], res[1][mode])
    return {
        "variant": "heldout",
        "env": "coderepair",
        "mode": mode,
        "heldout_success_k0": res[0][mode]["success"],
        "heldout_success_k1": res[1][mode]["success"],
        "paired_delta_k1_minus_k0": round(gain["delta"], 4),
        "paired_stderr": round(gain["stderr"], 4),
        "n": gain["n"],
        "steps": int(runs[0].state.step),
    }


SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"
SMOKE_ASYNC = [
    "train.sft=False",
    "train.eval_before=False",
    "rl.advantage=episode_process",  # unequal advantages for a random model: weights move
    "rl.max_staleness=2",
    "rl.loss.tis_cap=2.0",
    "rl.sync_every_rounds=2",
    "train.rl_steps=4",
]


def resume_line() -> dict:
    cfg = load_config(SMOKE, SMOKE_ASYNC)
    s = build(cfg)
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    a = RLRun(s, tempfile.mkdtemp(), params, seed=0, resume=False)
    for step in range(4):
        a.step(step)
    a.close()
    d = tempfile.mkdtemp()
    b = RLRun(s, d, params, seed=0, resume=False)
    for step in range(2):
        b.step(step)
    b.save(2)
    b.close()
    c = RLRun(s, d, params, seed=0, resume=True, attempt=2)
    for step in range(c.start_step, 4):
        c.step(step)
    c.close()
    leaves = lambda r: jax.tree.leaves((r.state.params, r.state.opt_state))  # noqa: E731
    same = all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c), strict=True))
    same = same and a.pipeline.state() == c.pipeline.state()
    return {"variant": "resume", "config": "default smoke, k=2", "resume_bitwise": bool(same)}


def mismatch_line(steps: int = 5) -> dict:
    over = [
        *SMOKE_ASYNC,
        "rl.max_staleness=1",
        f"train.rl_steps={steps}",
        "policy=fp32-parity",
        "model.n_experts=4",
        "model.experts_per_token=2",
        "model.d_expert=16",
        "rollout.eviction_threshold=0.5",
        "train.max_turns=4",
        "rl.use_kv_mask_replay=True",
        "rl.mismatch_sources=True",
    ]
    s = build(load_config(SMOKE, over))
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    run = RLRun(s, tempfile.mkdtemp(), params, seed=0, resume=False)
    rows = [run.step(step) for step in range(steps)][1:]  # step 0: compiles
    run.close()
    mean = lambda key: float(np.mean([m[key] for m in rows]))  # noqa: E731
    line = {
        "variant": "mismatch",
        "config": "default smoke + MoE 4x2, fp32-parity, KV eviction 0.5, 4 turns, k=1, continue",
        "steps": len(rows),
    }
    for src in ("lag", "numerics", "routing", "kv"):
        line[f"mismatch_{src}"] = mean(f"mismatch_src/{src}")
        line[f"mismatch_{src}_share"] = round(mean(f"mismatch_src/{src}_share"), 4)
    line["mismatch_total"] = mean("mismatch_src/total")
    line["extra_passes"] = mean("mismatch_src/extra_passes")
    line["extra_s"] = round(mean("mismatch_src/seconds"), 3)
    line["update_s"] = round(mean("update_s"), 3)
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--envs", default="coderepair,pyrepair")
    p.add_argument("--init-from", default="", help="coderepair: a run dir with an SFT stage")
    p.add_argument("--ks", default="0,1,2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sync-every-rounds", type=int, default=0)
    p.add_argument("--switch-rounds", type=int, default=16, help="one more k=1 line (0: none)")
    p.add_argument("--pyrepair-warm-steps", type=int, default=400)
    p.add_argument("--cache-dir", default="", help="keeps the pyrepair warm start between runs")
    p.add_argument("--no-heldout", action="store_true")
    p.add_argument("--heldout-episodes", type=int, default=512)
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--no-mismatch", action="store_true")
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    for env_name in [e for e in args.envs.split(",") if e]:
        spec, over = SETTINGS[env_name]
        over = [*over, f"rl.sync_every_rounds={args.sync_every_rounds}"]
        over.append(f"train.rl_steps={args.warmup + args.steps}")
        over.append(f"eval.n_episodes={args.heldout_episodes}")
        base = build(load_config(spec, over))
        if env_name == "pyrepair":
            params = cached(
                args.cache_dir,
                f"pyrepair_warm_{args.pyrepair_warm_steps}.npz",
                functools.partial(warm_start_pyrepair, base, args.pyrepair_warm_steps),
                init_params(Transformer(base.model, base.policy), jax.random.key(0)),
            )
        else:
            template = init_params(Transformer(base.model, base.policy), jax.random.key(0))
            params = template
            if args.init_from:
                params = stages.initial_params(args.init_from, template)
        lines, runs = {}, {}
        variants = [(k, False, 0) for k in ks] + [(0, True, 0)] * (0 in ks)
        if args.switch_rounds:  # partial rollouts: k=1 with mid-batch weight switches
            variants.append((1, False, args.switch_rounds))
        for k, overlap, every in variants:
            extra = [f"rl.max_staleness={k}", *ASYNC] if k else []  # k=0: the default loop
            extra += ["train.overlap_env=True"] if overlap else []
            extra += [f"rl.sync_every_rounds={every}"] if every else []
            s = build(load_config(spec, [*over, *extra]))
            line, run = throughput(env_name, s, params, k, args.steps, args.warmup)
            if 0 in lines and (k > 0 or overlap):  # same env, k=0 measured first
                line["speedup_async_vs_sync"] = round(
                    line["steps_per_hour"] / lines[0]["steps_per_hour"], 3
                )
            if not (overlap or every):
                lines[k], runs[k] = line, run
            emit(line)
        if env_name == "coderepair" and not args.no_heldout and {0, 1} <= set(runs):
            emit(heldout(base, runs))
    if not args.no_resume:
        emit(resume_line())
    if not args.no_mismatch:
        emit(mismatch_line())


if __name__ == "__main__":
    main()
