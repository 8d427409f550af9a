"""The code-repair environment: robustness, rewards, constraint, episodes."""

import dataclasses

import numpy as np
import pytest

from agentrl_jax.envs.base import Env
from agentrl_jax.envs.coderepair.env import PROCESS_KEYS, CodeRepairEnv
from agentrl_jax.envs.coderepair.task import make_task
from agentrl_jax.envs.coderepair.tools import first_wrong_line
from agentrl_jax.envs.episode import play_episode


def call(env, text):
    return env.tokenizer.encode(f"<call> {text} </call>")


def obs_text(env, ids):
    return env.tokenizer.decode(ids)


@pytest.fixture
def env():
    return CodeRepairEnv()


def test_reset_format(env):
    assert isinstance(env, Env)
    task = make_task(3, 1)
    ids = env.reset(task)
    tok = env.tokenizer
    assert ids[:2] == [tok.bos_id, tok.obs_start_id] and ids[-1] == tok.obs_end_id
    assert tok.unk_id not in ids
    assert "rule :" in tok.decode(ids)


@pytest.mark.parametrize(
    "action, expect",
    [
        ("run", "pass"),
        ("view", "functions :"),
        ("mix", "error unknown tool mix"),
        ("run L3", "error run takes 0 args got 1"),
        ("sub +", "error sub takes 2 + args got 1"),
        ("sub + -", "error no cursor line give a line"),
        ("edit L150 x = 1", "error line L150 out of range"),
        ("edit x = 1", "error no cursor line give a line"),
        ("view L5 L2", "error bad range"),
        ("view x", "error no function x"),
        ("sub L0 // a", "error L0 has no //"),
        ("edit L1 x = 1 <obs>", "error unexpected <obs>"),
    ],
)
def test_bad_calls_become_error_observations(env, action, expect):
    task = make_task(3, 1, bug_types=("logic",))
    env.reset(task)
    obs, res = env.step(call(env, action))
    assert expect in obs_text(env, obs)
    assert not res.done and res.outcome_reward == 0.0
    assert set(res.process) == set(PROCESS_KEYS)
    rejected = -1.0 if expect.startswith("error") else 0.0
    assert res.log["error"] == (rejected < 0)
    assert res.process == {**dict.fromkeys(PROCESS_KEYS, 0.0), "rejected": rejected}


def test_no_call_and_bad_ids(env):
    env.reset(make_task(3, 1))
    obs, res = env.step(env.tokenizer.encode("run"))
    assert "error no tool call" in obs_text(env, obs) and res.log["error"]
    assert res.process["rejected"] == -1.0
    obs, _ = env.step([env.tokenizer.call_start_id, 10**6])
    assert "error bad call" in obs_text(env, obs)


def test_repeated_rejected_call(env):
    """``repeated`` fires on a rejected call that was rejected before, and only then."""
    env.reset(make_task(3, 1, bug_types=("logic",)))
    steps = ["sub L0 // a", "sub L0 // b", "run", "sub L0 // a", "sub L0 // a", "sub L0 // b"]
    got = [env.step(call(env, a))[1].process for a in steps]
    assert [p["rejected"] for p in got] == [-1.0, -1.0, 0.0, -1.0, -1.0, -1.0]
    assert [p["repeated"] for p in got] == [0.0, 0.0, 0.0, -1.0, -1.0, -1.0]
    env.reset(make_task(3, 1, bug_types=("logic",)))  # a new episode forgets the old calls
    assert env.step(call(env, "sub L0 // a"))[1].process["repeated"] == 0.0


def test_revisit_marks_an_edit_back_to_an_earlier_program(env):
    """``revisit`` fires on an accepted edit that restores a program version of this episode
    (the start included), not on a new version, a run or a rejected call."""
    task = make_task(3, 1, bug_types=("logic",))
    env.reset(task)
    k = task.bugs[0].line
    line = " ".join(task.lines[k])
    steps = [
        f"edit L{k} {line} + 1",  # new version
        "run",
        f"edit L{k} {line} + 2",  # another new version
        f"edit L{k} {line} + 1",  # back to the first edit's version
        f"edit L{k} {line}",  # back to the start
        f"edit L{k} {line}",  # no change: refused, not a revisit
        f"edit L{k} {line} + 3",
    ]
    got = [env.step(call(env, a))[1] for a in steps]
    assert [r.log["error"] for r in got] == [False] * 5 + [True, False]
    assert [r.process["revisit"] for r in got] == [0.0, 0.0, 0.0, -1.0, -1.0, 0.0, 0.0]
    env.reset(task)  # a new episode forgets the versions (but knows its start)
    assert env.step(call(env, f"edit L{k} {line} + 1"))[1].process["revisit"] == 0.0
    assert env.step(call(env, f"edit L{k} {line}"))[1].process["revisit"] == -1.0


def test_no_change_edit_and_sub_are_refused(env):
    """An edit writing the line already there, or a sub of a word by itself, changes nothing and
    is refused (``same Lk``, rejected); a real change is accepted and then the same call again
    is a no-change refusal."""
    task = make_task(5, 1, bug_types=("logic",))
    bug = task.bugs[0]
    env.reset(task)
    k = bug.line
    line = " ".join(env.state.lines[k])
    before = list(env.state.lines)
    word = env.state.lines[k][0]
    for action in (f"edit L{k} {line}", f"sub L{k} {word} {word}"):
        obs, res = env.step(call(env, action))
        assert res.log["error"] and res.process["rejected"] == -1.0
        assert f"error same L{k}" in obs_text(env, obs)
        assert env.state.lines == before
    fix = " ".join(bug.original)
    obs, res = env.step(call(env, f"edit L{k} {fix}"))
    assert not res.log["error"] and env.state.lines[k] == bug.original
    obs, res = env.step(call(env, f"edit L{k} {fix}"))
    assert res.log["error"] and f"error same L{k}" in obs_text(env, obs)
    # a sub that inserts words around the old one is a change
    obs, res = env.step(call(env, f"sub L{k} {word} {word} {word}"))
    assert not res.log["error"] or "occurs" in obs_text(env, obs)


def _task_with(bug_type, difficulty=1):
    for seed in range(50):
        t = make_task(seed, difficulty, bug_types=(bug_type,) * difficulty_bugs(difficulty))
        if t.constraint[0] == "no_modify":
            return t
    raise AssertionError


def difficulty_bugs(d):
    return {0: 1, 1: 1, 2: 2}[d]


def test_fix_any_way_submit_and_process_signals(env):
    task = make_task(2, 1, bug_types=("syntax",))
    bug = task.bugs[0]
    env.reset(task)
    obs, _ = env.step(call(env, "run"))
    assert f"syntax error L{bug.line}" in obs_text(env, obs)
    # A fix written differently from the original line still counts: "x = e" -> "x = ( e )".
    orig = list(bug.original)
    new = orig[:2] + ["("] + orig[2:] + [")"] if orig[1] == "=" else orig
    obs, res = env.step(call(env, f"edit L{bug.line} {' '.join(new)}"))
    assert res.process["parse"] == 1.0 and res.process["error_classes"] == 1.0
    assert res.process["tests"] == 1.0 and res.process["rejected"] == 0.0
    obs, res = env.step(call(env, "submit"))
    assert res.done and res.outcome_reward == 1.0 and res.log["goal_adhered"]
    assert obs[-1] == env.tokenizer.eos_id and "submitted pass" in obs_text(env, obs)


def test_breaking_the_rule_fails_even_when_tests_pass(env):
    task = _task_with("logic")
    kind, fn = task.constraint
    env.reset(task)
    bug = task.bugs[0]
    env.step(call(env, " ".join(bug.fix)))
    start = next(i for i, w in enumerate(task.lines) if w[:2] == ("def", fn))
    body = task.lines[start + 1]
    # A semantically neutral change to the protected function: wrap the first line's rhs.
    env.step(call(env, f"edit L{start + 1} {' '.join(body)}"))
    env.step(call(env, f"edit L{start} {' '.join(task.lines[start])} <nl> c = 0"))
    obs, res = env.step(call(env, "submit"))
    assert res.done and res.outcome_reward == 0.0 and res.log["goal_adhered"] is False
    assert "rule broken" in obs_text(env, obs) and "tests" not in obs_text(env, obs)


def test_timeout_and_turn_limit(env):
    task = make_task(4, 0, bug_types=("logic",))
    env.reset(task)
    fn_line = next(i for i, w in enumerate(task.lines) if w[0] == "def" and w[1] == task.tested[0])
    head = " ".join(task.lines[fn_line])
    loop = "for i in 0 to 99999 <nl> a = a + 1 <nl> end"
    obs, _ = env.step(call(env, f"edit L{fn_line} L{fn_line} {head} <nl> {loop}"))
    want = env.tokenizer.decode(env.tokenizer.encode(f"ok lines {len(task.lines) + 3}"))
    assert want in obs_text(env, obs)
    obs, res = env.step(call(env, "run"))
    assert "timeout" in obs_text(env, obs) and not res.done
    for _ in range(task.config.max_turns - 3):
        _, res = env.step(call(env, "run"))
    assert not res.done
    obs, res = env.step(call(env, "run"))
    assert res.done and res.outcome_reward == 0.0 and "out of turns" in obs_text(env, obs)
    with pytest.raises(RuntimeError):
        env.step(call(env, "run"))


def test_random_actions_never_crash_and_never_emit_unk(env):
    rng = np.random.default_rng(0)
    tok = env.tokenizer
    for seed in range(6):
        task = make_task(seed, seed % 3)
        stream = env.reset(task)
        words = ["run", "view", "edit", "sub", "submit", "L1", "L2", "x", "=", "a", "+", "1"]
        for _ in range(task.config.max_turns):
            n = int(rng.integers(0, 8))
            act = [tok.call_start_id] + [
                tok.word_id(words[int(i) % len(words)]) if rng.random() < 0.7 else int(i)
                for i in rng.integers(0, tok.vocab_size, size=n)
            ]
            if rng.random() < 0.3:
                act = [tok.call_start_id, tok.word_id("run")]
            obs, res = env.step(act)
            stream += act + obs
            if tok.unk_id not in act:
                assert tok.unk_id not in obs
            if res.done:
                break
        assert res.done


def test_play_episode_masks_and_turn_ids(env):
    task = make_task(1, 0)
    script = iter(["run", "view", "submit"])
    ep = play_episode(env, task, lambda s: call(env, next(script)))
    tok = env.tokenizer
    assert ep.done and ep.n_turns == 3 and not ep.success
    assert ep.tokens.dtype == np.int32 and ep.tokens.shape == ep.action_mask.shape
    actions = ep.tokens[ep.action_mask]
    assert (actions == tok.call_start_id).sum() == 3 and (actions == tok.call_end_id).sum() == 3
    assert np.all(ep.tokens[ep.turn_ends] == tok.call_end_id)
    assert ep.turn_ids[0] == 0 and ep.turn_ids[-1] == 3
    assert np.all(np.diff(ep.turn_ids) >= 0)
    # Model tokens of turn k come right before the environment tokens of turn k.
    for k in (1, 2, 3):
        m = ep.action_mask[ep.turn_ids == k]
        assert m[0] and not m[-1] and np.all(np.diff(m.astype(int)) <= 0)
    assert ep.tokens[-1] == tok.eos_id
    with pytest.raises(ValueError, match="max_turns"):
        play_episode(env, task, lambda s: [], max_turns=0)


def test_first_wrong_line_is_the_first_differing_traced_line():
    trace = ((3, 1), (5, 12), (6, 7), (8, 0))
    golden = ((3, 1), (5, 7), (6, 2), (8, 0))
    assert first_wrong_line(trace, golden) == (5, 7)
    assert first_wrong_line(trace, trace) is None


@pytest.mark.parametrize("seed", range(6))
def test_run_marks_the_logic_bug_line_and_cursor_fixes_it(env, seed):
    task = make_task(100 + seed, 1, bug_types=("logic",))
    bug = task.bugs[0]
    env.reset(task)
    obs, _ = env.step(call(env, "run"))
    text = obs_text(env, obs)
    lines = text.replace("<obs>", "").replace("</obs>", "").strip().split("\n")
    assert lines[-1].strip() == f"cursor L{env.state.cursor}"
    marked = [ln for ln in lines if " want " in ln and "=>" in ln]
    assert len(marked) <= 1
    if env.state.cursor == bug.line:
        # the short form (no line id) acts on the cursor line
        short = " ".join(bug.fix[:1] + bug.fix[2:])
        obs, res = env.step(call(env, short))
        assert f"L{bug.line}" in obs_text(env, obs) and not res.log["error"]
        obs, _ = env.step(call(env, "run"))
        assert "pass 6 of 6" in obs_text(env, obs)
        assert tuple(env.state.lines[bug.line]) == bug.original


def test_golden_trace_off_gives_no_want_marker(env):
    task = make_task(101, 1, bug_types=("logic",))
    on = obs_text(env, (env.reset(task), env.step(call(env, "run"))[0])[1])
    off_task = dataclasses.replace(
        task, config=dataclasses.replace(task.config, golden_trace=False)
    )
    off = obs_text(env, (env.reset(off_task), env.step(call(env, "run"))[0])[1])
    assert "cursor" in on and "cursor" not in off
    traced_on = [ln for ln in on.split("\n") if "=>" in ln]
    traced_off = [ln for ln in off.split("\n") if "=>" in ln]
    assert any(" want " in ln for ln in traced_on)
    assert traced_off and not any(" want " in ln for ln in traced_off)
    assert env.state.cursor == -1


def test_sub_with_several_new_words_inserts_and_glues_digits(env):
    task = make_task(4, 1, bug_types=("syntax",))
    env.reset(task)
    k = next(i for i, ln in enumerate(env.state.lines) if len(ln) >= 3 and ln[1] == "=")
    before = env.state.lines[k]
    target = before[2]
    if before.count(target) == 1:
        obs, res = env.step(call(env, f"sub L{k} {target} 1 2 + {target}"))
        assert not res.log["error"], obs_text(env, obs)
        assert env.state.lines[k] == before[:2] + ("12", "+", target) + before[3:]
    _, res = env.step(call(env, f"sub L{k} = <obs>"))
    assert res.log["error"]


def test_dropped_word_bugs_are_fixed_by_an_inserting_sub():
    n = 0
    for seed in range(40):
        task = make_task(seed, 1, bug_types=("syntax",))
        bug = task.bugs[0]
        if bug.subtype in ("drop_op", "drop_paren") and bug.fix[0] == "sub":
            n += 1
            assert len(bug.fix) == 5
            env = CodeRepairEnv()
            env.reset(task)
            env.step(call(env, " ".join(bug.fix)))
            assert tuple(env.state.lines[bug.line]) == bug.original
    assert n >= 10
