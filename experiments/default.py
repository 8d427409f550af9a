"""The default experiment: a small agent trained on the code-repair task on a CPU.

``make train`` runs it: SFT warm start on scripted-expert demonstrations, then RL with
difficulty-filtered tasks, held-out evaluation before and after RL.

Variants: ``experiments/default.py:smoke=True`` (seconds, for tests).
"""

import dataclasses

import ml_collections

from agentrl_jax.config import base_config, parse_arg


def _section(cfg, name, cls):
    """``cfg[name]`` as registered by the lead, or created from ``cls`` defaults if missing."""
    if name not in cfg:
        cfg[name] = ml_collections.ConfigDict(dataclasses.asdict(cls()))
    return cfg[name]


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "default"
    cfg.smoke = arg.smoke
    cfg.policy = "bf16"
    m = cfg.model
    # Sized for optimiser steps on a 2-core CPU (the SFT stage has ~15 minutes): 2 dense layers
    # of width 128 (0.4M params) at <= 384 tokens per episode; ~1.5 CPU-s per step at batch 16.
    # Hybrid patterns ("SSSF", "SF") and depth are for accelerators: --set model.layer_pattern.
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
    # A separate output projection: SFT from the same recipe reached held-out greedy / sampled
    # 69.5% / 67.2% untied vs 55.5% / 50.8% tied (2026-12-03, after the unit-rms embedding init).
    m.tie_embeddings = False

    from agentrl_jax.train.evaluate import EvalConfig
    from agentrl_jax.train.sft import SFTConfig

    sft = _section(cfg, "sft", SFTConfig)
    sft.steps = 2300
    sft.batch_size = 16
    sft.lr = 3e-3
    sft.warmup_steps = 40
    sft.lm_weight = 0.5  # LM loss on program/observation tokens: copy skill, code prior
    # Before a fix: a wrong guess at the bug's word, a wrong edit of another word, or a rejected
    # call, then the fix (no loss on the mistake). The wrong guesses (session 8) let RL learn a
    # search: after them, greedy dropped-operator repairs went 6/14 -> 13/14 held-out in RL.
    # sft.max_guesses=3 (up to 3 guesses in a row; session 10): SFT 75.0% / 71.1%, RL 72.7% /
    # 70.3% (-2.3 / -0.8); left at 1.
    sft.detour_prob = 0.3
    sft.difficulties = (1,)  # medium
    # First 78% of steps: demonstrations cropped to the 96 tokens ending with the fix (the run
    # output that locates the bug, then the edit): ~0.2 CPU-s per step vs ~0.8 for whole
    # episodes; the rest on whole episodes (run, recover, submit).
    sft.curriculum_difficulties = (0, 1)
    sft.curriculum_fraction = 0.78
    sft.curriculum_crop_len = 96
    sft.buckets = (320, 384)
    ev = _section(cfg, "eval", EvalConfig)
    ev.split = "heldout"
    ev.difficulty = 1
    # 512 tasks: +-1.9 points standard error at 75% success, +-1.4 on the paired RL gain (128
    # tasks gave +-2.5 to 3.3 paired, and their gains ran 2-4 points above the 512-task one).
    ev.n_episodes = 512
    # RL stage: GRPO groups of 4 on medium tasks (the held-out level), difficulty band 0.2-0.8,
    # 16 task groups per step, one optimiser step per rollout batch, per-sequence loss
    # aggregation, negative advantages at half weight. On 512 held-out tasks (session 17) this
    # took session 14's SFT checkpoint from 74.0% to 78.3% greedy (+4.3 +- 1.4 paired) and
    # 71.1% to 75.4% sampled; its first 128 tasks had read +6.3. Over RL seeds 0-4 the greedy
    # gain is +4.3, +0.8, +1.2, +2.9, +2.0 (mean +2.2, session 19); on session 20's machine,
    # from its own SFT checkpoint (74.2%), +2.0 (`make train`) and +1.0 at seed 1. The
    # variants measured since session 7 (more steps, groups of 8, GiGPO, KL, entropy bonus,
    # process penalties, learning rates, turn limits, stratum and bug-type selection, expert
    # and on-policy guidance, a learned critic, deeper or wider-headed models, SFT variants)
    # gained no more: the README's
    # status section sums them up and its experiment log has each run's numbers.
    tr = cfg.train
    tr.rl_steps = 50
    tr.advantage = "grpo"
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
    rl.lr = 5e-4
    rl.ppo_epochs = 1
    rl.n_minibatches = 1
    rl.micro_batch = 16
    rl.loss.clip_high = 0.28  # clip-higher keeps entropy from collapsing
    # Negative advantages at half weight (session 14, RL from the same SFT checkpoint): held-out
    # greedy 72.7% -> 78.9% (+6.3 +- 3.3 paired; logic 31 -> 47%), sampled 73.4% -> 73.4%; on 128
    # fresh held-out tasks (eval --seed 1) 71.9% -> 80.5% greedy (+8.6 +- 3.1), 71.1% -> 78.9%
    # sampled. At weight 1.0: 73.4% / 70.3%.
    rl.loss.negative_adv_weight = 0.5
    # Each episode weighs the same: under token-mean the long failed episodes' tokens dominated
    # the loss and entropy rose (0.40 -> 0.68 in the run above) with greedy success flat.
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
        # One update per step: smoke batches (2 groups of 2, or fewer) are too small for 2
        # minibatches of micro_batch 2.
        rl.ppo_epochs = 1
        rl.n_minibatches = 1
    return cfg
