"""Learning-rate sweep of the toy experiment (an example of ``sweep(add)``).

    agentrl sweep experiments/sweep_lr.py                      three sequential runs
    agentrl sweep experiments/sweep_lr.py:vmap=True            one vmapped learner for all three
    agentrl sweep experiments/sweep_lr.py:smoke=True,vmap=True  seconds-sized check

Variants: ``smoke`` (the toy experiment's smoke model and loop, no SFT), ``vmap`` (sets
``sweep_vectorized``: one jitted ``jax.vmap`` of the RL update for all points, each point's
values in its own learner state; it needs 1 PPO epoch x 1 minibatch per step, the toy's
setting; see ``agentrl_jax.train.sweep_vmap``).
"""

import os

from agentrl_jax.config import load_module, parse_arg

LRS = (3e-5, 1e-4, 3e-4)


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False, vmap=False)
    toy = load_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy.py"))
    cfg = toy.get_config(f"smoke={arg.smoke}")
    cfg.name = "sweep_lr"
    cfg.sweep_vectorized = arg.vmap
    if arg.vmap:  # the vmapped learner runs one update per step (1 PPO epoch x 1 minibatch)
        cfg.rl.ppo_epochs = 1
        cfg.rl.n_minibatches = 1
    if arg.smoke:
        cfg.train.sft = False
        cfg.train.eval_before = False
        cfg.train.rl_steps = 2
        cfg.train.max_turns = 1
        cfg.train.log_tool_calls = False
        cfg.data.batch_size = 1
        cfg.eval.n_episodes = 2
        cfg.eval.max_new_tokens = 8
        cfg.rollout.max_new_tokens = 8
    return cfg


def sweep(add):
    for lr in LRS:
        add(**{"rl.lr": lr})
