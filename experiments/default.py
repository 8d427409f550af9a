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
    ev.n_episodes = 128  # +-4 points standard error at 40% success
    # RL stage: GRPO groups of 4 on medium tasks (the held-out level), difficulty band 0.2-0.8,
    # 16 task groups per step and one optimiser step per rollout batch, per-sequence loss
    # aggregation. Session 9 (bound-variable guesses in SFT; SFT 71.9% / 73.4% on that machine):
    # this config 74.2% / 74.2% (+2.3 / +0.8); data.skip_strata=True with band 0.1-0.9 and
    # k_samples=32: 77.3% / 71.9%, 20% of greedy episodes out of turns (README).
    # Session 12 (same SFT checkpoint, 71.9% / 73.4%): this config 74.2% / 71.9% (make train,
    # 20.5 min); train.advantage=gigpo (step_std=False) for 90 steps 72.7% / 70.3% (78.1% greedy
    # at step 60); data.batch_size=32 for 60 steps 75.0% / 73.4%; sft.steps=1200: SFT 40.6%,
    # RL 43.0% / 46.1%; rollout.temperature=0.6 72.7% / 71.1% (README).
    # Session 13 (same checkpoint): train.greedy_member=True 71.1% / 68.8% (75.8% at step 20-30);
    # with only the `repeated` penalty (episode_process) 73.4% / 73.4%; with rl.decay_steps=50
    # 74.2% greedy, the steadiest curve; rl.lr=1e-3 with decay 76.6% / 75.8%, but 73.4% on 128
    # other held-out tasks (eval --seed 1) where this config's run reached 74.2% (README).
    # Session 14 (same checkpoint; env refuses no-change edits, SFT greedy 72.7%): this config
    # with negative_adv_weight 1.0 73.4% / 70.3%; + data.group_size=8 75.8% / 72.7% (pass@8
    # 84.4% -> 80.5%); 200 steps with decay: 72.7-75.8% at every evaluation; at 0.5 (below)
    # 78.9% / 73.4% (README).
    # Session 15 (same checkpoint, all at negative weight 0.5): weight 0.25 75.0% / 69.5%;
    # train.rl_steps=100 80.5% / 76.6% (79.7% / 78.9% on the fresh tasks, +7.8 there: no
    # better than 50 steps' +8.6); 8 groups of 8 75.0% / 75.8%; data.skip_strata=True (band
    # 0.1-0.9, k_samples=32) 71.9% / 71.9%; entropy_coef=0.01 77.3% / 73.4%; the `repeated`
    # penalty alone (episode_process, 0.5) 75.8% / 74.2%; this config with seed=1 75.0% / 72.7%
    # (+2.3; +5.5 on the fresh tasks): the gain depends on the RL seed (README).
    # Session 16: SFT with sft.learn_guesses=True, max_guesses=3 (the wrong guesses trained on):
    # SFT 70.3% / 68.8%, RL 75.8% / 72.7% (+5.5); with detour_prob=0.5 69.5% -> 71.9% (+2.3).
    # From the usual checkpoint: gigpo (step_std=False) 76.6% / 72.7% (+3.9); train.max_turns=10
    # 71.1% / 73.4% (-1.6) (README).
    # With the wrong-guess detours in SFT (session 8; 128 held-out episodes, SFT
    # greedy / sampled 68.8% / 71.1%): this config 76.6% / 73.4% (+7.8 / +2.3), seed=1 and
    # seed=2 75.0% / 71.1% (+6.3 / +0.0); rl.lr=1e-3 71.1% / 73.4%; train.max_turns=10 69.5% /
    # 75.0%; sft.detour_prob=0.5: SFT
    # 74.2% / 72.7%, RL 75.0% / 72.7%; train.advantage=episode_process with only the
    # rejected-call penalty (process_weight 0.5): 70.3% / 71.9%, truncated greedy episodes 20%
    # (2% without it).
    # Before them (session 7; SFT 69.5% / 67.2%):
    #   this config (50 steps): 71.9% / 71.1%, entropy flat (0.23 -> 0.23), truncated greedy /
    #     sampled episodes 14.8% / 19.5% -> 2% / 4%; seed=1: 73.4% / 71.1%, entropy 0.25 -> 0.20;
    #   8 groups, 100 steps, 4 PPO epochs x 2 minibatches at lr 2e-4 (the default until session
    #     7): 73.4% / 70.3% and 71.9% / 70.3% (seeds 0, 1), entropy 0.27 -> 0.74 / 0.87: each
    #     batch's few tasks are fitted over 8 optimiser steps and the fit is noise on others;
    #   8 groups, 100 steps, one optimiser step at lr 5e-4: 71.9% / 69.5%; at lr 1e-3:
    #     68.8% / 66.4%;
    #   old recipe with train.max_turns=10: 70.3% / 71.1%; loss.negative_adv_weight=0.5:
    #     71.9% / 64.8%; group_size=8, batch_size=4: 66.4% / 64.8%.
    # All within the +-4-point evaluation noise of each other (README); this one keeps entropy
    # from climbing and the agent from running out of turns.
    # Before the init fix the model could not copy tokens from its context (SFT 30-38% greedy);
    # RL recipes measured then (token-mean vs per-sequence aggregation, 1 vs 4 epochs, KL,
    # clip-higher, band filter, step-level groups) are in the README's history.
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
