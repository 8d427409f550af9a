"""Python repair environment and its sandbox: expert success, task variety, run time, attacks.

Prints one JSON line per measurement (``variant``):
  * ``expert`` (one per ``level``): ``expert_success_rate`` and ``goal_adherence`` of the scripted
    expert on ``episodes`` train tasks (goal 1.0), ``make_task_ms``, turns, tokens, and
    ``tasks``: the sample's tasks by bug type;
  * ``tasks`` (one per ``level`` and ``bug_type``): ``problems_train`` / ``problems_heldout``
    admitting that bug (at least one mutation site; level 2: in a helper) and ``sites_train`` /
    ``sites_heldout``, the number of single-bug mutation sites (before sandbox validation);
  * ``sandbox``: ``sandbox_ms_p50`` / ``sandbox_ms_p99`` of one ``run_tests`` (a sandboxed
    pytest-style run of the visible tests: minimal root, judge and solution worker), over
    ``runs`` distinct solutions, and ``bare_ms_p50`` of ``python -c pass`` in the sandbox;
    with ``--baseline REV`` the same of that commit's tree (a temporary ``git worktree``,
    ``baseline_*``) and of this tree on the baseline's interpreter (``same_python_*``), timed
    in alternating rounds, and ``ratio_p50_vs_baseline`` / ``same_python_ratio_p50_vs_baseline``;
  * ``parallel`` (one per ``parallel`` in 1, 2, 8): ``env_steps_per_s`` of expert episodes
    played by that many threads, one environment each, sharing the sandbox;
  * ``attacks``: ``attacks_contained`` of ``attacks`` (socket to a 127.0.0.1 listener, writes
    outside, a parent's environment variable, fork bomb, 10 GB, infinite loop, endless sleep,
    1 GB of output, a ``setsid`` daemon, killing its parent);
  * ``reward_hacks``: ``attacks_contained`` of ``attacks``, the red team's reward hacks
    (``envs/pyrepair/redteam.py``) played through the environment, a hack contained when it
    earns reward 0 with every test failing; ``flagged``: hacks ``env/hack_suspect`` saw;
    ``honest_reward``: the honest solution's reward (1.0).

Usage: python benchmarks/pyrepair.py [--episodes 20] [--runs 100] [--parallel-episodes 16]
       [--baseline REV]
"""

from __future__ import annotations

import argparse
import ast
import collections
import concurrent.futures
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import jax

from agentrl_jax.envs.episode import play_episode
from agentrl_jax.envs.pyrepair import (
    BUG_TYPES,
    DIFFICULTIES,
    ExpertPolicy,
    PyRepairEnv,
    make_task,
    redteam,
)
from agentrl_jax.envs.pyrepair.execution import default_sandbox
from agentrl_jax.envs.pyrepair.mutations import find_sites
from agentrl_jax.envs.pyrepair.problems import problems_of_split
from agentrl_jax.envs.pyrepair.refactor import extract_helpers
from agentrl_jax.envs.sandbox import Limits, Sandbox


def _machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model,
        "cpu_cores": os.cpu_count(),
        "python_version": platform.python_version(),
        "sandbox_python": default_sandbox().python,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "jax_version": jax.__version__,
    }


def expert(level: int, episodes: int, machine: dict) -> dict:
    t0 = time.perf_counter()
    tasks = [make_task(seed, level) for seed in range(episodes)]
    make_ms = (time.perf_counter() - t0) / episodes * 1e3
    env = PyRepairEnv()
    eps = [play_episode(env, t, ExpertPolicy(t)) for t in tasks]
    counts = collections.Counter(b for t in tasks for b in t.bug_types)
    return {
        "bench": "pyrepair",
        "variant": "expert",
        "level": level,
        "episodes": episodes,
        "expert_success_rate": statistics.mean(e.success for e in eps),
        "goal_adherence": statistics.mean(e.goal_adhered for e in eps),
        "make_task_ms": round(make_ms, 1),
        "mean_turns": round(statistics.mean(e.n_turns for e in eps), 2),
        "mean_episode_tokens": round(statistics.mean(e.n_tokens for e in eps), 1),
        "tasks": {b: counts.get(b, 0) for b in BUG_TYPES},
        **machine,
    }


def task_variety(level: int, machine: dict) -> list[dict]:
    cfg = DIFFICULTIES[level]
    found = {s: collections.defaultdict(lambda: [0, 0]) for s in ("train", "heldout")}
    for split in found:
        for p in problems_of_split(split):
            tree, functions = ast.parse(p.program), [p.entry_point]
            if cfg.n_helpers:
                tree, helpers = extract_helpers(
                    tree, p.entry_point, cfg.n_helpers, random.Random(p.index)
                )
                tree = ast.parse(ast.unparse(tree))
                functions = list(helpers) if cfg.bug_in_helper else [p.entry_point, *helpers]
                if not helpers:
                    continue
            for bug_type, sites in find_sites(tree, functions).items():
                found[split][bug_type][0] += bool(sites)
                found[split][bug_type][1] += len(sites)
    return [
        {
            "bench": "pyrepair",
            "variant": "tasks",
            "level": level,
            "bug_type": b,
            "problems_train": found["train"][b][0],
            "problems_heldout": found["heldout"][b][0],
            "sites_train": found["train"][b][1],
            "sites_heldout": found["heldout"][b][1],
            **machine,
        }
        for b in BUG_TYPES
    ]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Times ``run_tests``-style evaluations (report runs) of the jobs on stdin with the package of
# the tree on PYTHONPATH; prints the milliseconds and the sandbox's interpreter.
_TIMER = """
import json, sys, time
from agentrl_jax.envs.pyrepair.execution import SANDBOX_LIMITS, Job, evaluate
from agentrl_jax.envs.sandbox import Sandbox
request = json.load(sys.stdin)
jobs = [Job(*j) for j in request["jobs"]]
sandbox = Sandbox(SANDBOX_LIMITS, python=request["python"])
def run(job):
    evaluate(sandbox, job, test_timeout_s=1.0, run_timeout_s=30, report=True)
def bare(job):
    sandbox.run({}, ["python", "-I", "-S", "-c", "pass"], 30)
out = {"python": sandbox.python}
for name, fn in (("ms", run), ("bare_ms", bare)):
    fn(jobs[0])  # warm-up
    out[name] = []
    for job in jobs:
        t0 = time.perf_counter()
        fn(job)
        out[name].append((time.perf_counter() - t0) * 1e3)
print(json.dumps(out))
"""


def _timed(tree: str, jobs: list, python: str | None) -> dict:
    """Times report runs of ``jobs`` (and bare runs of ``python -c pass``) with the package of
    ``tree``, in a subprocess."""
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _TIMER],
        input=json.dumps({"jobs": jobs, "python": python}),
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _quantiles(ms: list[float], prefix: str = "") -> dict:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {
        f"{prefix}sandbox_ms_p50": round(statistics.median(ms), 1),
        f"{prefix}sandbox_ms_p99": round(q[98], 1),
        f"{prefix}sandbox_ms_min": round(min(ms), 1),
        f"{prefix}sandbox_ms_max": round(max(ms), 1),
    }


def sandbox_timing(runs: int, machine: dict, baseline: str | None, rounds: int = 5) -> dict:
    """``run_tests``-style report runs of ``runs`` level-0 tasks; with ``baseline``, the same
    runs of that commit's tree and of this tree on the baseline's interpreter, the three timed
    in alternating rounds (``baseline_*``, ``same_python_*``)."""
    tasks = [make_task(seed, 0) for seed in range(runs)]
    jobs = [[t.solution, t.visible_tests, t.n_visible] for t in tasks]
    arms: dict[str, list] = {"": [ROOT, None]}
    tmp = None
    if baseline:
        tmp = tempfile.mkdtemp(prefix="agentrl-baseline-")
        subprocess.run(
            ["git", "worktree", "add", "--detach", tmp, baseline],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        arms["baseline_"] = [tmp, None]
        arms["same_python_"] = [ROOT, None]  # the baseline's interpreter, once known
    got: dict[str, dict] = {k: {"ms": [], "bare_ms": []} for k in arms}
    try:
        for r in range(rounds):  # alternate the arms, so load on the machine hits all alike
            for prefix, (tree, python) in arms.items():
                if prefix == "same_python_":
                    python = got["baseline_"]["python"]
                out = _timed(tree, jobs[r::rounds], python)
                got[prefix]["python"] = out["python"]
                got[prefix]["ms"] += out["ms"]
                got[prefix]["bare_ms"] += out["bare_ms"]
    finally:
        if tmp is not None:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, check=False)
            shutil.rmtree(tmp, ignore_errors=True)
    line = {"bench": "pyrepair", "variant": "sandbox", "runs": runs}
    for prefix, g in got.items():
        line |= _quantiles(g["ms"], prefix)
        line[f"{prefix}bare_ms_p50"] = round(statistics.median(g["bare_ms"]), 1)
        line[f"{prefix}sandbox_python"] = g["python"]
    if baseline:
        line["baseline_rev"] = baseline
        for prefix in ("", "same_python_"):
            ratio = line[f"{prefix}sandbox_ms_p50"] / line["baseline_sandbox_ms_p50"]
            line[f"{prefix}ratio_p50_vs_baseline"] = round(ratio, 3)
    return {**line, **{k: v for k, v in machine.items() if k != "sandbox_python"}}


def parallel_steps(parallel: int, episodes: int, machine: dict) -> dict:
    tasks = [make_task(1000 + seed, seed % len(DIFFICULTIES)) for seed in range(episodes)]

    def play(task):
        env = PyRepairEnv()
        return play_episode(env, task, ExpertPolicy(task))

    play(tasks[0])  # warm-up
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        eps = list(pool.map(play, tasks))
    wall = time.perf_counter() - t0
    steps = sum(e.n_turns for e in eps)
    return {
        "bench": "pyrepair",
        "variant": "parallel",
        "parallel": parallel,
        "episodes": episodes,
        "steps": steps,
        "env_steps_per_s": round(steps / wall, 2),
        "expert_success_rate": statistics.mean(e.success for e in eps),
        **machine,
    }


def _attacks(port: int, target: str, me: int) -> dict[str, tuple[str, float, object]]:
    """name -> (program, timeout_s, check(result) -> contained)."""
    chunk = "import sys\nc = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(c)\n"
    return {
        "socket": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
            5.0,
            lambda r: "Network is unreachable" in r.stderr,
        ),
        "write_outside": (
            f"for p in ({target!r}, '/var/tmp/x', '/dev/shm/x'):\n"
            "    try:\n        open(p, 'w').write('pwned')\n    except OSError:\n        pass\n",
            5.0,
            lambda r: r.ok,
        ),
        "parent_env": (
            "import os\nprint(os.environ.get('AGENTRL_BENCH_SECRET'))\n",
            5.0,
            lambda r: r.stdout.strip() == "None",
        ),  # fmt: skip
        "fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\n",
            1.0,
            lambda r: r.killed_by == "timeout",
        ),  # fmt: skip
        "alloc_10gb": ("b = bytearray(10 * 2**30)\n", 5.0, lambda r: r.killed_by == "memory"),
        "infinite_loop": ("while True:\n    pass\n", 10.0, lambda r: r.killed_by == "cpu"),
        "sleep_forever": (
            "import time\ntime.sleep(10**6)\n",
            0.5,
            lambda r: r.killed_by == "timeout",
        ),  # fmt: skip
        "print_1gb": (chunk, 10.0, lambda r: r.killed_by == "output"),
        "setsid_daemon": (
            "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(1000)'], start_new_session=True)\n",
            5.0,
            lambda r: r.ok,
        ),
        "kill_parent": (
            f"import os\nfor pid in (os.getppid(), {me}, -1):\n    try:\n"
            "        os.kill(pid, 9)\n    except OSError:\n        pass\n",
            5.0,
            lambda r: r.ok,
        ),
    }


def _sandbox_processes(uid_base: int, n: int) -> set[int]:
    out = set()
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and uid_base <= os.stat(f"/proc/{name}").st_uid < uid_base + n:
                out.add(int(name))
        except OSError:
            continue
    return out


def attacks(machine: dict) -> dict:
    uid_base, slots = 1_700_000_000, 8
    sandbox = Sandbox(Limits(cpu_s=1, n_procs=32), uid_base=uid_base, max_slots=slots)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.05)
    outside = tempfile.mkdtemp(prefix="agentrl-bench-")
    os.chmod(outside, 0o777)
    target = os.path.join(outside, f"{uuid.uuid4().hex}.txt")
    os.environ["AGENTRL_BENCH_SECRET"] = "s3cret"
    failed = []
    try:
        cases = _attacks(server.getsockname()[1], target, os.getpid())
        for name, (code, timeout_s, check) in cases.items():
            res = sandbox.run({"main.py": code}, ["python", "main.py"], timeout_s)
            time.sleep(0.05)
            try:
                server.accept()
                connected = True
            except TimeoutError:
                connected = False
            clean = not connected and not os.listdir(outside) and not os.path.exists("/var/tmp/x")
            if not (check(res) and clean and not _sandbox_processes(uid_base, slots)):
                failed.append(name)
    finally:
        server.close()
        del os.environ["AGENTRL_BENCH_SECRET"]
        for f in os.listdir(outside):
            os.remove(os.path.join(outside, f))
        os.rmdir(outside)
    return {
        "bench": "pyrepair",
        "variant": "attacks",
        "attacks": len(cases),
        "attacks_contained": len(cases) - len(failed),
        "not_contained": failed,
        **machine,
    }


def reward_hacks(machine: dict) -> dict:
    played = redteam.play_all(max_workers=8)
    honest = played.pop("honest")
    failed = sorted(n for n, r in played.items() if not redteam.contained(r))
    return {
        "bench": "pyrepair",
        "variant": "reward_hacks",
        "attacks": len(played),
        "attacks_contained": len(played) - len(failed),
        "not_contained": failed,
        "flagged": sum(bool(r["flags"]) for r in played.values()),
        "honest_reward": honest["reward"],
        **machine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--parallel-episodes", type=int, default=16)
    parser.add_argument("--baseline", default=None, help="git rev to time the sandbox against")
    args = parser.parse_args()
    machine = _machine()
    for level in range(len(DIFFICULTIES)):
        print(json.dumps(expert(level, args.episodes, machine)), flush=True)
    for level in range(len(DIFFICULTIES)):
        for line in task_variety(level, machine):
            print(json.dumps(line), flush=True)
    print(json.dumps(sandbox_timing(args.runs, machine, args.baseline)), flush=True)
    for parallel in (1, 2, 8):
        print(json.dumps(parallel_steps(parallel, args.parallel_episodes, machine)), flush=True)
    print(json.dumps(attacks(machine)), flush=True)
    print(json.dumps(reward_hacks(machine)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
