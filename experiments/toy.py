"""The toy experiment: a small agent trained from scratch on the code-repair task on a CPU.

``make train-toy`` runs it (``make train`` runs the real model, ``smollm2_rl.py``): SFT warm
start on scripted-expert demonstrations, then GRPO with difficulty-filtered tasks, held-out
evaluation (512 medium tasks) before and after RL.
Expected on a 2-core CPU (about 12-20 minutes): held-out greedy success ~74% after SFT and a
paired RL gain of about +2 points (five-seed mean +2.2; docs/experiments.md has every number
and the variants tried).

Variants: ``experiments/toy.py:smoke=True`` (seconds, for tests).
"""

from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "toy"
    cfg.smoke = arg.smoke
    cfg.policy = "bf16"
    m = cfg.model
    # Sized for optimiser steps on a 2-core CPU: 2 dense layers of width 128 (0.4M params) at
    # <= 384 tokens per episode. Hybrid patterns ("SSSF", "SF") and depth are for accelerators.
    m.vocab_size = 512  # >= the code-repair tokenizer's vocabulary
    m.d_model = 128
    m.n_layers = 2
    m.layer_pattern = "DD"
    m.n_heads = 4
    m.n_kv_heads = 2
    m.head_dim = 32
    m.window = 256
    m.sparse_block_size = 16
    m.sparse_topk_tokens = 256
    m.d_ff = 384
    m.tie_embeddings = False  # a separate output projection learns this task better
    sft = cfg.sft
    sft.steps = 2300
    sft.batch_size = 16
    sft.lr = 3e-3
    sft.warmup_steps = 40
    sft.lm_weight = 0.5  # LM loss on program/observation tokens: copy skill, code prior
    # Before a fix, with probability 0.3: a wrong guess at the bug's word, a wrong edit of
    # another word, or a rejected call, then the fix (no loss on the mistake): RL then has a
    # search to sharpen.
    sft.detour_prob = 0.3
    sft.difficulties = (1,)  # medium
    # First 78% of the steps: demonstrations cropped to the 96 tokens ending with the fix (the
    # skill that decides success, at a quarter of the cost per step); the rest whole episodes.
    sft.curriculum_difficulties = (0, 1)
    sft.curriculum_fraction = 0.78
    sft.curriculum_crop_len = 96
    sft.buckets = (320, 384)
    ev = cfg.eval
    ev.split = "heldout"
    ev.difficulty = 1
    ev.n_episodes = 512  # paired standard error of the RL gain ~1.2-1.4 points
    # RL: GRPO groups of 4 on medium tasks, difficulty band 0.2-0.8, 16 groups per step, one
    # optimiser step per rollout batch, per-sequence loss, negative advantages at half weight.
    tr = cfg.train
    tr.rl_steps = 50
    tr.max_turns = 8
    tr.ckpt_every = 20
    d = cfg.data
    d.difficulties = (1,)
    d.batch_size = 16  # task groups per update
    d.group_size = 4  # rollouts per task
    d.max_refill_rounds = 2  # ~3/4 of the groups rolled out are all-equal (no gradient)
    ro = cfg.rollout
    ro.temperature = 1.0
    ro.max_new_tokens = 48
    ro.max_len = 512
    ro.chunk = 4
    ro.prefill_chunk = 64
    rl = cfg.rl
    rl.advantage = "grpo"
    rl.lr = 5e-4
    rl.ppo_epochs = 1
    rl.n_minibatches = 1
    rl.micro_batch = 16
    rl.loss.clip_high = 0.28  # clip-higher keeps entropy from collapsing
    rl.loss.negative_adv_weight = 0.5
    # Each episode weighs the same: under token-mean the long failed episodes' tokens dominate
    # the loss and entropy rises with greedy success flat.
    rl.loss.agg_mode = "seq-mean-token-mean"
    if arg.smoke:
        cfg.policy = "fp32"
        m.d_model = 32
        m.n_layers = 2
        m.n_heads = 2
        m.n_kv_heads = 1
        m.head_dim = 16
        m.d_ff = 64
        m.window = 32
        m.sparse_topk_tokens = 32
        sft.steps = 4
        sft.batch_size = 2
        sft.warmup_steps = 1
        sft.log_every = 2
        sft.difficulties = (0,)
        sft.curriculum_difficulties = ()
        sft.curriculum_fraction = 0.0
        sft.buckets = (320, 384)
        ev.difficulty = 0
        ev.n_episodes = 2
        ev.max_len = 384
        ev.max_new_tokens = 16
        ev.n_slots = 2
        tr.rl_steps = 2
        tr.max_turns = 2
        tr.ckpt_every = 1
        d.difficulties = (0,)
        d.batch_size = 2
        d.group_size = 2
        ro.max_new_tokens = 16
        ro.max_len = 384
        rl.micro_batch = 2
    return cfg
