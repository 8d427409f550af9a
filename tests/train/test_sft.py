"""SFT warm start: loss vs a numpy reference, demonstration batches, checkpoints, a smoke run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from agentrl_jax.envs.coderepair import CodeTokenizer, ExpertPolicy, make_task
from agentrl_jax.train.checkpoint import Checkpointer, restore_params, stage_dir
from agentrl_jax.train.demos import DemoSource, bucket_length, crop_demo, demo_episode, pad_batch
from agentrl_jax.train.sft import MAX_TURN_SLOTS, SFTConfig, run_sft, sft_loss, sft_optimizer
from benchmarks.common import preset

TINY = preset("tiny-1layer")


def _sft_loss_reference(logits, batch, lm_weight):
    """Loops over positions and turns in numpy."""
    keys = ("tokens", "valid", "action_mask", "turn_ids")
    tok, valid, act, tids = (np.asarray(batch[k]) for k in keys)
    logits = np.asarray(logits, np.float64)
    b, t, _ = logits.shape
    sums = {"act": [0.0, 0], "other": [0.0, 0]}
    correct_act, turns = [], {}
    for i in range(b):
        for j in range(t - 1):
            row = logits[i, j]
            lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
            nll = lse - row[tok[i, j + 1]]
            ok = int(np.argmax(row)) == tok[i, j + 1]
            if act[i, j + 1]:
                sums["act"][0] += nll
                sums["act"][1] += 1
                correct_act.append(ok)
                key = (i, min(max(tids[i, j + 1], 0), MAX_TURN_SLOTS - 1))
                turns[key] = turns.get(key, True) and ok
            elif valid[i, j + 1]:
                sums["other"][0] += nll
                sums["other"][1] += 1
    a = sums["act"][0] / max(sums["act"][1], 1)
    o = sums["other"][0] / max(sums["other"][1], 1)
    return a + lm_weight * o, a, o, np.mean(correct_act), np.mean(list(turns.values()))


def _random_batch(rng, b=3, t=24, v=40):
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    valid = np.arange(t)[None, :] < rng.integers(t // 2, t + 1, (b, 1))
    act = valid & (rng.random((b, t)) < 0.4)
    turn_ids = np.where(valid, np.cumsum(rng.random((b, t)) < 0.2, axis=1), -1).astype(np.int32)
    return {
        "tokens": tokens,
        "valid": valid,
        "action_mask": act,
        "fix_mask": act & (turn_ids % 2 == 1),
        "turn_ids": turn_ids,
    }


@pytest.mark.parametrize("lm_weight", [0.0, 0.3])
def test_sft_loss_matches_reference(lm_weight):
    rng = np.random.default_rng(0)
    batch = _random_batch(rng)
    logits = rng.normal(size=(3, 24, 40)).astype(np.float32) * 2
    # make some argmaxes right so accuracy and exact-match are not trivially 0
    tgt = batch["tokens"][:, 1:]
    hit = rng.random(tgt.shape) < 0.7
    np.put_along_axis(logits[:, :-1], tgt[..., None], np.where(hit, 50.0, -50.0)[..., None], -1)
    loss, m = jax.jit(sft_loss, static_argnums=2)(jnp.asarray(logits), batch, lm_weight)
    ref_loss, a, o, acc, exact = _sft_loss_reference(logits, batch, lm_weight)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(m["action_nll"]), a, rtol=1e-5)
    np.testing.assert_allclose(float(m["lm_nll"]), o, rtol=1e-5)
    np.testing.assert_allclose(float(m["action_acc"]), acc, rtol=1e-6)
    np.testing.assert_allclose(float(m["turn_exact"]), exact, rtol=1e-6)
    assert 0 < exact < 1


def test_demo_episode_and_pad_batch():
    tok = CodeTokenizer()
    specs = [{"seed": s, "difficulty": 1, "bug_types": (bt,)}
             for s, bt in ((3, "logic"), (4, "syntax"), (5, "missing_dependency"))]  # fmt: skip
    demos = [demo_episode(s, tok, detour_prob=0.5) for s in specs]
    for d in demos:
        assert d["success"]
        words = tok.to_words(d["tokens"][d["fix_mask"]])
        assert words[0] == "<call>" and words[1] in ("edit", "sub") and words[-1] == "</call>"
        assert not np.any(d["fix_mask"] & ~d["action_mask"])
        acts = tok.to_words(d["tokens"][d["action_mask"]])
        assert acts[-3:] == ["<call>", "submit", "</call>"]
    batch = pad_batch(demos, (64, 320, 512), tok.pad_id)
    longest = max(len(d["tokens"]) for d in demos)
    assert batch["tokens"].shape == (3, bucket_length(longest, (64, 320, 512)))
    for i, d in enumerate(demos):
        n = len(d["tokens"])
        np.testing.assert_array_equal(batch["tokens"][i, :n], d["tokens"])
        assert batch["valid"][i].sum() == n and (batch["turn_ids"][i, n:] == -1).all()
    with pytest.raises(ValueError, match="largest bucket"):
        pad_batch(demos, (64,), tok.pad_id)
    for d in demos:  # a crop ends with the last fix turn and keeps the aligned masks
        c = crop_demo(d, 40)
        end = int(np.nonzero(d["fix_mask"])[0][-1]) + 1
        assert len(c["tokens"]) == 40 and c["fix_mask"][-1]
        for k in ("tokens", "action_mask", "fix_mask", "turn_ids"):
            np.testing.assert_array_equal(c[k], d[k][end - 40 : end])
        assert tok.to_words(c["tokens"][-1:]) == ["</call>"]


def test_config_validation():
    with pytest.raises(ValueError, match="lm_weight"):
        SFTConfig(lm_weight=-1.0)
    with pytest.raises(ValueError, match="curriculum_fraction"):
        SFTConfig(curriculum_fraction=1.0)
    with pytest.raises(ValueError, match="buckets"):
        SFTConfig(buckets=(384, 256))
    with pytest.raises(ValueError, match="max_guesses"):
        SFTConfig(max_guesses=0)
    with pytest.raises(ValueError, match="max_guesses"):
        DemoSource(max_guesses=0)


def test_checkpoint_round_trip_bitwise(tmp_path):
    rng_np = np.random.default_rng(3)
    params = {
        "embed": {"table": rng_np.normal(size=(7, 5)).astype(np.float32)},
        "layer": {"w": rng_np.normal(size=(5, 3)).astype(np.float32),
                  "b": rng_np.normal(size=(3,)).astype(jnp.bfloat16)},
    }  # fmt: skip
    opt = sft_optimizer(SFTConfig(steps=10, warmup_steps=2))
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda x: jnp.asarray(rng_np.normal(size=x.shape), x.dtype), params)
    _, opt_state = jax.jit(opt.update)(grads, opt_state, params)  # non-trivial moments
    rng = jax.random.fold_in(jax.random.key(7), 3)
    with Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(5, params=params, opt_state=opt_state, rng=rng, meta={"data": {"x": 1}})
        with pytest.raises(ValueError, match="already exists"):
            ckpt.save(5, params=params, opt_state=opt_state, rng=rng)
        out = ckpt.restore(params=params, opt_state=opt_state)
    assert out["step"] == 5 and out["meta"] == {"data": {"x": 1}}
    saved = jax.tree.leaves((params, opt_state))
    loaded = jax.tree.leaves((out["params"], out["opt_state"]))
    for a, b in zip(saved, loaded, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype
    assert jax.tree.structure(opt_state) == jax.tree.structure(out["opt_state"])
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(out["rng"]))
    np.testing.assert_array_equal(  # the restored key draws the same numbers
        jax.random.uniform(rng, (4,)), jax.random.uniform(out["rng"], (4,))
    )
    with pytest.raises(ValueError, match="already holds steps"):
        Checkpointer(tmp_path / "c")


def test_run_sft_smoke(tmp_path):
    cfg = SFTConfig(steps=12, batch_size=4, lr=3e-2, warmup_steps=1, log_every=4,
                    difficulties=(0,), detour_prob=0.2, buckets=(320,), read_threads=0,
                    curriculum_difficulties=(1,), curriculum_fraction=0.34,
                    curriculum_crop_len=48)  # fmt: skip
    params, summary = run_sft(TINY, "fp32", cfg, str(tmp_path), progress=False)
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [4, 8, 12]
    assert [r["sft/seq_len"] for r in recs] == [48, 320, 320]  # 4 cropped curriculum steps
    assert recs[-1]["sft/loss"] < recs[0]["sft/loss"] - 0.5  # starts near ln(512) = 6.2
    assert summary["sft/steps"] == 12 and summary["sft/tokens_per_s"] > 0
    assert os.path.isdir(os.path.join(stage_dir(tmp_path, "sft"), "12"))
    # never silently overwritten: a second run on the same directory must be asked to resume
    with pytest.raises(ValueError, match="already holds steps"):
        run_sft(TINY, "fp32", cfg, str(tmp_path), progress=False)
    resumed, _ = run_sft(TINY, "fp32", cfg, str(tmp_path), resume=True, progress=False)
    restored, step = restore_params(stage_dir(tmp_path, "sft"), params)
    assert step == 12
    leaves = (jax.tree.leaves(x) for x in (params, resumed, restored))
    for a, b, c in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    assert isinstance(optax.global_norm(params), jax.Array)


def test_sft_loss_skips_detour_tokens():
    rng = np.random.default_rng(1)
    batch = _random_batch(rng)
    detour = batch["action_mask"] & (batch["turn_ids"] == 1)
    assert detour[:, 1:].any()
    logits = rng.normal(size=(3, 24, 40)).astype(np.float32)
    loss_fn = jax.jit(sft_loss, static_argnums=2)
    loss, _ = loss_fn(jnp.asarray(logits), {**batch, "detour_mask": detour}, 0.3)
    # the detour tokens are neither action nor LM tokens: equal to dropping them from the batch
    dropped = {**batch, "action_mask": batch["action_mask"] & ~detour}
    dropped["valid"] = batch["valid"] & ~detour
    ref, *_ = _sft_loss_reference(logits, dropped, 0.3)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    # and changing the logits that predict detour tokens changes nothing
    moved = logits.copy()
    moved[:, :-1][detour[:, 1:]] += rng.normal(size=(int(detour[:, 1:].sum()), 40)) * 5
    loss2, _ = loss_fn(jnp.asarray(moved), {**batch, "detour_mask": detour}, 0.3)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)


def test_learn_guesses_trains_on_wrong_guesses_only():
    tok = CodeTokenizer()
    n = 0
    for seed in range(12):
        spec = {"seed": seed, "difficulty": 1, "bug_types": ("logic",)}
        kw = dict(detour_prob=1.0, detour_seed=seed, max_guesses=3)
        masked = demo_episode(spec, tok, **kw)
        learned = demo_episode(spec, tok, learn_guesses=True, **kw)
        assert np.array_equal(masked["tokens"], learned["tokens"])
        task = make_task(seed, 1, bug_types=("logic",))
        policy = ExpertPolicy(task, tok, detour_prob=1.0, seed=seed, max_guesses=3)
        guess = masked["action_mask"] & np.isin(masked["turn_ids"], sorted(policy.guess_turns))
        # the guess turns move from the skipped detours to the trained fix turns; nothing else
        assert np.array_equal(learned["detour_mask"], masked["detour_mask"] & ~guess)
        assert np.array_equal(learned["fix_mask"], masked["fix_mask"] | guess)
        assert not np.any(guess & ~masked["detour_mask"])
        if guess.any():
            n += 1
            words = tok.to_words(learned["tokens"][guess])
            assert words[0] == "<call>" and words[1] in ("edit", "sub")
    assert n >= 3, n


def test_demo_detour_mask_marks_only_detour_turns():
    tok = CodeTokenizer()
    n = 0
    for seed in range(6):
        d = demo_episode({"seed": seed, "difficulty": 1, "bug_types": ("logic",)}, tok,
                         detour_prob=1.0, detour_seed=seed)  # fmt: skip
        assert d["success"]
        assert not np.any(d["detour_mask"] & ~d["action_mask"])
        assert not np.any(d["detour_mask"] & d["fix_mask"])
        words = tok.to_words(d["tokens"][d["detour_mask"]])
        if words:
            n += 1
            assert words[0] == "<call>" and words[1] in ("edit", "sub")
    assert n >= 4
