"""The guide's reference architecture: a narrow-and-deep sparse MoE, ~100B total parameters.

96 layers of pattern SSSF (three gated sliding-window layers per sparse full-attention layer,
3:1), sparse GQA with blocks of 8 tokens and top-k 4096 tokens, 128 experts (top-8) plus one
shared expert. Meant for accelerator pods; on a CPU use ``agentrl plan`` (nothing is allocated)
or the smoke variant.

    agentrl plan experiments/seed_moe_100l.py --devices 256
"""

from agentrl_jax.config import parse_arg
from agentrl_jax.experiment import base_config


def get_config(arg=None):
    arg = parse_arg(arg, smoke=False)
    cfg = base_config()
    cfg.name = "seed_moe_100l"
    cfg.smoke = arg.smoke
    cfg.policy = "bf16"
    m = cfg.model
    m.vocab_size = 131072
    m.d_model = 2560
    m.n_layers = 96
    m.layer_pattern = "SSSF"
    m.n_heads = 32
    m.n_kv_heads = 4
    m.head_dim = 128
    m.window = 4096
    m.sparse_block_size = 8
    m.sparse_topk_tokens = 4096
    m.n_experts = 128
    m.experts_per_token = 8
    m.n_shared_experts = 1
    m.d_expert = 1024
    m.capacity_factor = 1.25
    m.remat = "full"
    m.rope_theta = 1_000_000.0
    cfg.mesh.data = 1
    cfg.mesh.fsdp = -1
    cfg.mesh.expert = 8
    if arg.smoke:  # same shape of model, tiny sizes: runs a step on a CPU
        m.vocab_size = 256
        m.d_model = 64
        m.n_layers = 8
        m.n_heads = 4
        m.n_kv_heads = 2
        m.head_dim = 16
        m.window = 16
        m.sparse_topk_tokens = 16
        m.n_experts = 8
        m.experts_per_token = 2
        m.d_expert = 32
        m.capacity_factor = 0.0
        m.remat = "none"
        cfg.policy = "fp32"
        cfg.mesh.fsdp = 1
        cfg.mesh.expert = 1
        cfg.mesh.data = -1
    return cfg
