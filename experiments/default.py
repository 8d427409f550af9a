"""The default experiment: a small agent trained on the code-repair task on a CPU.

``make train`` runs it: SFT warm start on scripted-expert demonstrations, then RL with
difficulty-filtered tasks, held-out evaluation before and after RL.

Variants: ``experiments/default.py:smoke=True`` (seconds, for tests).
"""

from agentrl_jax.config import base_config, parse_arg


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "default"
    cfg.smoke = arg.smoke
    cfg.policy = "bf16"
    m = cfg.model
    m.vocab_size = 512  # >= the code-repair tokenizer's vocabulary
    m.d_model = 128
    m.n_layers = 4
    m.layer_pattern = "SSSF"
    m.n_heads = 4
    m.n_kv_heads = 2
    m.head_dim = 32
    m.window = 256
    m.sparse_block_size = 16
    m.sparse_topk_tokens = 256
    m.d_ff = 384
    if arg.smoke:
        cfg.policy = "fp32"
        m.d_model = 32
        m.n_layers = 4
        m.n_heads = 2
        m.n_kv_heads = 1
        m.head_dim = 16
        m.d_ff = 64
        m.window = 32
        m.sparse_topk_tokens = 32
    return cfg
