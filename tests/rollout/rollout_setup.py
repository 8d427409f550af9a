"""The rollout tests' shared setup: one tiny MoE model config, the sampling config, the slot
count and a scripted environment (a module of its own, not ``conftest``: ``from conftest import``
finds whichever ``conftest`` module was imported first when several test folders are collected).
"""

import random

from agentrl_jax.envs.base import StepResult
from agentrl_jax.envs.coderepair import CodeTokenizer
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.rollout.sampler import RolloutConfig

CFG = ModelConfig(
    vocab_size=512,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    layer_pattern="SF",
    window=8,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    d_ff=48,
    n_experts=4,
    experts_per_token=2,
    d_expert=16,
    init_std=0.2,
)
SAMPLING = RolloutConfig(max_new_tokens=6, max_len=128, page_size=8, chunk=4)
N_SLOTS = 3


class ScriptedEnv:
    """Deterministic test environment over the code-repair tokenizer's ids.

    ``reset(seed)`` returns ``<bos> <obs> w.. </obs>`` with a seed-dependent length; each step
    answers ``<obs> w.. </obs>`` (length depends on seed and turn) and the episode ends after
    ``2 + seed % 2`` turns with ``<eos>``. ``stream`` holds every id the environment emitted or
    received, in order; process signal ``{"x": 0.5}`` on each step, outcome 1.0 at the end.
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer or CodeTokenizer()
        self.stream: list[int] = []

    def reset(self, seed):
        tok = self.tokenizer
        self.seed, self.turn, self.rng = seed, 0, random.Random(seed)
        words = [self.rng.randrange(20, 400) for _ in range(5 + 7 * seed % 13)]
        self.stream = [tok.bos_id, tok.obs_start_id, *words, tok.obs_end_id]
        return list(self.stream)

    def step(self, action):
        tok = self.tokenizer
        self.turn += 1
        self.stream += list(action)
        words = [self.rng.randrange(20, 400) for _ in range(1 + (self.seed + 3 * self.turn) % 9)]
        obs = [tok.obs_start_id, *words, tok.obs_end_id]
        done = self.turn >= 2 + self.seed % 2
        if done:
            obs.append(tok.eos_id)
        self.stream += obs
        log = {"tool": "echo", "args": (str(len(action)),), "output": "x", "error": False}
        if done:
            log.update(success=True, goal_adhered=True)
        return obs, StepResult(done=done, outcome_reward=float(done), process={"x": 0.5}, log=log)
