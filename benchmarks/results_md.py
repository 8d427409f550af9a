"""Benchmark results on file: run benchmarks into ``benchmarks/results/``, render docs/results.md.

Two steps, each optional:

1. ``--run``: runs the benchmark scripts of ``SUITE`` (or ``--only`` some), each under its own
   ``--timeout``, with this Python, and appends every JSON line they print to
   ``<results-dir>/<machine>-<date>.jsonl``, adding the machine's fields to each line:
   ``machine`` (the file-name slug), ``cpu_model``, ``cpu_cores``, ``cpu_flags`` (the vector
   extensions that decide CPU matmul speed), ``accelerator`` and ``accelerator_count``,
   ``python_version``, ``jaxlib_version``, ``load_avg_1m`` / ``load_avg_5m`` (when the line
   arrived), ``measured_at`` (UTC), ``git_commit`` and ``command``. A script that fails or runs
   past its timeout leaves a line with ``error`` instead.
2. rendering (always, unless ``--no-render``): every ``*.jsonl`` in the results directory is
   read and the tables of ``docs/results.md`` are rewritten between their markers,
   ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` (NAME a benchmark's ``bench``
   value; ``sources`` lists the files). One table per benchmark, machine and date, headed by
   the machine, its versions and the commands; the text outside the markers is kept as it is.

Usage::

    python benchmarks/results_md.py                        # render only
    python benchmarks/results_md.py --run --only env,update --reps 3
    python benchmarks/results_md.py --check                # exit 1 if docs/results.md is stale
    agentrl bench results_md -- --run                      # the same through the CLI

Logs of the benchmark scripts go to stderr; this script prints one JSON line per file it wrote.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
DOC = os.path.join(ROOT, "docs", "results.md")

# Script -> arguments of the default run (small repetition counts: a shared CPU's run finishes
# in tens of minutes). ``--reps N`` replaces the repetition flags of the scripts that take them.
SUITE: dict[str, list[str]] = {
    "compile_depth": ["--reps", "1"],
    "env": ["--episodes", "20", "--reps", "3"],
    "parity": [],
    "rollout": ["--reps", "3"],
    "teacher_forced": ["--reps", "3"],
    "update": ["--reps", "3", "--iter-reps", "2"],
    "kernels": ["--reps", "3"],
    "scaling": ["--reps", "3"],
    "long_context": ["--contexts", "8192", "--reps", "5"],
    "matmul_peak": [],
    "decode_impls": ["--reps", "5"],
    "decode_profile": ["--reps", "3"],
    "update_profile": ["--reps", "3"],
}
REPS_FLAGS: dict[str, tuple[str, ...]] = {
    "compile_depth": ("--reps",),
    "env": ("--reps",),
    "rollout": ("--reps",),
    "teacher_forced": ("--reps",),
    "update": ("--reps", "--iter-reps"),
    "kernels": ("--reps",),
    "scaling": ("--reps",),
    "long_context": ("--reps",),
    "matmul_peak": ("--reps",),
    "decode_impls": ("--reps",),
    "decode_profile": ("--reps",),
    "update_profile": ("--reps",),
    "rollout_ab": ("--reps",),
    "rollout_baseline": ("--reps",),
    "update_baseline": ("--reps",),
}
BASELINES: dict[str, list[str]] = {"rollout_baseline": [], "update_baseline": ["--reps", "3"]}
# Scripts run only when named in --only: too long for the default run (async_rl, tens of
# minutes), or an A/B of one fast-path switch (rollout_ab).
LONG: dict[str, list[str]] = {"async_rl": [], "rollout_ab": ["--switch", "PACK_WEIGHTS"]}

# Columns of each benchmark's table, "key=header" (header = key when left out), "; "-separated;
# "bench:variant" keys give a benchmark one table per variant. Every table ends with the load.
COLUMNS: dict[str, str] = {
    "compile_depth": (
        "variant; compile_s_4=compile s, 4 layers; compile_s_32=32; compile_s_96=96; "
        "ratio_96_vs_4=ratio 96/4; compile_cpu_s_4=CPU s, 4; compile_cpu_s_96=CPU s, 96; "
        "ratio_cpu_96_vs_4=CPU ratio 96/4"
    ),
    "env": (
        "difficulty=level; variant; us_per_step=us/step; us_per_step_min=min; "
        "us_per_step_max=max; make_task_us=make_task us; mean_episode_tokens=tokens/episode; "
        "mean_turns=turns; expert_success_rate=expert success"
    ),
    "parity": (
        "policy; kv_option=KV; replay; decode_kernel=decode kernel; "
        "max_abs_dlogp=max abs dlogp; mean_abs_dlogp=mean abs dlogp; "
        "routing_agreement=routing agreement; n_tokens=tokens; int8_tokens=int8 tokens; "
        "evicted_tokens=evicted; kv_bytes_ratio=KV bytes ratio"
    ),
    "rollout": (
        "model; pattern; batch; policy; decode_kernel=decode kernel; "
        "paged_decode_impl=paged decode; new_tokens_per_s=new tok/s; "
        "tokens_per_s=tok/s (with prompt); "
        "decode_tokens_per_s=decode tok/s; prefill_ms=prefill ms; "
        "nocache_tokens_per_s=no-cache tok/s; speedup_vs_nocache=vs no-cache; "
        "compile_s=compile s; kv_bytes_ratio_vs_dense=KV bytes vs dense (8k)"
    ),
    "vs_peers": (
        "variant; new_tokens_per_s=new tok/s; best_peer=best peer; "
        "tunix-Sampler_new_tokens_per_s=Tunix new tok/s; "
        "hf-transformers-generate_new_tokens_per_s=HF new tok/s; "
        "hf-transformers-generate_torch_threads=HF threads; "
        "ratio_vs_best_peer=vs best peer; step_ms=step ms; micro_batch=micro-batch; "
        "torch_step_ms=PyTorch step ms; torch_threads=PyTorch threads; "
        "torch_micro_batch=PyTorch micro-batch; ratio_vs_torch=vs PyTorch; goal_ratio=goal; "
        "goal_ms=goal ms; matmul_floor_ms=matmul floor ms; goal_over_floor=goal / floor; "
        "chain_ms=matmul chain ms; chain_source=chain from; goal_over_chain=goal / chain; rounds"
    ),
    "matmul_peak": (
        "framework; dtype; shape=M x K x N; chain_gflop=chain GFLOP; gflops=GFLOP/s (best); "
        "gflops_median=median; ms=ms (best); "
        "update_matmul_floor_ms_dense=update floor ms, dense; "
        "update_matmul_floor_ms_moe=update floor ms, MoE; threads"
    ),
    "teacher_forced": (
        "model; pattern; batch; mode; policy; tokens_per_s=tok/s; ms; ms_min=min; ms_max=max; "
        "ratio_vs_fast=vs fast; max_abs_dlogp_vs_fast=max abs dlogp vs fast"
    ),
    "update": (
        "variant; policy; micro_batch=micro-batch; expert_matmul=expert matmuls; "
        "step_ms=step ms; step_ms_min=min; step_ms_max=max; "
        "ratio_vs_first=vs first line (same process); "
        "tokens_per_s=tok/s; compile_s=compile s; rl_iteration_ms=RL iteration ms; "
        "rollout_ms=of it rollout ms"
    ),
    "kernels": (
        "kernel=op; impl; T; batch; head_dim=head dim; kv_dtype=KV dtype; ms_fwd=fwd ms; "
        "ms_fwd_bwd=fwd+bwd ms; tflops=TFLOP/s; gb_per_s=GB/s; ratio_vs_cudnn=vs cuDNN; "
        "ratio_vs_dpa_xla_fwd=vs XLA dot_product_attention; rel_err_vs_reference=rel. err."
    ),
    "long_context": (
        "variant; context; kv_option=KV; policy; kv_device_bytes=KV bytes; "
        "max_context_in_pool=context in pool; paged_decode_impl=paged decode; "
        "decode_tokens_per_s=decode tok/s; sparse_speedup_vs_dense=sparse vs dense; "
        "max_abs_dlogp=max abs dlogp"
    ),
    "decode_impls": (
        "variant; same_tokens=same tokens; xla_new_tokens_per_s=XLA new tok/s; "
        "cpu_new_tokens_per_s=C++ new tok/s; speedup_cpu_vs_xla=C++ vs XLA; "
        "xla_masked_tokens_per_s=XLA masked tok/s; cpu_masked_tokens_per_s=C++ masked tok/s; "
        "xla_gather_tokens_per_s=XLA gather tok/s; cpu_gather_tokens_per_s=C++ gather tok/s; "
        "xla_sparse_vs_dense=XLA sparse vs dense; cpu_sparse_vs_dense=C++ sparse vs dense"
    ),
    "decode_profile": (
        "variant; step_us=step us; prefill_ms=prefill ms; decode_share=decode share; "
        "attention_us=attention us; ffn_us=FFN us; lm_head_us=LM head us; "
        "sampling_us=sampling us; other_us=other us; ops_over_wall=ops / wall; "
        "paged_decode_impl=paged decode; weight_mb=weights MB; kv_mb_per_step=KV MB/step; "
        "stream_gb_per_s=read GB/s; floor_us=floor us; step_over_floor=step / floor"
    ),
    "rollout_ab": (
        "variant; off_ms=off ms; on_ms=on ms; ratio=on / off; on_ms_min=on min; "
        "on_ms_max=on max; off_ms_min=off min; off_ms_max=off max; same_tokens=same tokens; reps"
    ),
    "update_profile": (
        "variant; step_ms=step ms; attention_fwd_ms=attention fwd; attention_bwd_ms=attention bwd; "
        "ffn_fwd_ms=FFN fwd; ffn_bwd_ms=FFN bwd; lm_head_fwd_ms=LM head fwd; "
        "lm_head_bwd_ms=LM head bwd; other_fwd_ms=other fwd; other_bwd_ms=other bwd; "
        "ops_over_wall=ops / wall; eigen_threads=Eigen threads"
    ),
    "rollout_baseline": (
        "variant; threads; tokens_per_s=tok/s; decode_tokens_per_s=decode tok/s; "
        "prefill_ms=prefill ms"
    ),
    "update_baseline": (
        "variant; step_ms=step ms; step_ms_min=min; step_ms_max=max; tokens_per_s=tok/s; "
        "compile_s=compile s"
    ),
    "scaling": (
        "mesh; processes; update_max_abs_param_diff_vs_single=param diff vs 1 device; "
        "max_abs_param_diff_vs_1proc=param diff vs 1 process; resume_bitwise=resume bitwise; "
        "param_bytes_per_device=param bytes/device; opt_bytes_per_device=opt bytes/device; "
        "ratio_bytes_vs_single=bytes vs 1 device; full_shard_ratio_x_n=full shards x N; "
        "step_ms=step ms; compiled_temp_bytes_per_device=temp bytes/device"
    ),
    "hf_parity": (
        "variant; max_abs_logit_diff=max abs logit diff; greedy_tokens_equal=greedy equal (of 32); "
        "max_abs_logprob_diff=max abs logprob diff; load_s=load s; params"
    ),
    "pyrepair:expert": (
        "level; episodes; expert_success_rate=expert success; goal_adherence=goal adherence; "
        "mean_turns=turns; mean_episode_tokens=tokens/episode; make_task_ms=make task ms"
    ),
    "pyrepair:tasks": (
        "level; bug_type=bug type; problems_train=problems train; "
        "problems_heldout=problems held-out; sites_train=sites train; sites_heldout=sites held-out"
    ),
    "pyrepair:sandbox": (
        "runs; sandbox_ms_p50=p50 ms; sandbox_ms_p99=p99 ms; sandbox_ms_min=min ms; "
        "sandbox_ms_max=max ms"
    ),
    "pyrepair:parallel": (
        "parallel; episodes; steps; env_steps_per_s=env steps/s; expert_success_rate=expert success"
    ),
    "pyrepair:attacks": "attacks; attacks_contained=contained",
    "async_rl:throughput": (
        "env; max_staleness=k; env_overlap=env overlap; sync_every_rounds=switch every; "
        "steps_per_hour=steps/h; "
        "tokens_per_s=tok/s; step_s=step s; rollout_s=rollout s; update_s=update s; "
        "tool_s=tool s; tool_share=tool share (of step); cpu_s=CPU s; child_cpu_s=test runs CPU s; "
        "cores_busy=cores busy; learner_wait_s=learner wait s; "
        "rollout_wait_s=rollout wait s; lag_mean=lag; speedup_async_vs_sync=speedup vs k=0"
    ),
    "async_rl:heldout": (
        "env; mode; steps; heldout_success_k0=success k=0; heldout_success_k1=success k=1; "
        "paired_delta_k1_minus_k0=k=1 - k=0; paired_stderr=paired stderr; n"
    ),
    "async_rl:resume": "config; resume_bitwise=resume bitwise",
    "async_rl:mismatch": (
        "config; mismatch_lag=lag; mismatch_numerics=numerics; mismatch_routing=routing; "
        "mismatch_kv=KV; mismatch_lag_share=lag share; mismatch_numerics_share=numerics share; "
        "mismatch_routing_share=routing share; mismatch_kv_share=KV share; "
        "extra_passes=extra passes; extra_s=extra s; update_s=update s"
    ),
}
_GENERIC_MAX_COLUMNS = 8
_UNIT = re.compile(r"(_ms|_s|_us|_bytes|_per_s|ratio.*|speedup.*)$")
_MARKER = re.compile(
    r"<!-- results:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S
)
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "neon", "sve")


# ---------------------------------------------------------------------------------------------
# The machine


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return model, flags
    name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    fam = re.search(r"^cpu family\s*:\s*(\d+)$", text, re.M)
    mod = re.search(r"^model\s*:\s*(\d+)$", text, re.M)
    if name:
        model = name.group(1).strip()
        if fam and mod:
            model += f" (family {fam.group(1)}, model {mod.group(1)})"
    found = re.search(r"^(flags|Features)\s*:\s*(.+)$", text, re.M)
    if found:
        have = set(found.group(2).split())
        flags = [f for f in _FLAGS if f in have]
    return model, flags


def _accelerator(python: str) -> tuple[str, int, str | None]:
    """(device kind or 'none', count, jaxlib version) from a child process (this process keeps
    no device, so a GPU's memory stays free for the benchmarks)."""
    code = (
        "import json, jax, jaxlib; d = jax.devices(); "
        "print(json.dumps([d[0].platform, d[0].device_kind, len(d), jaxlib.__version__]))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=300, check=True
        ).stdout
        plat, kind, n, jaxlib_version = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return "unknown", 0, None
    return ("none", 0, jaxlib_version) if plat == "cpu" else (kind, n, jaxlib_version)


def _git_commit() -> str | None:
    """HEAD's short hash, with ``-dirty`` when tracked files differ from it."""
    git = ["git", "-C", ROOT]
    try:
        run = lambda *args: subprocess.run(
            [*git, *args], capture_output=True, text=True, check=True
        ).stdout.strip()
        head, dirty = run("rev-parse", "--short=12", "HEAD"), run("status", "--porcelain", "-uno")
    except (subprocess.SubprocessError, OSError):
        return None
    return head + ("-dirty" if dirty else "")


def machine_fields(python: str = sys.executable) -> dict[str, Any]:
    """The fields every result line of this machine carries (see the module docstring)."""
    cpu, flags = _cpuinfo()
    cores = os.cpu_count() or 0
    kind, n, jaxlib_version = _accelerator(python)
    slug = (
        _slug(kind) if kind not in ("none", "unknown") else f"{_slug(cpu.split(' (')[0])}-{cores}c"
    )
    return {
        "machine": slug,
        "cpu_model": cpu,
        "cpu_cores": cores,
        "cpu_flags": flags,
        "accelerator": kind,
        "accelerator_count": n,
        "python_version": platform.python_version(),
        "jaxlib_version": jaxlib_version,
        "git_commit": _git_commit(),
    }


def _load() -> dict[str, float | None]:
    try:
        one, five, _ = os.getloadavg()
    except (OSError, AttributeError):
        return {"load_avg_1m": None, "load_avg_5m": None}
    return {"load_avg_1m": round(one, 2), "load_avg_5m": round(five, 2)}


# ---------------------------------------------------------------------------------------------
# Running


def run_script(
    name: str,
    args: Sequence[str],
    out_path: str,
    fields: Mapping[str, Any],
    *,
    python: str = sys.executable,
    timeout_s: float = 900.0,
    script_dir: str = HERE,
) -> int:
    """Runs ``<script_dir>/<name>.py args`` and appends its JSON lines, with ``fields``, to
    ``out_path``; returns how many lines it appended (an error line counts).

    Lines are appended as they arrive, so a timeout keeps what was measured before it. A
    non-zero exit or a timeout appends ``{"bench": name, "error": ...}`` with the same fields.
    """
    script = os.path.join(script_dir, f"{name}.py")
    cmd = [python, script, *args]
    shown = " ".join(["python", os.path.relpath(script, ROOT), *args])
    base = {**fields, "command": shown}
    n = 0
    with tempfile.TemporaryFile(mode="w+") as err, open(out_path, "a", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for raw in _lines_until(proc, deadline):
            text = raw.strip()
            if not text.startswith("{"):
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            line.setdefault("bench", name)
            stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            out.write(json.dumps({**line, **base, **_load(), "measured_at": stamp}) + "\n")
            out.flush()
            n += 1
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            rc = proc.wait()
        if timed_out or rc != 0:
            err.seek(0)
            tail = [ln for ln in err.read().splitlines() if ln.strip()][-1:] or [""]
            why = f"timeout after {timeout_s:.0f} s" if timed_out else f"exit {rc}: {tail[0][:300]}"
            stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
            out.write(
                json.dumps({"bench": name, "error": why, **base, **_load(), "measured_at": stamp})
                + "\n"
            )
            n += 1
            sys.stderr.write(f"{name}: {why}\n")
    return n


def _lines_until(proc: subprocess.Popen, deadline: float) -> Iterable[str]:
    """The child's stdout lines as they arrive, until it closes stdout or ``deadline``
    (``time.monotonic`` seconds) passes."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return
        if line is None:
            return
        yield line


def with_reps(name: str, args: Sequence[str], reps: int | None) -> list[str]:
    """``args`` with every repetition flag of script ``name`` set to ``reps`` (None: as is)."""
    args = list(args)
    if reps is None:
        return args
    for flag in REPS_FLAGS.get(name, ()):
        if flag in args:
            args[args.index(flag) + 1] = str(reps)
        else:
            args += [flag, str(reps)]
    return args


# ---------------------------------------------------------------------------------------------
# Rendering


def read_results(results_dir: str) -> list[dict[str, Any]]:
    """Every line of every ``*.jsonl`` in ``results_dir`` (files in name order), each with
    ``_file`` (the file's base name) added.

    Raises:
      ValueError: a line that is not a JSON object, or one without ``bench`` or ``machine``.
    """
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.jsonl"))):
        base = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            for i, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{base}:{i}: not JSON ({e})") from e
                if not isinstance(row, dict) or "bench" not in row or "machine" not in row:
                    raise ValueError(f"{base}:{i}: a result line needs 'bench' and 'machine'")
                rows.append({**row, "_file": base})
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _columns(bench: str, rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    if bench in COLUMNS:
        items = [c.partition("=") for c in COLUMNS[bench].split("; ")]
        return [(k, h or k) for k, _, h in items]
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if _UNIT.search(k) and k not in keys]
    return [("variant", "variant")] + [(k, k) for k in keys[:_GENERIC_MAX_COLUMNS]]


def _span(values: Iterable[Any]) -> str:
    vals = sorted({v for v in values if v is not None})
    if not vals:
        return "unknown"
    return _fmt(vals[0]) if len(vals) == 1 else f"{_fmt(vals[0])}-{_fmt(vals[-1])}"


def _header(rows: Sequence[Mapping[str, Any]]) -> str:
    r = rows[0]
    flags = ", ".join(r.get("cpu_flags") or []) or "none listed"
    acc = r.get("accelerator") or "unknown"
    acc = "no accelerator" if acc == "none" else f"{r.get('accelerator_count', '?')} x {acc}"
    jax_v = _span(x.get("jax_version") for x in rows)
    date = _span((x.get("measured_at") or "")[:10] or None for x in rows)
    commits = _span(x.get("git_commit") for x in rows)
    commands = sorted({x.get("command") for x in rows if x.get("command")})
    out = [
        f"**{r['machine']}**, {date}: CPU {r.get('cpu_model', 'unknown')}, "
        f"{r.get('cpu_cores', '?')} cores (vector extensions: {flags}), {acc}; "
        f"jax {jax_v}, jaxlib {r.get('jaxlib_version') or 'unknown'}, "
        f"Python {r.get('python_version', 'unknown')}; commit {commits}; "
        f"load average (1 min) {_span(x.get('load_avg_1m') for x in rows)} while measuring "
        f"(`{r['_file']}`).",
    ]
    if commands:
        out.append("Command: " + "; ".join(f"`{c}`" for c in commands) + ".")
    return " ".join(out)


def render_table(bench: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """One machine's rows of one benchmark as a Markdown table under its header line."""
    cols = _columns(bench, [r for r in rows if "error" not in r]) + [("load_avg_1m", "load")]
    lines = [_header(rows), ""]
    lines.append("| " + " | ".join(h for _, h in cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for r in rows:
        if "error" in r:
            lines.append(f"| not measured: {_fmt(r['error'])} |" + " |" * (len(cols) - 1))
        elif "skipped" in r:
            cells = [_fmt(r.get(k)) for k, _ in cols]
            cells[-2] = f"skipped: {_fmt(r['skipped'])}"
            lines.append("| " + " | ".join(cells) + " |")
        else:
            lines.append("| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def render_tables(bench: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """One file's rows of ``bench``: one table, or one per variant with ``bench:variant``
    columns (rows of other variants are left out)."""
    keys = [k for k in COLUMNS if k.startswith(bench + ":")]
    if not keys:
        return render_table(bench, rows)
    parts = []
    for key in keys:
        mine = [r for r in rows if r.get("variant") == key.partition(":")[2] or "error" in r]
        if mine:
            parts.append(render_table(key, mine))
    return "\n\n".join(parts)


def render_bench(bench: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """All tables of ``bench``: one per results file (machine and date), newest first."""
    mine = [r for r in rows if r["bench"] == bench]
    if not mine:
        return "No measurements on file yet."
    by_file: dict[str, list[Mapping[str, Any]]] = {}
    for r in mine:
        by_file.setdefault(r["_file"], []).append(r)
    newest = sorted(by_file, key=lambda f: (f[-16:], f), reverse=True)
    return "\n\n".join(render_tables(bench, by_file[f]) for f in newest)


def render_sources(rows: Sequence[Mapping[str, Any]]) -> str:
    """A list of the result files with their machines and line counts."""
    files: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        files.setdefault(r["_file"], []).append(r)
    if not files:
        return "No result files yet."
    out = []
    for name in sorted(files):
        benches = sorted({r["bench"] for r in files[name]})
        out.append(
            f"- `benchmarks/results/{name}`: {len(files[name])} lines "
            f"({', '.join(benches)}), machine `{files[name][0]['machine']}`"
        )
    return "\n".join(out)


def render_doc(text: str, rows: Sequence[Mapping[str, Any]]) -> tuple[str, list[str]]:
    """``text`` with every marked block re-rendered from ``rows``.

    Returns:
      (new text, benchmarks that have rows but no marker in the text).
    """
    seen = set()

    def block(m: re.Match) -> str:
        name = m.group("name")
        seen.add(name)
        body = render_sources(rows) if name == "sources" else render_bench(name, rows)
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    new = _MARKER.sub(block, text)
    unplaced = sorted({r["bench"] for r in rows} - seen)
    return new, unplaced


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the benchmarks first")
    ap.add_argument("--only", default="", help="comma list of scripts to run (default: SUITE)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions for every script")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    ap.add_argument(
        "--baseline-python", default="", help="a Python with torch + transformers: run baselines"
    )
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--doc", default=DOC)
    ap.add_argument("--no-render", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 if --doc is not up to date")
    a = ap.parse_args(argv)
    if a.reps is not None and a.reps < 1:
        raise ValueError(f"--reps={a.reps} must be >= 1")
    if a.run:
        suite = {**SUITE, **LONG}
        if a.baseline_python:
            suite.update(BASELINES)
        names = [n for n in a.only.split(",") if n] or list(SUITE)
        unknown = [n for n in names if n not in suite]
        if unknown:
            raise ValueError(f"--only names {unknown}; allowed: {', '.join(suite)}")
        os.makedirs(a.results_dir, exist_ok=True)
        fields = machine_fields()
        date = dt.datetime.now(dt.UTC).date().isoformat()
        path = os.path.join(a.results_dir, f"{fields['machine']}-{date}.jsonl")
        for name in names:
            python = a.baseline_python if name in BASELINES else sys.executable
            n = run_script(
                name, with_reps(name, suite[name], a.reps), path, fields, python=python,
                timeout_s=a.timeout,
            )  # fmt: skip
            print(json.dumps({"script": name, "lines": n, "file": os.path.relpath(path, ROOT)}))
    if a.no_render:
        return 0
    rows = read_results(a.results_dir)
    with open(a.doc, encoding="utf-8") as f:
        text = f.read()
    new, unplaced = render_doc(text, rows)
    for bench in unplaced:
        sys.stderr.write(f"{bench}: results on file but no <!-- results:{bench} --> marker\n")
    if a.check:
        return 0 if new == text else 1
    if new != text:
        with open(a.doc, "w", encoding="utf-8") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
