"""RL of a pretrained Hugging Face chat model on the code-repair task, through its own chat
template: the config ``experiments/qwen3_rl.py`` and ``experiments/gpt_oss_rl.py`` share.

``init.hf_path`` names the model's directory (weights, ``config.json``, ``tokenizer.json`` and the
chat template); the environment is played through ``ChatEnv``. A short SFT on the scripted
expert's calls teaches the tool format, then GRPO, sized for one 8-GPU node (bf16, parameters and
optimiser state sharded over ``fsdp``). ``smoke=True`` swaps in a random tiny model of the family
(``hf.tiny.tiny_chat_model``) and CPU sizes.
"""

import os
import tempfile

from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config


def chat_rl_config(family: str, arg=None):
    """The experiment config of RL of a pretrained ``family`` chat model (module docstring).

    Raises:
      ValueError: neither ``hf_path`` nor ``smoke=True`` is given.
    """
    arg = parse_arg(arg, smoke=False, hf_path="")
    if not arg.smoke and not arg.hf_path:
        raise ValueError(
            f"the {family}_rl experiment needs hf_path=DIR (a {family} Hugging Face directory) "
            "or smoke=True"
        )
    cfg = base_config()
    cfg.name = f"{family}_rl"
    cfg.smoke = arg.smoke
    cfg.env = "coderepair"
    cfg.policy = "bf16"
    cfg.init.hf_path = arg.hf_path
    cfg.mesh.data = 1
    cfg.mesh.fsdp = -1  # every device: parameters and optimiser state sharded 8 ways
    cfg.model.remat = "full"
    sft = cfg.sft
    sft.steps = 200  # the tool-call format and the environment's conventions
    sft.batch_size = 16
    sft.lr = 1e-5
    sft.warmup_steps = 20
    sft.lm_weight = 0.0
    sft.detour_prob = 0.3
    sft.difficulties = (1,)
    sft.curriculum_difficulties = ()
    sft.curriculum_fraction = 0.0
    sft.buckets = (2048, 3072, 4096)
    ev = cfg.eval
    ev.difficulty = 1
    ev.n_episodes = 512
    ev.max_len = 4096
    ev.max_new_tokens = 256
    ev.n_slots = 64
    ev.prefill_chunk = 512
    d = cfg.data
    d.difficulties = (1, 2)
    d.batch_size = 32
    d.group_size = 8
    tr = cfg.train
    tr.rl_steps = 200
    tr.max_turns = 12
    tr.eval_every = 50
    ro = cfg.rollout
    ro.max_len = 4096
    ro.max_new_tokens = 256
    ro.prefill_chunk = 512
    rl = cfg.rl
    rl.lr = 1e-6
    rl.micro_batch = 8
    rl.loss.clip_high = 0.28
    rl.loss.agg_mode = "seq-mean-token-mean"
    if arg.smoke:
        from agentrl_jax.envs.registry import get_env
        from agentrl_jax.hf.tiny import tiny_chat_model

        cache = os.path.join(tempfile.gettempdir(), "agentrl_jax_tiny")
        cfg.init.hf_path = tiny_chat_model(family, get_env(cfg.env), cache)
        cfg.policy = "fp32"
        cfg.mesh.data = -1
        cfg.mesh.fsdp = 1
        cfg.model.remat = "none"
        sft.steps = 2
        sft.batch_size = 1
        sft.warmup_steps = 1
        sft.log_every = 1
        sft.difficulties = (0,)
        sft.buckets = (1536, 2048)
        ev.difficulty = 0
        ev.n_episodes = 1
        ev.modes = ("greedy",)
        ev.max_len = 1536
        ev.max_new_tokens = 16
        ev.n_slots = 1
        ev.prefill_chunk = 64
        d.difficulties = (0,)
        d.batch_size = 1
        d.group_size = 2
        d.max_refill_rounds = 0
        tr.rl_steps = 1
        tr.max_turns = 2
        tr.eval_every = 0
        tr.ckpt_every = 1
        ro.max_len = 1536
        ro.max_new_tokens = 16
        ro.prefill_chunk = 64
        rl.micro_batch = 2
    return cfg
