"""benchmarks/results_md.py: running scripts into a results file, rendering docs/results.md."""

import json
import sys
import textwrap

import pytest

from benchmarks import results_md

MACHINE_A = {
    "machine": "cpu-a-2c",
    "cpu_model": "CPU A (family 1, model 2)",
    "cpu_cores": 2,
    "cpu_flags": ["avx2"],
    "accelerator": "none",
    "accelerator_count": 0,
    "python_version": "3.11.7",
    "jaxlib_version": "0.10.2",
    "git_commit": "abc123",
}
MACHINE_B = {
    **MACHINE_A,
    "machine": "gpu-b",
    "accelerator": "GPU B",
    "accelerator_count": 1,
    "cpu_cores": 16,
}

DOC = textwrap.dedent(
    """\
    # Results

    Prose before the rollout table: what a row means.

    <!-- results:rollout -->
    stale table
    <!-- /results:rollout -->

    Prose between the tables, with a `code` span.

    <!-- results:newbench -->
    <!-- /results:newbench -->

    <!-- results:update -->
    <!-- /results:update -->

    ## Files
    <!-- results:sources -->
    <!-- /results:sources -->

    Closing prose.
    """
)


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _rollout(machine, batch, tps, date, load):
    return {
        "bench": "rollout",
        "variant": f"dense/D/b{batch}/fp32",
        "model": "dense",
        "pattern": "D",
        "batch": batch,
        "policy": "fp32",
        "tokens_per_s": tps,
        "speedup_vs_nocache": 20.5,
        "jax_version": "0.10.2",
        "command": "python benchmarks/rollout.py --reps 3",
        "load_avg_1m": load,
        "measured_at": f"{date}T10:00:00+00:00",
        **machine,
    }


@pytest.fixture
def results(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    _write(
        d / "cpu-a-2c-2026-01-01.jsonl",
        [
            _rollout(MACHINE_A, 8, 4956.4, "2026-01-01", 1.8),
            _rollout(MACHINE_A, 32, 10910.0, "2026-01-01", 2.4),
            {"bench": "newbench", "variant": "v", "step_ms": 1.25, "other": "x", **MACHINE_A},
            {"bench": "parity", "error": "timeout after 900 s", **MACHINE_A},
        ],
    )
    _write(d / "gpu-b-2026-01-02.jsonl", [_rollout(MACHINE_B, 8, 90000.0, "2026-01-02", 0.5)])
    return d


def test_render_keeps_prose_groups_by_machine_and_is_idempotent(results):
    rows = results_md.read_results(str(results))
    new, unplaced = results_md.render_doc(DOC, rows)
    assert unplaced == ["parity"]  # on file, but the document has no marker for it
    for prose in (
        "Prose before the rollout table: what a row means.",
        "Prose between the tables, with a `code` span.",
        "Closing prose.",
        "# Results",
    ):
        assert prose in new
    assert "stale table" not in new
    rollout = new[new.index("<!-- results:rollout -->") : new.index("<!-- /results:rollout -->")]
    # One table per machine and date, the newer first, each headed by its machine and versions.
    assert rollout.index("**gpu-b**, 2026-01-02") < rollout.index("**cpu-a-2c**, 2026-01-01")
    assert "1 x GPU B" in rollout and "no accelerator" in rollout
    assert "CPU A (family 1, model 2), 2 cores (vector extensions: avx2)" in rollout
    assert "jax 0.10.2, jaxlib 0.10.2, Python 3.11.7; commit abc123" in rollout
    assert "load average (1 min) 1.8-2.4" in rollout
    assert "`python benchmarks/rollout.py --reps 3`" in rollout
    # lines without paged_decode_impl or new_tokens_per_s leave their cells empty
    assert "| dense | D | 8 | fp32 |  |  |  | 4956 |" in rollout
    assert "| dense | D | 32 | fp32 |  |  |  | 10910 |" in rollout and "| 20.5 |" in rollout
    header = ("| model | pattern | batch | policy | decode kernel | paged decode | new tok/s | "
              "tok/s (with prompt)")  # fmt: skip
    assert rollout.count(header) == 2
    # A benchmark without a column spec gets its unit-named keys.
    newbench = new[new.index("<!-- results:newbench -->") :]
    assert "| variant | step_ms | load |" in newbench and "| v | 1.25 |" in newbench
    assert "No measurements on file yet." in new[new.index("<!-- results:update -->") :]
    assert "`benchmarks/results/cpu-a-2c-2026-01-01.jsonl`: 4 lines" in new
    again, _ = results_md.render_doc(new, rows)
    assert again == new


def test_error_rows_say_not_measured(results):
    rows = results_md.read_results(str(results))
    table = results_md.render_bench("parity", rows)
    assert "| not measured: timeout after 900 s |" in table


def test_read_results_rejects_lines_without_machine(tmp_path):
    _write(tmp_path / "x.jsonl", [{"bench": "rollout"}])
    with pytest.raises(ValueError, match="x.jsonl:1: a result line needs 'bench' and 'machine'"):
        results_md.read_results(str(tmp_path))


def test_main_renders_and_checks(results, tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(DOC)
    args = ["--results-dir", str(results), "--doc", str(doc)]
    assert results_md.main([*args, "--check"]) == 1
    assert results_md.main(args) == 0
    assert "**gpu-b**" in doc.read_text()
    assert results_md.main([*args, "--check"]) == 0


def test_run_script_appends_lines_with_machine_fields_and_errors(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(
        "import json, sys, time\n"
        "print('a log line')\n"
        "print(json.dumps({'bench': 'fake', 'variant': 'a', 'ms': 1.5}), flush=True)\n"
        "if sys.argv[1] == 'fail':\n"
        "    sys.stderr.write('ValueError: bad shape\\n')\n"
        "    sys.exit(3)\n"
        "time.sleep(30)\n"
    )
    out = tmp_path / "m.jsonl"
    kw = dict(python=sys.executable, script_dir=str(tmp_path))
    assert results_md.run_script("fake", ["fail"], str(out), MACHINE_A, **kw) == 2
    assert results_md.run_script("fake", ["hang"], str(out), MACHINE_A, timeout_s=3, **kw) == 2
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x.get("variant") for x in lines] == ["a", None, "a", None]
    assert lines[1]["error"] == "exit 3: ValueError: bad shape"
    assert lines[3]["error"] == "timeout after 3 s"
    for x in lines:
        assert x["machine"] == "cpu-a-2c" and x["cpu_cores"] == 2 and "measured_at" in x
        assert x["command"].startswith("python ") and "fake.py" in x["command"]
        assert "load_avg_1m" in x


def test_with_reps():
    assert results_md.with_reps("update", ["--reps", "3", "--iter-reps", "2"], 5) == [
        "--reps",
        "5",
        "--iter-reps",
        "5",
    ]
    assert results_md.with_reps("env", ["--episodes", "20"], 2) == [
        "--episodes",
        "20",
        "--reps",
        "2",
    ]
    assert results_md.with_reps("parity", [], 4) == []
    assert results_md.with_reps("env", ["--reps", "3"], None) == ["--reps", "3"]


def test_a_benchmark_with_variant_columns_gets_one_table_per_variant():
    machine = {"machine": "m", "_file": "m-2026-01-01.jsonl"}
    rows = [
        {"bench": "async_rl", "variant": "throughput", "env": "e", "max_staleness": 1,
         "steps_per_hour": 360.0, **machine},
        {"bench": "async_rl", "variant": "resume", "config": "c", "resume_bitwise": True,
         **machine},
    ]  # fmt: skip
    text = results_md.render_bench("async_rl", rows)
    assert text.count("**m**") == 2  # a header per table
    assert "| e | 1 |  |  | 360 |" in text and "| c | yes |" in text
