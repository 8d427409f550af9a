"""The main job end to end (smoke variant) and bitwise resume of the RL loop."""

import json
import os
import threading

import jax
import numpy as np
import pytest

from agentrl_jax.config import apply_overrides, load_config
from agentrl_jax.experiment import build
from agentrl_jax.metrics import latest_attempts, read_jsonl
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.report import build_report
from agentrl_jax.train.main import run
from agentrl_jax.train.reference import make_logprobs_fn
from agentrl_jax.train.rl_loop import RLRun, TrainConfig
from agentrl_jax.train.stages import stored_sft_eval

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(ROOT, "experiments", "toy.py") + ":smoke=True"
# End-to-end runs on one device: the 8 fake devices are the mesh tests' (an 8-way run costs
# 2-3x the CPU time and memory of a one-device run on 2 cores).
ONE_DEVICE = "mesh.devices=1"
# The evaluation on the rollout's 4 slots (2 groups of 2): its sampled mode runs the programs
# the rollout compiled (the smoke experiment's 2 episodes on 2 slots compile their own).
EVAL_4 = ["eval.n_episodes=4", "eval.n_slots=4"]


def _rl_run(cfg, run_dir, params, *, resume=False) -> RLRun:
    return RLRun(build(cfg), str(run_dir), params, seed=cfg.seed, resume=resume)


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_main_job_smoke(tmp_path):
    cfg = load_config(SMOKE, [f"workdir={tmp_path}", "train.eval_every=1", ONE_DEVICE, *EVAL_4])
    summary = run(cfg, progress=False)
    for key in (
        "heldout_success_before_rl",
        "heldout_success_after_rl",
        "goal_adherence_after_rl",
        "entropy_start",
        "entropy_end",
        "nonfinite_steps",
        "wall_s",
        "run_dir",
    ):
        assert key in summary, key
    assert summary["model"].startswith("toy model, trained from scratch (")
    run_dir = summary["run_dir"]
    assert summary["nonfinite_steps"] == 0
    gain = summary["heldout_gain"]["greedy"]  # paired over the same held-out tasks
    delta = summary["heldout_success_after_rl"] - summary["heldout_success_before_rl"]
    assert gain["delta"] == pytest.approx(delta, abs=1e-4) and gain["stderr"] >= 0
    assert gain["n"] == cfg.eval.n_episodes and gain["fixed"] + gain["broken"] <= gain["n"]
    assert np.isfinite(summary["entropy_start"]) and np.isfinite(summary["entropy_end"])
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    keys = set().union(*lines)
    assert any(k.startswith("sft/") for k in keys) and "rl/reward" in keys
    evals = [x for x in lines if "eval/heldout_success" in x]
    assert len(evals) == 3  # before, mid-run at step 1 (eval_every=1), after
    assert all(0.0 <= x["eval/heldout_truncated"] <= 1.0 for x in evals)
    assert any(k.startswith("eval/heldout_bug_type/") for k in evals[1])
    assert any(k.startswith("eval/heldout_bug_subtype/") for k in evals[1])
    saved = json.load(open(os.path.join(run_dir, "summary.json")))
    assert (
        list(saved["eval_mid"]) == ["1"] and "episode_success" in saved["eval_mid"]["1"]["greedy"]
    )
    rates = [x["rl/rejected_call_rate"] for x in lines if "rl/rejected_call_rate" in x]
    assert len(rates) == cfg.train.rl_steps and all(0.0 <= r <= 1.0 for r in rates)
    assert "rl/mismatch/max_abs_dlogp" in keys or any(k.startswith("rl/mismatch/") for k in keys)
    for stage in ("sft", "rl"):
        assert os.listdir(os.path.join(run_dir, "checkpoints", stage))
    assert os.path.getsize(os.path.join(run_dir, "tool_calls.jsonl")) > 0
    assert os.listdir(os.path.join(run_dir, "tb"))
    build_report(run_dir)
    assert any(p.endswith(".png") for p in os.listdir(os.path.join(run_dir, "plots")))

    # RL only, from that run's SFT checkpoint (a run dir as init_from), with step-level groups
    # (gigpo reads the loop's history state ids) and a greedy member in each group of 2.
    cfg2 = load_config(
        SMOKE,
        [
            f"workdir={tmp_path / 'second'}",
            ONE_DEVICE,
            *EVAL_4,
            "train.sft=False",
            f"train.init_from={run_dir}",
            "train.eval_before=False",
            "train.rl_steps=1",
            "rl.advantage=gigpo",
            "train.process_weights={'rejected': 0.5, 'parse': 0.0}",
            "train.greedy_member=True",
        ],
    )
    second = run(cfg2, progress=False)
    assert second["nonfinite_steps"] == 0 and "heldout_success_after_rl" in second
    assert second["run_dir"] != run_dir
    # no evaluation before RL: the first run's evaluation of the same SFT checkpoint is reused
    assert second["eval_before_from"] == os.path.join(run_dir, "summary.json")
    assert second["heldout_success_before_rl"] == summary["heldout_success_before_rl"]
    assert second["heldout_gain"]["greedy"]["n"] == cfg.eval.n_episodes
    # ... but only an evaluation of the same tasks under the same decoding and dtype policy
    assert stored_sft_eval(run_dir, cfg2) is not None
    for other in (["eval.n_episodes=3"], ["eval.seed=1"], ["policy=bf16"]):
        assert stored_sft_eval(run_dir, load_config(SMOKE, [*EVAL_4, *other])) is None, other
    lines = [json.loads(x) for x in open(os.path.join(second["run_dir"], "metrics.jsonl"))]
    assert any(0.0 <= x.get("rl/greedy_member_success", -1) <= 1.0 for x in lines)


def test_synchronous_loop_steps_a_rounds_environments_on_a_pool(tmp_path, monkeypatch):
    """``train.env_workers`` > 1: the synchronous loop's tool calls run on the pool's threads,
    and the step's parameters are bitwise those of one call after another on the loop's thread."""
    names = []
    cfg = load_config(SMOKE, ["train.sft=False", "train.eval_before=False"])
    s = build(cfg)
    env_cls = type(s.env.env(s.env.tokenizer()))
    step = env_cls.step

    def spy(self, action):
        names.append(threading.current_thread().name)
        return step(self, action)

    monkeypatch.setattr(env_cls, "step", spy)
    params = init_params(Transformer(s.model, s.policy), jax.random.key(0))
    leaves, threads = {}, {}
    for workers in (4, 1):
        names.clear()
        one = load_config(SMOKE, ["train.sft=False", f"train.env_workers={workers}"])
        run_ = _rl_run(one, tmp_path / str(workers), params)
        run_.step(0)
        run_.close()
        leaves[workers] = [np.asarray(x) for x in jax.tree.leaves(run_.state.params)]
        threads[workers] = set(names)
    assert threads[1] == {threading.main_thread().name}
    assert threads[4] and all(n.startswith("env") for n in threads[4])
    for x, y in zip(leaves[4], leaves[1], strict=True):
        np.testing.assert_array_equal(x, y)


def test_resume_is_bitwise(tmp_path):
    cfg = load_config(SMOKE, ["train.sft=False", "train.eval_before=False"])
    model_cfg = ModelConfig(**cfg.model.to_dict())
    params = init_params(Transformer(model_cfg, get_policy(cfg.policy)), jax.random.key(0))
    straight = tmp_path / "straight"
    broken = tmp_path / "broken"
    straight.mkdir()
    broken.mkdir()

    a = _rl_run(cfg, str(straight), params, resume=False)
    for step in range(2):
        a.step(step)
    b = _rl_run(cfg, str(broken), params, resume=False)
    for step in range(2):
        b.step(step)
        b.save(step + 1)
    b.ckpt.close()
    del b  # "killed", and then its newest checkpoint is damaged: one byte of a data file
    step2 = os.path.join(broken, "checkpoints", "rl", "2")
    data = max(
        (os.path.join(r, f) for r, _, fs in os.walk(step2) if "/d" in r for f in fs),
        key=os.path.getsize,
    )
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(data, "wb").write(bytes(raw))
    c = RLRun(build(cfg), str(broken), params, seed=cfg.seed, resume=True, attempt=2)
    assert c.start_step == 1  # step 2 fails its checksums: set aside, step 1 restored
    assert os.listdir(os.path.join(broken, "checkpoints", "unusable")) == ["rl-2"]
    c.step(1)
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(c.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a.state.opt_state), jax.tree.leaves(c.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.pipeline.state() == c.pipeline.state()
    with pytest.raises(ValueError, match="already holds"):
        _rl_run(cfg, str(broken), params, resume=False)
    # the replayed step's tool calls are those of the first try, told apart by their attempt
    calls = read_jsonl(os.path.join(broken, "tool_calls.jsonl"))
    by = lambda step, attempt: [  # noqa: E731
        {k: v for k, v in r.items() if k != "attempt"}
        for r in calls
        if (r["step"], r["attempt"]) == (step, attempt)
    ]
    assert by(2, 1) and by(2, 1) == by(2, 2) and by(1, 1) and not by(1, 2)
    kept = latest_attempts(calls, stage=lambda r: None)
    assert [r for r in kept if r["step"] == 2] == [r for r in calls if r["attempt"] == 2]


def test_stored_eval_of_the_train_split_needs_the_same_data_section(tmp_path):
    """With eval.split=train the run's data section picks the tasks evaluated: a stored
    before-RL evaluation is reused only by a run whose data section is the same."""
    from agentrl_jax.metrics import save_config

    train_split = ["eval.split=train", "eval.n_episodes=8", "data.train_seeds=(0,2)"]
    cfg = load_config(SMOKE, train_split)
    save_config(str(tmp_path), cfg)
    with open(tmp_path / "summary.json", "w") as f:
        json.dump({"eval_before": {"greedy": {"success": 0.5}}}, f)
    assert stored_sft_eval(str(tmp_path), cfg) is not None
    other_tasks = load_config(SMOKE, [*train_split, "data.train_seeds=(2,4)"])
    assert stored_sft_eval(str(tmp_path), other_tasks) is None


def test_train_config_validation():
    with pytest.raises(ValueError, match="max_turns"):
        TrainConfig(max_turns=0)
    # process weights are checked against the environment's signals
    with pytest.raises(ValueError, match="unknown keys \\['reject'\\]"):
        build(load_config(SMOKE, ["train.process_weights={'reject': 1.0}"]))
    with pytest.raises(ValueError, match="tests"):
        nan = {"train.process_weights": {"tests": float("nan")}}
        build(apply_overrides(load_config(SMOKE), nan))
    build(load_config(SMOKE, ["train.process_weights={'rejected': 2.0, 'tests': 0}"]))


def test_greedy_member_leaves_a_sampled_member(tmp_path):
    cfg = load_config(SMOKE, ["train.sft=False", "train.greedy_member=True", "data.group_size=1"])
    with pytest.raises(ValueError, match="greedy_member needs data.group_size >= 2, not 1"):
        build(cfg)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ['data.bug_types=("logic",)', 'data.heldout_combo=("logic",)'],
            "no training tasks at difficulties=\\(0,\\) with bug_types=\\('logic',\\)",
        ),
        (["train.greedy_member=True", "data.group_size=1"], "greedy_member needs"),
        (["rl.loss.clip_low=-1"], "clip_low"),
        (["rollout.temperature=0"], "temperature"),
        (["model.n_layers=3"], "multiple of len\\(layer_pattern\\)"),
        (["sft.steps=0"], "steps"),
        (["model.value_head=shared", "rl.loss.vf_coef=0.5"], "critic for rl.advantage='gae'"),
        (["model.value_head=shared", "rl.advantage=gae"], "vf_coef=0.0"),
        (["rl.loss.vf_coef=0.5", "rl.advantage=gae"], "needs a value head"),
        (["model.value_head=yes"], "value_head='yes'"),
        (
            ["eval.split=train", "data.train_seeds=(0,2)", "eval.n_episodes=9"],
            "n=9 is more than the 8 distinct 'train' tasks",
        ),
    ],
)
def test_bad_config_fails_before_sft(tmp_path, overrides, match):
    """Every section is checked before SFT runs or a run dir is made."""
    cfg = load_config(SMOKE, [f"workdir={tmp_path}", *overrides])
    with pytest.raises(ValueError, match=match):
        run(cfg, progress=False)
    assert os.listdir(tmp_path) == []


def test_kl_to_reference_uses_the_start_params(tmp_path):
    """loss.kl_coef > 0: the loop feeds the frozen start params' logprobs as the KL reference."""
    cfg = load_config(
        SMOKE, ["train.sft=False", "train.eval_before=False", "rl.loss.kl_coef=0.1", "rl.lr=0.05"]
    )
    model_cfg = ModelConfig(**cfg.model.to_dict())
    params = init_params(Transformer(model_cfg, get_policy(cfg.policy)), jax.random.key(0))
    start = jax.tree.map(np.array, params)
    run_ = _rl_run(cfg, str(tmp_path), params, resume=False)
    first = run_.step(0)
    # before any update the policy is the reference: KL ~ 0 (float rounding of another shape)
    assert 0.0 <= first["kl_ref"] < 1e-5
    # force the policy away from the reference (a plain perturbation), then the KL must show it
    run_.state = run_.state._replace(
        params=jax.tree.map(lambda p: p + 0.05 * jax.numpy.sign(p), run_.state.params)
    )
    second = run_.step(1)
    assert second["kl_ref"] > 1e-3
    # the reference is the start params, untouched by the (donating) updates
    for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(run_.ref_params)):
        np.testing.assert_array_equal(x, np.asarray(y))


def test_guide_groups_put_the_expert_in_failed_groups(tmp_path):
    """train.guide_groups: a group whose sampled members all failed gets the scripted expert's
    episode as its first member, with the current policy's logprobs and a positive advantage;
    step metrics and difficulty estimates still see only the sampled episodes."""
    from agentrl_jax.envs.coderepair import ExpertPolicy
    from agentrl_jax.envs.episode import play_episode

    cfg = load_config(
        SMOKE,
        ["train.sft=False", "train.eval_before=False", "train.guide_groups=2", "train.max_turns=6"],
    )
    model_cfg = ModelConfig(**cfg.model.to_dict())
    params = init_params(Transformer(model_cfg, get_policy(cfg.policy)), jax.random.key(0))
    run_ = _rl_run(cfg, str(tmp_path), params, resume=False)
    start = jax.tree.map(np.array, run_.state.params)
    seen = {}
    controller = run_.controller

    def spy(state, batch, rng):
        seen.update(batch)
        return controller(state, batch, rng)

    run_.controller = spy
    run_.controller.active = controller.active  # the loop reads the active dtype policy
    tasks = []
    real_round = run_._round

    def record_tasks(items, *rest):
        tasks.extend(it["task"] for it in items)
        return real_round(items, *rest)

    run_._round = record_tasks
    metrics = run_.step(0)
    # an untrained policy fails every episode, so both groups of the batch are guided
    assert metrics["guided_groups"] == 2.0
    assert metrics["success"] == 0.0 and metrics["reward"] == 0.0
    assert all(r == 0.0 for r in run_.pipeline.tracker.rates.values())
    g = cfg.data.group_size
    for j in range(2):
        row = j * g
        task = tasks[j]  # no refill round: the first round's groups fill the batch in order
        ep = play_episode(run_.env.env(run_.tokenizer), task, ExpertPolicy(task, run_.tokenizer))
        n = ep.n_tokens
        np.testing.assert_array_equal(seen["tokens"][row, :n], ep.tokens)
        assert not seen["valid"][row, n:].any()
        act = seen["action_mask"][row]
        assert act.sum() == ep.action_mask.sum() > 0
        assert (seen["advantages"][row][act] > 0).all()
        assert (seen["advantages"][row + 1][seen["action_mask"][row + 1]] < 0).all()
        want = make_logprobs_fn(model_cfg, run_.sampling)(
            controller.active,
            start,
            seen["tokens"][row : row + 1],
            seen["valid"][row : row + 1],
        )
        np.testing.assert_allclose(
            seen["rollout_logprobs"][row][act], np.asarray(want)[0][act], rtol=1e-5, atol=1e-5
        )
        assert (seen["rollout_logprobs"][row][~act] == 0).all()


def test_policy_guides_put_a_sampled_success_in_failed_groups(tmp_path):
    """guide_source='policy': an all-failed group's first member becomes one of guide_samples
    more policy episodes on its task that succeeded. An untrained policy succeeds nowhere, so
    the test marks one retry as a success after it is played (the rest is the real loop)."""
    cfg = load_config(
        SMOKE,
        [
            "train.sft=False",
            "train.eval_before=False",
            "train.guide_groups=1",
            "train.guide_source=policy",
            "train.guide_samples=3",
        ],
    )
    model_cfg = ModelConfig(**cfg.model.to_dict())
    params = init_params(Transformer(model_cfg, get_policy(cfg.policy)), jax.random.key(0))
    run_ = _rl_run(cfg, str(tmp_path), params, resume=False)
    seen, plays = {}, []
    controller = run_.controller

    def spy(state, batch, rng):
        seen.update(batch)
        return controller(state, batch, rng)

    run_.controller = spy
    run_.controller.active = controller.active
    real_play = run_.play

    def play(tasks, k, key, greedy):
        traj = real_play(tasks, k, key, greedy)
        if k == cfg.train.guide_samples:  # the retry batch: its second episode "succeeds"
            success, reward = np.array(traj.success), np.array(traj.outcome_reward)
            success[1], reward[1] = True, 1.0
            traj = traj.replace(success=success, outcome_reward=reward)
        plays.append((list(tasks), k, traj))
        return traj

    run_.play = play
    metrics = run_.step(0)
    g = cfg.data.group_size
    (tasks, _, first), (retried, k, retry) = plays[:2]
    assert k == 3 and retried == tasks[:1]  # guide_groups=1: the first failed group only
    assert metrics["guided_groups"] == 1.0
    assert metrics["success"] == 0.0  # sampled episodes only
    n = int(np.asarray(retry.valid)[1].sum())
    np.testing.assert_array_equal(seen["tokens"][0, :n], np.asarray(retry.tokens)[1, :n])
    assert not seen["valid"][0, n:].any()
    act = seen["action_mask"][0]
    assert act.sum() > 0 and (seen["advantages"][0][act] > 0).all()
    for m in range(1, g):  # the sampled members keep their rows, now with negative advantages
        np.testing.assert_array_equal(
            seen["tokens"][m, : first.tokens.shape[1]], np.asarray(first.tokens)[m]
        )
        assert (seen["advantages"][m][seen["action_mask"][m]] < 0).all()
    with pytest.raises(ValueError, match="guide_source='teacher'"):
        TrainConfig(guide_source="teacher")
    with pytest.raises(ValueError, match="guide_samples"):
        TrainConfig(guide_samples=0)


def test_guide_groups_need_a_dense_model(tmp_path):
    cfg = load_config(
        SMOKE,
        [f"workdir={tmp_path}", "train.guide_groups=1", "model.n_experts=4"],
    )
    with pytest.raises(ValueError, match="guide_groups=1 needs a dense model"):
        run(cfg, progress=False)
    assert os.listdir(tmp_path) == []
