"""The RL update sharded over device meshes, and the main job over two processes (JSON lines).

Per mesh (``--meshes``, on 8 fake CPU devices unless the host has 8 devices; first a line for
one device, ``single``): one ``update_fn`` step of the benchmark MoE (``common.bench_model('moe',
'DDDD')``: 4 layers, d_model 256, 8 experts top-2, vocab 1024; batch 8 x 192 tokens) from the
same state as on one device.

  mesh                                 data/fsdp/expert/tensor sizes, e.g. "fsdp4_tensor2"
  update_max_abs_param_diff_vs_single  after one step, against the single-device step
  param_bytes_per_device, opt_bytes_per_device   on device 0 (addressable shards)
  ratio_bytes_vs_single                (params + opt state) per device / single-device bytes
  full_shard_ratio_x_n                 per-device bytes x N of the leaves sharded over every
                                       model axis (fsdp x expert x tensor = N) / their bytes
                                       (goal <= 1.1)
  step_ms (+ _min, _max)               median of --reps warm steps
  compiled_temp_bytes_per_device       XLA's temp bytes of the compiled sharded step

``--processes`` (default on): the smoke experiment through ``agentrl train`` as 2 processes x 2
fake devices (gloo), as 1 process x 4 devices, and as 2 processes killed with SIGKILL after
the first RL checkpoint and resumed: ``processes``, ``max_abs_param_diff_vs_1proc`` and
``resume_bitwise`` (final RL parameters of the resumed run equal the uninterrupted run's).

Usage: python benchmarks/scaling.py [--reps 5] [--meshes data8,fsdp8,...] [--no-processes]
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import NEW, PROMPT, bench_model, env_fields, time_ms  # noqa: E402

from agentrl_jax.model.transformer import Transformer, init_params  # noqa: E402
from agentrl_jax.precision import get_policy  # noqa: E402
from agentrl_jax.rl.state import RLConfig, rl_optimizer  # noqa: E402
from agentrl_jax.rl.update import make_update  # noqa: E402
from agentrl_jax.sharding import MeshConfig, activate  # noqa: E402
from agentrl_jax.train.placement import Placement  # noqa: E402

MESHES = {
    "data8": MeshConfig(data=8),
    "fsdp8": MeshConfig(fsdp=-1),
    "fsdp4_tensor2": MeshConfig(fsdp=4, tensor=2),
    "data2_fsdp2_expert2": MeshConfig(data=2, fsdp=2, expert=2),
}
BATCH = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("scaling")


def _batch(cfg, rng):
    t = PROMPT + NEW
    action = np.zeros((BATCH, t), bool)
    action[:, PROMPT:] = True
    return {
        "tokens": rng.integers(0, cfg.vocab_size, (BATCH, t)).astype(np.int32),
        "valid": np.ones((BATCH, t), bool),
        "action_mask": action,
        "advantages": np.where(action, rng.normal(size=(BATCH, t)), 0).astype(np.float32),
        "rollout_logprobs": np.where(action, -rng.random((BATCH, t)), 0).astype(np.float32),
    }


def _bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _full_shard_ratio(tree, shardings, mesh, n: int) -> float:
    sizes = dict(mesh.shape)
    dev = total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        axes = [a for e in s.spec if e for a in ((e,) if isinstance(e, str) else e)]
        if int(np.prod([sizes[a] for a in axes])) == n:
            dev += x.addressable_shards[0].data.nbytes
            total += x.nbytes
    return round(dev * n / total, 4) if total else None


def _stepper(step, state, batch):
    """A no-argument call of ``step`` that carries the (donated) state from call to call."""
    holder = [state]

    def call():
        holder[0], metrics = step(holder[0], batch, None)
        return metrics

    return call


def _fields(name: str, shape: dict, cfg) -> dict:
    return {
        "bench": "scaling",
        "variant": name,
        "mesh": name,
        "mesh_shape": shape,
        "model": "bench-moe",
        "pattern": cfg.layer_pattern,
        "batch": BATCH,
        "seq_len": PROMPT + NEW,
    }


def mesh_lines(names: list[str], reps: int):
    cfg = bench_model("moe", "DDDD")
    policy, rl = get_policy("fp32"), RLConfig(lr=1e-3)
    model = Transformer(cfg, policy)
    params = init_params(model, jax.random.key(0))
    batch = _batch(cfg, np.random.default_rng(0))
    tx = rl_optimizer(rl)
    copy = lambda: jax.tree.map(jnp.copy, params)  # noqa: E731
    single = Placement.default_device(cfg, policy)
    update = jax.jit(make_update(model, rl), donate_argnums=(0,))
    state = single.init_state(copy(), rl, jax.random.key(1), tx)
    compiled = update.lower(state, batch, None).compile()
    ref, _ = update(state, batch, None)
    ref_params = jax.device_get(ref.params)
    single_bytes = sum(x.nbytes for x in jax.tree.leaves((ref.params, ref.opt_state)))
    timing = time_ms(_stepper(update, ref, batch), reps=reps, warmup=1)
    yield {
        **_fields("single", {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, cfg),
        "param_bytes_per_device": sum(x.nbytes for x in jax.tree.leaves(ref.params)),
        "opt_bytes_per_device": sum(x.nbytes for x in jax.tree.leaves(ref.opt_state)),
        "ratio_bytes_vs_single": 1.0,
        **timing.fields("step_ms"),
        "compiled_temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
        **env_fields(),
    }
    for name in names:
        placement = Placement(MESHES[name], cfg, policy)
        shard = placement.step_shardings(tx, BATCH)
        step = shard.jit(make_update(model, rl), n_rest=1)
        state = placement.init_state(copy(), rl, jax.random.key(1), tx)
        placed = placement.place_batch(batch)
        with activate(shard.mesh, shard.cfg):  # as ``step`` traces: the MoE sees the mesh
            compiled = step.jitted.lower(state, placed, None).compile()
        state, _ = step(state, placed, None)
        diff = max(
            float(np.max(np.abs(np.asarray(a) - b)))
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params))
        )
        n = int(np.prod([placement.mesh.shape[a] for a in ("fsdp", "expert", "tensor")]))
        p_dev, o_dev = _bytes(state.params), _bytes(state.opt_state)
        ratio = _full_shard_ratio(
            (state.params, state.opt_state),
            (shard.state.params, shard.state.opt_state),
            placement.mesh,
            n,
        )
        timing = time_ms(_stepper(step, state, placed), reps=reps, warmup=1)
        yield {
            **_fields(name, dict(placement.mesh.shape), cfg),
            "update_max_abs_param_diff_vs_single": diff,
            "param_bytes_per_device": p_dev,
            "opt_bytes_per_device": o_dev,
            "ratio_bytes_vs_single": round((p_dev + o_dev) / single_bytes, 4),
            "full_shard_ratio_x_n": ratio,
            **timing.fields("step_ms"),
            "compiled_temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
            **env_fields(),
        }


# Two processes --------------------------------------------------------------------------------
SMOKE = [
    "experiments/toy.py:smoke=True",
    "--set=mesh.fsdp=-1",
    "--set=sft.steps=2",
    "--set=sft.batch_size=4",
    "--set=sft.buckets=(384,)",
    "--set=train.eval_before=False",
    "--set=train.rl_steps=2",
    "--set=train.ckpt_every=1",
    "--set=eval.modes=('sampled',)",
    "--set=eval.n_slots=4",
]


def _launch(workdir: str, processes: int, devices: int, resume: str | None = None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", AGENTRL_NO_PROGRESS="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    agentrl = os.path.join(os.path.dirname(sys.executable), "agentrl")
    cmd = [agentrl, "train", "--resume", resume] if resume else [agentrl, "train", *SMOKE]
    cmd += [] if resume else [f"--set=workdir={workdir}"]
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(processes):
        dist = ["--coordinator", f"localhost:{port}", "--num-processes", str(processes)]
        dist += ["--process-id", str(i)]
        procs.append(
            subprocess.Popen(
                cmd + (dist if processes > 1 else []),
                env=env,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    return procs


def _wait(procs) -> None:
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"agentrl train exited with {p.returncode}")


def _run_dir(workdir: str) -> str:
    (name,) = [n for n in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, n))]
    return os.path.join(workdir, name)


def _final_params(run_dir: str) -> list[np.ndarray]:
    from agentrl_jax.experiment import build, from_saved
    from agentrl_jax.metrics import load_config_json
    from agentrl_jax.train.checkpoint import restore_params, stage_dir

    s = build(from_saved(load_config_json(run_dir)))
    template = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    params, _ = restore_params(stage_dir(run_dir, "rl"), template)
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def process_line() -> dict:
    """The 2-process smoke run against 1 process and against its killed-and-resumed twin."""
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {k: os.path.join(tmp, k) for k in ("two", "one", "killed")}
        for d in dirs.values():
            os.mkdir(d)
        t0 = time.perf_counter()
        two, one, killed = (_launch(dirs[k], *pd) for k, pd in zip(dirs, ((2, 2), (1, 4), (2, 2))))
        while not any(
            os.path.isdir(os.path.join(dirs["killed"], n, "checkpoints", "rl", "1"))
            for n in os.listdir(dirs["killed"])
        ):
            if any(p.poll() is not None for p in killed):
                raise RuntimeError("the run to kill ended first")
            time.sleep(0.2)
        for p in killed:
            p.send_signal(signal.SIGKILL)
            p.wait()
        _wait(two)
        _wait(one)
        run_killed = _run_dir(dirs["killed"])
        _wait(_launch(dirs["killed"], 2, 2, resume=run_killed))
        wall = time.perf_counter() - t0
        p_two, p_one = _final_params(_run_dir(dirs["two"])), _final_params(_run_dir(dirs["one"]))
        p_killed = _final_params(run_killed)
    return {
        "bench": "scaling",
        "variant": "processes2x2",
        "mesh": "fsdp4",
        "processes": 2,
        "devices_per_process": 2,
        "experiment": "toy.py:smoke=True, 2 SFT + 2 RL steps",
        "max_abs_param_diff_vs_1proc": max(
            float(np.max(np.abs(a - b))) for a, b in zip(p_two, p_one)
        ),
        "resume_bitwise": all(np.array_equal(a, b) for a, b in zip(p_killed, p_two)),
        "wall_s": round(wall, 1),
        "backend": "cpu",
        "devices": 4,
        "jax_version": jax.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--no-processes", dest="processes", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if jax.device_count() != 8:
        raise SystemExit(f"scaling.py needs 8 devices, found {jax.device_count()}")
    for line in mesh_lines(args.meshes.split(","), args.reps):
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
    if args.processes:
        sys.stdout.write(json.dumps(process_line()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
