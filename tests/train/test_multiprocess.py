"""Two JAX processes on localhost (gloo CPU collectives, 2 fake devices each) run the smoke
experiment through ``agentrl train --coordinator --num-processes --process-id``:

(a) the run matches a one-process run over the same 4 devices: the same episodes are sampled
    (identical tool calls) and the parameters agree within 1e-2 x the summed learning rates of
    the steps (``test_mesh.py`` derives the per-step bound; not bitwise because the gradient
    all-reduce crosses processes through gloo in another order);
(b) both processes killed with SIGKILL after the first RL checkpoint and started again with
    ``--resume`` end with the parameters of an uninterrupted two-process run, bit for bit;
(c) the processes play disjoint blocks of every rollout round, and together the episodes one
    process plays.

The runs share a compilation cache: the uninterrupted two-process run goes first and fills it,
then the one-process and the to-be-killed runs run side by side, the resumed one starting as
soon as the killed one is dead. Only process 0 gains from the cache: on CPU JAX keys its entries
with a topology fingerprint that differs between the processes and writes them from process 0
only, so process 1 compiles every program in each of its three launches. About 200 CPU-s: it
is marked ``slow`` (with it, ``make test`` ran over its 10 minutes; docs/distributed.md), and
``.ci/run`` runs the slow tier after ``make test``.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from agentrl_jax.experiment import build, from_saved
from agentrl_jax.metrics import load_config_json, read_jsonl
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.train.checkpoint import restore_params, stage_dir

pytestmark = pytest.mark.slow

SETTINGS = [
    "mesh.fsdp=-1",
    "sft.steps=2",
    "sft.batch_size=4",
    "sft.buckets=(384,)",
    "train.eval_before=False",
    "train.rl_steps=2",
    "train.ckpt_every=1",
    # process rewards give the smoke model's episodes unequal advantages (its outcome rewards
    # are all 0 after 2 SFT steps): the RL steps' gradients, all-reduced across the processes,
    # are not zero
    "rl.advantage=episode_process",
    "eval.modes=('sampled',)",
    # the evaluation after RL runs the rollout's 4 slots x 16 new tokens: the sampler's
    # programs compiled for RL serve it too (2 episodes would compile a 2-slot prefill/decode)
    "eval.n_slots=4",
    "eval.n_episodes=4",
    # one refill round of dynamic sampling per step (the experiment's 2 play a third round of
    # the same programs): the processes still have to agree on a refill
    "data.max_refill_rounds=1",
]
SFT_LR, RL_LR, STEPS = 3e-3, 5e-4, 2  # the smoke experiment's learning rates
AGENTRL = os.path.join(os.path.dirname(sys.executable), "agentrl")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(workdir, processes: int, devices: int, cache, resume=None) -> list[subprocess.Popen]:
    """``agentrl train`` as ``processes`` processes of ``devices`` fake CPU devices each."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
        + env.get("TEST_XLA_FLAGS", "--xla_backend_optimization_level=0"),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        AGENTRL_NO_PROGRESS="1",
    )
    if resume:
        cmd = [AGENTRL, "train", "--resume", str(resume)]
    else:
        cmd = [AGENTRL, "train", "experiments/toy.py:smoke=True", f"--set=workdir={workdir}"]
        cmd += [f"--set={s}" for s in SETTINGS]
    port = _free_port()
    out = []
    for i in range(processes):
        dist = ["--coordinator", f"localhost:{port}", "--num-processes", str(processes)]
        dist += ["--process-id", str(i)] if processes > 1 else []
        log = open(os.path.join(workdir, f"{'resume' if resume else 'run'}-p{i}.log"), "w")
        out.append(
            subprocess.Popen(
                cmd + (dist if processes > 1 else []),
                env=env,
                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        )
    return out


def _finish(procs, timeout=600) -> list[str]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"exit {p.returncode}"
        outs.append(out)
    return outs


def _run_dir(workdir) -> str:
    (name,) = [n for n in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, n))]
    return os.path.join(workdir, name)


def _params(run_dir) -> dict:
    s = build(from_saved(load_config_json(run_dir)))
    template = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    params, step = restore_params(stage_dir(run_dir, "rl"), template)
    assert step == STEPS
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def _calls(run_dir) -> list[tuple]:
    rows = read_jsonl(os.path.join(run_dir, "tool_calls.jsonl"))
    keys = ("step", "episode", "turn", "tool", "args", "output")
    return sorted(json.dumps([r[k] for k in keys]) for r in rows), rows


def test_two_processes_match_one_and_resume_bitwise(tmp_path):
    dirs = {k: tmp_path / k for k in ("two", "one", "killed")}
    for d in dirs.values():
        d.mkdir()
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or tmp_path / "cache"  # make: .jax_cache
    # The uninterrupted run first, alone: it fills the compilation cache the killed run (same
    # programs) then reads, which costs less CPU than compiling them twice side by side.
    outs_two = _finish(_launch(dirs["two"], 2, 2, cache))
    one = _launch(dirs["one"], 1, 4, cache)
    killed = _launch(dirs["killed"], 2, 2, cache)
    # kill both processes of the third run once its first RL checkpoint is written
    deadline = time.time() + 600
    while time.time() < deadline:
        subdirs = [n for n in os.listdir(dirs["killed"]) if n.startswith("toy")]
        if subdirs and os.path.isdir(
            os.path.join(dirs["killed"], subdirs[0], "checkpoints", "rl", "1")
        ):
            break
        assert all(p.poll() is None for p in killed), "the run ended before it could be killed"
        time.sleep(0.2)
    for p in killed:
        p.send_signal(signal.SIGKILL)
    for p in killed:
        p.wait()
    run_killed = _run_dir(dirs["killed"])
    resumed = _launch(dirs["killed"], 2, 2, cache, resume=run_killed)  # while `one` finishes
    _finish(one)
    _finish(resumed)

    run_two, run_one = _run_dir(dirs["two"]), _run_dir(dirs["one"])
    # only process 0 prints the summary and writes the run's files
    summaries = [[ln for ln in out.splitlines() if ln.startswith("{")] for out in outs_two]
    assert json.loads(summaries[0][-1])["run_dir"] == run_two and not summaries[1]
    assert len(read_jsonl(os.path.join(run_two, "attempts.jsonl"))) == 1
    rl_rows = [r for r in read_jsonl(os.path.join(run_two, "metrics.jsonl")) if "rl/loss" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert all(r["rl/grad_norm"] > 0 for r in rl_rows)  # the RL steps move the weights

    # (c) disjoint blocks per process; together the one-process run's episodes
    calls_two, rows_two = _calls(run_two)
    calls_one, _ = _calls(run_one)
    assert calls_two == calls_one
    for step in (1, 2):
        by_process = [
            {r["episode"] for r in rows_two if r["step"] == step and r["process"] == p}
            for p in (0, 1)
        ]
        assert by_process[0] and by_process[1] and not by_process[0] & by_process[1]

    # (a) the same parameters as one process over the same devices, within tolerance
    p_two, p_one = _params(run_two), _params(run_one)
    tol = 1e-2 * STEPS * (SFT_LR + RL_LR)
    assert max(float(np.max(np.abs(p_two[k] - p_one[k]))) for k in p_two) <= tol

    # (b) killed and resumed: bitwise the uninterrupted run's parameters
    p_killed = _params(run_killed)
    assert all(np.array_equal(p_killed[k], p_two[k]) for k in p_two)
    assert len(read_jsonl(os.path.join(run_killed, "attempts.jsonl"))) == 2
