"""benchmarks/vs_peers.sh --summarize: the ratio lines from a run's raw lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "vs_peers.sh"
ENV = {"backend": "cpu", "devices": 1, "jax_version": "0"}


def _summarize(tmp_path, rows, **env):
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), str(raw), "--summarize"],
        capture_output=True, text=True, env={**os.environ, "PY": sys.executable, **env},
    )  # fmt: skip
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _rollout(rate, load=1.0):
    return dict(bench="rollout", model="dense", batch=8, new_tokens_per_s=rate,
                load_avg_1m=load, vs_peers_role="project", **ENV)  # fmt: skip


def _peer(system, rate, load=1.0):
    return dict(system=system, model="qwen3-dense", batch=8, tokens_per_s=rate,
                config={"new": 128}, load_avg_1m=load, vs_peers_role="peer")  # fmt: skip


def _update(policy, ms):
    return dict(bench="update", model="dense", policy=policy, step_ms=ms, micro_batch=2,
                load_avg_1m=1.0, vs_peers_role="project", **ENV)  # fmt: skip


def _torch(policy, ms):
    return dict(bench="update_baseline", model="dense", policy=policy, step_ms=ms,
                micro_batch=8, load_avg_1m=1.0, vs_peers_role="peer")  # fmt: skip


def test_rounds_compare_every_sides_fastest_line(tmp_path):
    rows = [
        _peer("tunix-Sampler", 2000.0), _peer("hf-transformers-generate", 900.0), _rollout(3300.0),
        _peer("tunix-Sampler", 2500.0), _peer("hf-transformers-generate", 1000.0), _rollout(2600.0),
        _torch("fp32", 300.0), _update("fp32", 280.0),
        _torch("fp32", 250.0), _update("fp32", 310.0),
    ]  # fmt: skip
    done, lines = _summarize(tmp_path, rows)
    assert done.returncode == 0, done.stderr
    by = {line["variant"]: line for line in lines}
    roll = by["rollout/dense/b8"]
    assert roll["best_peer"] == "tunix-Sampler" and roll["rounds"] == 2
    assert roll["new_tokens_per_s"] == 3300.0
    assert roll["ratio_vs_best_peer"] == pytest.approx(3300 / 2500, abs=1e-3)
    upd = by["update/dense/fp32"]
    assert upd["step_ms"] == 280.0 and upd["torch_step_ms"] == 250.0 and upd["rounds"] == 2
    assert upd["ratio_vs_torch"] == pytest.approx(280 / 250, abs=1e-3)
    assert "update/dense/bf16" not in by  # no bf16 lines in this run


def test_bad_rounds_and_missing_raw_lines_are_refused(tmp_path):
    for bad in ("0", "00", "2x", "-1"):
        done, _ = _summarize(tmp_path, [_rollout(1.0)], ROUNDS=bad)
        assert done.returncode == 2 and f"ROUNDS={bad} must be a positive integer" in done.stderr
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), str(tmp_path / "none.jsonl"), "--summarize"],
        capture_output=True, text=True, env={**os.environ, "PY": sys.executable},
    )  # fmt: skip
    assert done.returncode == 2 and "--summarize needs the raw lines" in done.stderr


def _chain(framework, rows, ms, dtype="fp32"):
    return dict(bench="matmul_peak", framework=framework, dtype=dtype, chain_rows=rows, ms=ms,
                load_avg_1m=1.0, vs_peers_role="project")  # fmt: skip


def test_dense_update_lines_carry_the_fastest_matmul_chain(tmp_path):
    moe = [dict(_update("fp32", 400.0), model="moe"), dict(_torch("fp32", 330.0), model="moe")]
    rows = [
        _torch("fp32", 270.0), _update("fp32", 260.0), *moe,
        _chain("jax", 1536, 184.0), _chain("jax", 384, 201.0), _chain("torch", 1536, 175.0),
        _chain("torch", 384, 90.0, dtype="bf16"),
    ]  # fmt: skip
    done, lines = _summarize(tmp_path, rows)
    assert done.returncode == 0, done.stderr
    by = {line["variant"]: line for line in lines}
    dense = by["update/dense/fp32"]
    assert dense["chain_ms"] == 175.0 and dense["chain_source"] == "torch/m1536"
    assert dense["goal_over_chain"] == pytest.approx(0.67 * 270 / 175, abs=1e-3)
    assert "chain_ms" not in by["update/moe/fp32"]  # the chain has the dense model's shapes
