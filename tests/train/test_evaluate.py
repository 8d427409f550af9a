"""Evaluation: result keys on a tiny model, summaries vs hand counts, task sets, the CLI."""

import argparse
import dataclasses
import itertools
import json
import math
import types

import jax
import numpy as np
import pytest

from agentrl_jax.data import DataConfig
from agentrl_jax.envs.coderepair import BUG_TYPES
from agentrl_jax.metrics import save_config
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.train.checkpoint import Checkpointer, stage_dir
from agentrl_jax.train.eval_cli import run_from_cli
from agentrl_jax.train.eval_stats import paired_gain, pass_at_estimates
from agentrl_jax.train.evaluate import (
    RESULT_KEYS,
    EvalConfig,
    eval_tasks,
    evaluate,
    pass_at_k,
    summarize,
)
from benchmarks.common import preset

TINY = preset("tiny-1layer")
EVAL = EvalConfig(difficulty=0, n_episodes=3, max_len=384, max_new_tokens=8, n_slots=3, chunk=4)


def test_summarize_hand_counts():
    def bug(t, sub):
        return types.SimpleNamespace(type=t, subtype=sub)

    tasks = [types.SimpleNamespace(bug_types=b) for b in
             (("logic",), ("syntax", "logic"), ("off_by_one",), ("logic", "logic"))]  # fmt: skip
    tasks[1].bugs = (bug("syntax", "eq"), bug("logic", "variable"))
    tasks[3].bugs = (bug("logic", "variable"), bug("logic", "constant"))
    valid = np.zeros((4, 10), bool)
    for i, n in enumerate((10, 6, 8, 4)):
        valid[i, :n] = True
    turn_ids = np.where(valid, np.array([[0, 0, 1, 1, 2, 2, 3, 3, 4, 4]]), -1)
    traj = types.SimpleNamespace(
        success=np.array([True, False, True, True]),
        goal_adhered=np.array([True, True, False, True]),
        truncated=np.array([False, True, False, False]),
        valid=valid,
        turn_ids=turn_ids,
        logs=tuple({"error": e} for e in ("", "no code block", "", "", "bad path", "", "", "")),
    )
    out = summarize(traj, tasks, greedy=True)
    assert out["rejected_turns"] == 0.25  # 2 of the 8 logged model turns
    assert out["success"] == 0.75 and out["goal_adherence"] == 0.75 and out["truncated"] == 0.25
    assert out["mean_tokens"] == 7.0  # (10 + 6 + 8 + 4) / 4
    assert out["mean_turns"] == 2.5  # max turn ids 4, 2, 3, 1
    assert out["per_bug_type"] == {"logic": 2 / 3, "off_by_one": 1.0, "syntax": 0.0}
    assert out["per_bug_type_n"] == {"logic": 3, "off_by_one": 1, "syntax": 1}
    # tasks 0 and 2 carry no bug records; a subtype counts once per task
    subtypes = {"logic/constant": 1.0, "logic/variable": 0.5, "syntax/eq": 0.0}
    assert out["per_bug_subtype"] == subtypes
    assert out["per_bug_subtype_n"] == {"logic/constant": 1, "logic/variable": 2, "syntax/eq": 1}
    assert out["episode_success"] == [1, 0, 1, 1]
    assert out["success_stderr"] == pytest.approx(np.sqrt(0.75 * 0.25 / 4))


def test_paired_gain_hand_values():
    before = {"episode_success": [1, 1, 0, 0, 1, 0, 1, 0]}
    after = {"episode_success": [1, 0, 1, 1, 1, 1, 1, 0]}
    out = paired_gain(before, after)
    # d = [0, -1, 1, 1, 0, 1, 0, 0]: fixed 3, broken 1, delta 2/8; sample variance of d:
    # (sum d^2 - n mean^2) / (n - 1) = (4 - 8 / 16) / 7 = 0.5; stderr sqrt(0.5 / 8) = 0.25
    assert out == {"delta": 0.25, "stderr": pytest.approx(0.25), "fixed": 3, "broken": 1, "n": 8}
    same = paired_gain(before, before)
    assert same["delta"] == 0.0 and same["stderr"] == 0.0 and same["fixed"] == same["broken"] == 0
    rng = np.random.default_rng(0)
    b, a = rng.integers(0, 2, 50), rng.integers(0, 2, 50)
    d = a - b
    ref = paired_gain({"episode_success": b.tolist()}, {"episode_success": a.tolist()})
    assert ref["delta"] == pytest.approx(d.mean())
    assert ref["stderr"] == pytest.approx(d.std(ddof=1) / np.sqrt(50))
    with pytest.raises(ValueError, match="same tasks"):
        paired_gain(before, {"episode_success": [1, 0]})
    with pytest.raises(ValueError, match="episode_success"):
        paired_gain({"success": 0.5}, after)


def test_pass_at_estimates_match_subset_counting():
    rng = np.random.default_rng(3)
    succ = rng.random((6, 9)) < 0.35  # 6 samples of 9 tasks
    succ[:, 0] = False  # never solved
    succ[:, 1] = True  # always solved
    for j in range(1, 7):
        # brute force: the fraction of j-subsets of the samples holding a success
        want = [
            np.mean([succ[list(c), t].any() for c in itertools.combinations(range(6), j)])
            for t in range(9)
        ]
        np.testing.assert_allclose(pass_at_estimates(succ, j), want, rtol=0, atol=1e-12)
    assert pass_at_estimates(succ, 1) == pytest.approx(succ.mean(axis=0))
    c = succ.sum(axis=0)
    assert pass_at_estimates(succ, 2)[2] == pytest.approx(1 - math.comb(6 - c[2], 2) / 15)
    with pytest.raises(ValueError, match="samples per task"):
        pass_at_estimates(succ, 7)


def test_pass_at_k_orders_samples_by_task(monkeypatch):
    import agentrl_jax.train.evaluate as ev

    tasks = eval_tasks("heldout", 1, 4)
    k = 3
    # task i solved in samples s < i (episode s * 4 + i): solved counts 0, 1, 2, 3
    fake = [int(s < i) for s in range(k) for i in range(4)]
    seen = {}

    def fake_evaluate(model, params, ts, *, env, greedy, cfg, rng):
        seen.update(n=len(ts), greedy=greedy, order=[t.seed for t in ts])
        return {"episode_success": fake}

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    out = pass_at_k(None, None, tasks, k=k, cfg=EVAL)
    assert seen["n"] == 12 and seen["greedy"] is False
    assert seen["order"] == [t.seed for t in tasks] * k
    assert out["solved_samples"] == [0, 1, 2, 3] and out["k"] == 3 and out["n_tasks"] == 4
    assert set(out["pass_at"]) == {"1", "2", "3"}
    assert out["pass_at"]["1"] == pytest.approx(6 / 12)
    assert out["pass_at"]["3"] == pytest.approx(3 / 4)
    # pass@2 per task: 0, 1 - C(2,2)/C(3,2) = 2/3, 1, 1
    assert out["pass_at"]["2"] == pytest.approx((0 + 2 / 3 + 1 + 1) / 4)
    by_type = {t.bug_types[0]: float(i > 0) for i, t in enumerate(tasks)}
    assert out["per_bug_type"] == by_type
    assert sum(len(t.bugs) for t in tasks) == 4 and len(out["per_bug_subtype"]) >= 1
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(None, None, tasks, k=0, cfg=EVAL)


def test_eval_tasks_deterministic_and_split():
    a = eval_tasks("heldout", 1, 8)
    b = eval_tasks("heldout", 1, 8)
    assert [t.seed for t in a] == [t.seed for t in b]
    assert all(t.split == "heldout" and t.difficulty == 1 for t in a)
    assert {t.bug_types[0] for t in a} == set(BUG_TYPES)  # balanced round robin
    assert all(t.split == "train" for t in eval_tasks("train", 0, 2))
    with pytest.raises(ValueError, match="split"):
        eval_tasks("test", 1, 2)


def test_eval_tasks_of_the_train_split_follow_the_run_data_section():
    """``data`` picks the train split's tasks (a run's own training tasks); the held-out
    benchmark ignores it; asking for more tasks than the split holds is an error."""
    data = DataConfig(difficulties=(0,), train_seeds=(0, 2), heldout_seeds=(10**6, 10**6 + 2))
    tasks = eval_tasks("train", 1, 8, data=data)  # 4 bug-type cells x 2 seeds
    assert {t.seed for t in tasks} == {0, 1} and all(t.difficulty == 1 for t in tasks)
    assert len({(t.seed, t.bug_types) for t in tasks}) == 8
    with pytest.raises(ValueError, match="n=9 is more than the 8 distinct 'train' tasks"):
        eval_tasks("train", 1, 9, data=data)
    logic_only = dataclasses.replace(data, bug_types=("logic",), heldout_combo=())
    logic = eval_tasks("train", 1, 2, data=logic_only)
    assert [t.bug_types for t in logic] == [("logic",), ("logic",)]
    heldout = [t.seed for t in eval_tasks("heldout", 1, 8, data=data)]
    assert heldout == [t.seed for t in eval_tasks("heldout", 1, 8)]
    assert len(set(heldout)) > 2  # not data.heldout_seeds' two seeds
    with pytest.raises(ValueError, match="difficulty=9 must be in \\[0, 4\\]"):
        eval_tasks("heldout", 9, 2)  # the environment checks its levels
    with pytest.raises(ValueError, match="difficulty=-1"):
        EvalConfig(difficulty=-1)


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(TINY, get_policy("fp32"))
    return model, init_params(model, jax.random.key(0))


def test_evaluate_keys_on_tiny_model(tiny):
    model, params = tiny
    tasks = eval_tasks("heldout", 0, 3)
    out = evaluate(model, params, tasks, greedy=True, cfg=EVAL)
    assert set(out) == set(RESULT_KEYS)
    assert out["n_episodes"] == 3 and out["greedy"] is True
    for k in ("success", "goal_adherence", "truncated", "rejected_turns"):
        assert 0.0 <= out[k] <= 1.0
    assert out["rejected_turns"] > 0  # an untrained model's calls are mostly malformed
    assert out["mean_turns"] >= 1 and out["mean_tokens"] > 100  # the prompt alone is > 100
    assert set(out["per_bug_type"]) <= set(BUG_TYPES)
    assert sum(out["per_bug_type_n"].values()) == 3
    assert {s.split("/")[0] for s in out["per_bug_subtype"]} == set(out["per_bug_type"])


def test_cli_on_run_dir(tiny, tmp_path, capsys):
    model, params = tiny
    greedy_only = dataclasses.asdict(dataclasses.replace(EVAL, modes=("greedy",)))
    data = dataclasses.asdict(DataConfig(train_seeds=(0, 1)))  # one seed: 4 tasks per level
    save_config(
        tmp_path,
        {"model": dataclasses.asdict(TINY), "policy": "fp32", "eval": greedy_only, "data": data},
    )
    with Checkpointer(stage_dir(tmp_path, "sft")) as ckpt:
        ckpt.save(3, params=params, opt_state={}, rng=jax.random.key(0))
    args = argparse.Namespace(run_dir_or_checkpoint=str(tmp_path), split="heldout",
                              difficulty="0", episodes=3, spec=None, set=[])  # fmt: skip
    assert run_from_cli(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 3 and out["split"] == "heldout" and out["difficulty"] == 0
    assert set(out["greedy"]) == set(RESULT_KEYS) and "sampled" not in out
    assert out["seed"] == EVAL.seed
    # --set without --config overrides the run's own config
    sampled = argparse.Namespace(**{**vars(args), "set": ["eval.modes=('sampled',)"]})
    assert run_from_cli(sampled) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "sampled" in out and "greedy" not in out
    with pytest.raises(ValueError, match="unknown config key 'eval.mode'"):
        run_from_cli(argparse.Namespace(**{**vars(args), "set": ["eval.mode=('sampled',)"]}))
    # --seed: another task set of the same split (no task in common with the default one)
    assert run_from_cli(argparse.Namespace(**{**vars(args), "seed": 7})) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["seed"] == 7
    # --pass-k: k sampled episodes per task, pass@1 .. pass@k
    assert run_from_cli(argparse.Namespace(**{**vars(args), "pass_k": 2})) == 0
    pk = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pass_at_k"]
    assert pk["k"] == 2 and pk["n_tasks"] == 3 and set(pk["pass_at"]) == {"1", "2"}
    assert 0.0 <= pk["pass_at"]["1"] <= pk["pass_at"]["2"] <= 1.0
    default_tasks = {t.seed for t in eval_tasks("heldout", 0, 3, seed=EVAL.seed)}
    assert not default_tasks & {t.seed for t in eval_tasks("heldout", 0, 3, seed=7)}
    with pytest.raises(ValueError, match="run directory"):
        run_from_cli(argparse.Namespace(**{**vars(args), "run_dir_or_checkpoint": "/nonexistent"}))
    # --transcripts: one line per episode with its bugs, outcome and every tool call
    path = tmp_path / "calls.jsonl"
    assert run_from_cli(argparse.Namespace(**{**vars(args), "transcripts": str(path)})) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "transcripts" not in out["greedy"]  # the printed line stays a summary
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    tasks = eval_tasks("heldout", 0, 3, seed=EVAL.seed)
    assert [r["index"] for r in recs] == [0, 1, 2] and {r["mode"] for r in recs} == {"greedy"}
    assert [r["task_seed"] for r in recs] == [t.seed for t in tasks]
    assert [r["success"] for r in recs] == [bool(x) for x in out["greedy"]["episode_success"]]
    for r, t in zip(recs, tasks):
        assert r["bugs"][0]["line"] == t.bugs[0].line and r["bugs"][0]["type"] == t.bugs[0].type
        assert r["bugs"][0]["fix"] == list(t.bugs[0].fix)
        assert 1 <= len(r["turns"]) and set(r["turns"][0]) == {"tool", "args", "output", "error"}
    # --split train: the run's own training tasks (its data section's seed range)
    train_path = tmp_path / "train_calls.jsonl"
    train = {**vars(args), "split": "train", "transcripts": str(train_path)}
    assert run_from_cli(argparse.Namespace(**train)) == 0
    assert {json.loads(x)["task_seed"] for x in train_path.read_text().splitlines()} == {0}
    with pytest.raises(ValueError, match="n=5 is more than the 4 distinct 'train' tasks"):
        run_from_cli(argparse.Namespace(**{**train, "episodes": 5, "transcripts": None}))
    assert sum(len(r["turns"]) for r in recs) == round(out["greedy"]["mean_turns"] * 3)
    before = path.read_text()
    with pytest.raises(ValueError, match="exists; it would be overwritten"):
        run_from_cli(argparse.Namespace(**{**vars(args), "transcripts": str(path)}))
    assert path.read_text() == before
    with pytest.raises(ValueError, match="directory does not exist"):
        run_from_cli(argparse.Namespace(**{**vars(args), "transcripts": str(tmp_path / "x/y")}))
