"""Repairing real Python: HumanEval problems with injected bugs, tests run in a sandbox.

The environment (``agentrl_jax.envs.pyrepair``) speaks bytes: prompts and observations are
2-4k tokens, so the model and the rollout cache are sized for 8k-token episodes (hybrid
sliding-window / sparse full attention keeps the cache small). SFT imitates the scripted
expert, RL uses GRPO groups on the train problems; the held-out problems are never trained on.
On a CPU only the smoke variant is practical (a tiny model, seconds of SFT and RL: learning is
not expected at that size); with a pretrained chat model the same environment is played through
``agentrl_jax.hf`` (see ``experiments/qwen3_rl.py``).

    agentrl train experiments/pyrepair.py:smoke=True
"""

from agentrl_jax.config import parse_arg
from agentrl_jax.envs.pyrepair import BUG_TYPES, BUGS_PER_DIFFICULTY, HELDOUT_COMBO
from agentrl_jax.experiment import base_config


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "pyrepair"
    cfg.env = "pyrepair"
    cfg.smoke = arg.smoke
    cfg.policy = "bf16"
    m = cfg.model
    m.vocab_size = 272  # >= the byte tokenizer's 265 ids
    m.d_model = 512
    m.n_layers = 8
    m.layer_pattern = "SSSF"
    m.n_heads = 8
    m.n_kv_heads = 2
    m.head_dim = 64
    m.window = 512
    m.sparse_block_size = 16
    m.sparse_topk_tokens = 1024
    m.d_ff = 1536
    m.tie_embeddings = False
    d = cfg.data
    d.bug_types = BUG_TYPES
    d.bugs_per_difficulty = BUGS_PER_DIFFICULTY
    d.heldout_combo = tuple(sorted(HELDOUT_COMBO))
    d.difficulties = (0, 1, 2)
    d.batch_size = 8
    d.group_size = 4
    sft = cfg.sft
    sft.steps = 2000
    sft.batch_size = 8
    sft.lr = 1e-3
    sft.detour_prob = 0.0  # the Python expert makes no detours
    sft.difficulties = (0, 1, 2)
    sft.curriculum_difficulties = ()
    sft.curriculum_fraction = 0.0
    sft.buckets = (4096, 6144, 8192)
    ev = cfg.eval
    ev.difficulty = 0
    ev.n_episodes = 128
    ev.max_len = 8192
    ev.max_new_tokens = 256
    ev.n_slots = 16
    tr = cfg.train
    tr.rl_steps = 200
    tr.max_turns = 10
    ro = cfg.rollout
    ro.max_len = 8192
    ro.max_new_tokens = 256
    ro.prefill_chunk = 256
    rl = cfg.rl
    rl.lr = 1e-4
    rl.micro_batch = 4
    rl.loss.clip_high = 0.28
    if arg.smoke:
        cfg.policy = "fp32"
        m.d_model = 32
        m.n_layers = 2
        m.layer_pattern = "DD"
        m.n_heads = 2
        m.n_kv_heads = 1
        m.head_dim = 16
        m.d_ff = 64
        sft.steps = 2
        sft.batch_size = 1
        sft.warmup_steps = 1
        sft.log_every = 1
        sft.difficulties = (0,)
        ev.n_episodes = 2
        ev.max_len = 4096
        ev.max_new_tokens = 16
        ev.n_slots = 2
        ev.prefill_chunk = 256
        tr.rl_steps = 1
        tr.max_turns = 2
        tr.ckpt_every = 1
        d.difficulties = (0,)
        d.batch_size = 1
        d.group_size = 2
        d.max_refill_rounds = 0
        ro.max_len = 4096
        ro.max_new_tokens = 16
        rl.micro_batch = 2
    return cfg
