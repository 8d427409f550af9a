"""The practice guide's architecture at CPU scale, trained SFT -> RL on the code-repair task.

What the guide recommends for long agentic rollouts, in one run:
  * narrow and deep hybrid attention: an ``SSSF`` pattern (three gated sliding-window layers, one
    sparse GQA full-attention layer), 4 layers;
  * MoE FFNs (4 experts, top-2) with routing replay in training (``rl.use_routing_replay``);
  * sparse full attention over 8-token blocks reading only its top-k blocks from the page pool
    (``model.sparse_gather``); the selection is recorded per layer and token in the rollout and
    replayed in training (``rollout.record_blocks``, ``rl.use_block_replay``). The guide's top-k
    4096 tokens is sized for ~1M-token contexts; for these <= 512-token episodes it is 64 tokens
    (8 blocks), the same share of a 32k context as 4096 is of 2M;
  * attention-driven KV compression of finished tool outputs: blocks later tokens attend to
    least are evicted, the rest of the low-attention ones moved to int8 pages, in a shared page
    pool smaller than the slots' worst case (freed pages are reused), replayed in training
    (``rl.use_kv_mask_replay``);
  * a parity dtype policy (``fp32-parity``: on a CPU fp32; ``bf16-parity`` on accelerators), so
    with the replays the trainer's logprobs are the sampler's (the mismatch metrics read 0).

Sized for about an hour on a 2-core CPU: 800 SFT steps, 10 RL steps of 8 task groups x 4,
held-out evaluation on 128 medium tasks (one greedy and one sampled episode each). It holds
about 4.5 GB of host memory while it runs.

    agentrl train experiments/guide_small.py                 # SFT + RL
    agentrl train experiments/guide_small.py:smoke=True      # minutes

Its summary against the default experiment's: docs/experiments.md.
"""

from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "guide_small"
    cfg.smoke = arg.smoke
    cfg.policy = "fp32-parity"
    m = cfg.model
    m.vocab_size = 512  # >= the code-repair tokenizer's vocabulary
    m.d_model = 96
    m.n_layers = 4
    m.layer_pattern = "SSSF"
    m.n_heads = 4
    m.n_kv_heads = 2
    m.head_dim = 24
    m.window = 64
    m.sparse_block_size = 8
    m.sparse_topk_tokens = 64
    m.sparse_gather = True
    m.n_experts = 4
    m.experts_per_token = 2
    m.d_expert = 128
    m.tie_embeddings = False
    sft = cfg.sft
    sft.steps = 800
    sft.batch_size = 16
    sft.lr = 3e-3
    sft.warmup_steps = 40
    sft.lm_weight = 0.5
    sft.detour_prob = 0.3
    sft.difficulties = (1,)
    sft.curriculum_difficulties = (0, 1)
    sft.curriculum_fraction = 0.75
    sft.curriculum_crop_len = 96
    sft.buckets = (320, 384)
    ev = cfg.eval
    ev.split = "heldout"
    ev.difficulty = 1
    ev.n_episodes = 128
    tr = cfg.train
    tr.rl_steps = 10
    tr.max_turns = 8
    tr.ckpt_every = 10
    d = cfg.data
    d.difficulties = (1,)
    d.batch_size = 8  # task groups per update
    d.group_size = 4
    d.max_refill_rounds = 2
    ro = cfg.rollout
    ro.max_new_tokens = 48
    ro.max_len = 512
    ro.chunk = 4  # the parity policy's chunk: sampler and trainer run the same chunks
    ro.page_size = 16
    ro.record_blocks = True
    # finished tool outputs with an attention share under 1 are compressed: under 0.5 evicted,
    # the others moved to int8 pages
    ro.eviction_threshold = 1.0
    ro.eviction_int8 = True
    ro.eviction_drop_threshold = 0.5
    slots = d.batch_size * d.group_size
    ro.n_pages = slots * 20  # 320 tokens of float pages per slot on average (max_len 512)
    ro.int8_pages = slots * 8
    rl = cfg.rl
    rl.advantage = "grpo"
    rl.lr = 5e-4
    rl.ppo_epochs = 1
    rl.n_minibatches = 1
    rl.micro_batch = slots  # the sampler's batch: the recompute is bitwise the rollout's
    rl.use_routing_replay = True
    rl.use_kv_mask_replay = True
    rl.use_block_replay = True
    rl.loss.clip_high = 0.28
    rl.loss.negative_adv_weight = 0.5
    rl.loss.agg_mode = "seq-mean-token-mean"
    if arg.smoke:
        m.d_model = 32
        m.n_heads = 2
        m.n_kv_heads = 1
        m.head_dim = 16
        m.window = 32
        m.sparse_topk_tokens = 32
        m.n_experts = 2
        m.d_expert = 32
        sft.steps = 4
        sft.batch_size = 2
        sft.warmup_steps = 1
        sft.log_every = 2
        sft.difficulties = (0,)
        sft.curriculum_difficulties = ()
        sft.curriculum_fraction = 0.0
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
        ro.n_pages = 4 * 16
        ro.int8_pages = 4 * 8
        rl.micro_batch = 4
    return cfg
