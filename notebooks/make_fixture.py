"""Generates ``notebooks/fixtures/coderepair_trajectories.npz``: recorded code-repair episodes.

    .venv/bin/python notebooks/make_fixture.py [--tasks 8] [--out notebooks/fixtures/...]

Per task (one GRPO group, ``group_ids``) five episodes, all played through ``CodeRepairEnv``:
  * ``expert``: the scripted expert, no detours (succeeds);
  * ``expert_detour`` x2: the expert with ``detour_prob=0.7`` (a wrong edit and a ``run`` before
    some fixes; succeeds later);
  * ``gave_up``: the expert's plan with its last fix left out, then ``submit`` (fails);
  * ``random_model``: a randomly initialised tiny model sampled by the rollout engine
    (``run_episodes``; fails).
Every episode is replayed through a fresh environment to label each model turn with the hash of
the program it acted on (``state_ids``, for step-level groups) and to find ``fix_turn``: the first
turn after which the program passes every test, hidden ones included (-1: never).

Arrays (B episodes padded to T tokens, K = max model turns):
  tokens int32 [B,T]; valid, action_mask bool [B,T]; turn_ids int32 [B,T] (-1 padding);
  process_rewards f32 [B,T] (sum of the turn's process signals on its last action token);
  state_ids int32 [B,T] (on action tokens); outcome_reward f32 [B]; success bool [B];
  group_ids int32 [B]; fix_turn int32 [B]; task_seed, difficulty int32 [B]; source str [B];
  tools str [B,K] (tool name of each model turn, '' past the end).
"""

from __future__ import annotations

import argparse
import hashlib
import os

import jax
import numpy as np

from agentrl_jax.envs.coderepair import CodeRepairEnv, CodeTokenizer, expert_plan, make_task
from agentrl_jax.envs.coderepair.evaluation import evaluate
from agentrl_jax.envs.episode import play_episode
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.agent_loop import run_episodes
from agentrl_jax.rollout.sampler import RolloutConfig

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "fixtures", "coderepair_trajectories.npz")
TINY = ModelConfig(
    vocab_size=512,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    layer_pattern="D",
    window=32,
    sparse_block_size=16,
    sparse_topk_tokens=32,
    d_ff=64,
)


def _plan_policy(tok: CodeTokenizer, plan: list[tuple[str, ...]]):
    turn = [0]

    def policy(stream):
        words = plan[min(turn[0], len(plan) - 1)]
        turn[0] += 1
        return tok.encode_words(["<call>", *words, "</call>"])

    return policy


def _gave_up_plan(plan: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    edits = [i for i, w in enumerate(plan) if w[0] in ("edit", "sub")]
    return plan[: edits[-1]] + [("submit",)] if edits else plan


def _state_hash(lines) -> int:
    text = "\n".join(" ".join(w) for w in lines)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") >> 1


def replay(task, tokens, action_mask, turn_ids, tok):
    """Replays an episode's turns in a fresh env: (state id per turn, tools, fix turn, process)."""
    env = CodeRepairEnv(tok)
    env.reset(task)
    states, tools, process = {}, {}, {}
    fix_turn = -1
    for k in sorted(set(turn_ids[action_mask].tolist())):
        action = tokens[action_mask & (turn_ids == k)]
        states[k] = _state_hash(env.state.lines)
        _, res = env.step(action.tolist())
        tools[k] = res.log.get("tool") or "(bad call)"
        process[k] = float(sum(res.process.values()))
        ev = evaluate(env.state.lines, task.tests, task.config.step_budget)
        if fix_turn < 0 and ev.all_pass:
            fix_turn = k
        if res.done:
            break
    return states, tools, fix_turn, process


def generate(n_tasks: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Plays the episodes (see module docstring) and returns the fixture arrays."""
    tok = CodeTokenizer()
    tasks = [make_task(seed + 11 * i, i % 2) for i in range(n_tasks)]
    episodes = []  # (task index, source, tokens, action_mask, turn_ids, outcome, success)
    for i, task in enumerate(tasks):
        plans = [
            ("expert", expert_plan(task)),
            ("expert_detour", expert_plan(task, detour_prob=0.7, seed=1)),
            ("expert_detour", expert_plan(task, detour_prob=0.7, seed=2)),
            ("gave_up", _gave_up_plan(expert_plan(task))),
        ]
        for source, plan in plans:
            ep = play_episode(CodeRepairEnv(tok), task, _plan_policy(tok, plan), max_turns=12)
            episodes.append(
                (i, source, ep.tokens, ep.action_mask, ep.turn_ids, ep.outcome_reward, ep.success)
            )
    model = Transformer(TINY, get_policy("fp32"))
    params = init_params(model, jax.random.key(seed))
    sampling = RolloutConfig(max_new_tokens=12, max_len=384, chunk=4, prefill_chunk=64)
    traj = run_episodes(
        model,
        params,
        tasks,
        lambda: CodeRepairEnv(tok),
        tok,
        sampling,
        jax.random.key(seed + 1),
        max_turns=4,
    )
    for i in range(n_tasks):
        v = np.asarray(traj.valid[i])
        episodes.append(
            (
                i,
                "random_model",
                np.asarray(traj.tokens[i])[v],
                np.asarray(traj.action_mask[i])[v],
                np.asarray(traj.turn_ids[i])[v],
                float(traj.outcome_reward[i]),
                bool(traj.success[i]),
            )
        )
    episodes.sort(key=lambda e: e[0])  # group rows by task
    b = len(episodes)
    t = max(len(e[2]) for e in episodes)
    k_max = max(int(e[4].max()) for e in episodes)
    out = {
        "tokens": np.zeros((b, t), np.int32),
        "valid": np.zeros((b, t), bool),
        "action_mask": np.zeros((b, t), bool),
        "turn_ids": np.full((b, t), -1, np.int32),
        "process_rewards": np.zeros((b, t), np.float32),
        "state_ids": np.zeros((b, t), np.int32),
        "outcome_reward": np.zeros((b,), np.float32),
        "success": np.zeros((b,), bool),
        "group_ids": np.zeros((b,), np.int32),
        "fix_turn": np.full((b,), -1, np.int32),
        "task_seed": np.zeros((b,), np.int32),
        "difficulty": np.zeros((b,), np.int32),
        "source": np.zeros((b,), "<U16"),
        "tools": np.zeros((b, k_max), "<U12"),
    }
    for row, (i, source, tokens, mask, turns, outcome, success) in enumerate(episodes):
        n = len(tokens)
        out["tokens"][row, :n] = tokens
        out["valid"][row, :n] = True
        out["action_mask"][row, :n] = mask
        out["turn_ids"][row, :n] = turns
        states, tools, fix_turn, process = replay(tasks[i], tokens, mask, turns, tok)
        for k, s in states.items():
            on = mask & (turns == k)
            out["state_ids"][row, :n][on] = s
            out["process_rewards"][row, int(np.flatnonzero(on)[-1])] = process[k]
            out["tools"][row, k - 1] = tools[k]
        out["outcome_reward"][row] = outcome
        out["success"][row] = success
        out["group_ids"][row] = i
        out["fix_turn"][row] = fix_turn
        out["task_seed"][row] = tasks[i].seed
        out["difficulty"][row] = tasks[i].difficulty
        out["source"][row] = source
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    arrays = generate(args.tasks, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(
        f"wrote {args.out}: {arrays['tokens'].shape[0]} episodes x {arrays['tokens'].shape[1]} "
        f"tokens, success {arrays['success'].mean():.2f}, {os.path.getsize(args.out)} bytes"
    )


if __name__ == "__main__":
    main()
