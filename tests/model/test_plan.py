"""``agentrl plan``: published parameter counts, KV at the asked context, per-device bytes as
training places them, the activation estimate against XLA's memory analysis, fit and advice."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from agentrl_jax.hf.families import qwen3_moe_config
from agentrl_jax.model import plan
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.state import RLConfig, rl_optimizer
from agentrl_jax.rl.update import make_grad_fn, prepare_batch
from agentrl_jax.sharding import MeshConfig
from agentrl_jax.train.placement import Placement

# Qwen3-30B-A3B's config.json (the fields the mapping reads)
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
}
BF16 = get_policy("bf16")


def test_qwen3_30b_a3b_matches_published_counts():
    """Published (model card): 30.5B total, 3.3B activated, to 0.1B (embeddings and the output
    projection count: 30.53B and 3.35B here)."""
    counts = plan.count_params(qwen3_moe_config(QWEN3_30B_A3B), BF16)
    assert 30.5e9 <= counts["total"] < 30.6e9
    assert 3.3e9 <= counts["active"] < 3.4e9


def test_kv_bytes_follow_the_context():
    cfg = ModelConfig(layer_pattern="SSSF", window=64, n_layers=8)
    out = plan.make_plan(cfg, BF16, 8, MeshConfig(), 4096)
    assert out["kv_bytes_per_seq_ring"] == plan.kv_bytes(cfg, 2, 4096)["kv_bytes_per_seq_ring"]
    assert out["kv_bytes_per_seq_dense"] == 8 * 2 * 2 * 32 * 2 * 4096  # L * (k, v) * K * H * 2B
    assert out["kv_bytes_per_seq_1m_dense"] == out["kv_bytes_per_seq_dense"] * 256


def test_per_device_bytes_are_those_training_places():
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="D", n_experts=4, experts_per_token=2, d_expert=16,
    )  # fmt: skip
    policy, mesh_cfg = get_policy("fp32"), MeshConfig(fsdp=4, tensor=2)
    placement = Placement(mesh_cfg, cfg, policy)
    tx = rl_optimizer(RLConfig())
    params = init_params(Transformer(cfg, policy), jax.random.key(0))
    state = placement.init_state(params, RLConfig(), jax.random.key(1), tx)
    on_device = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    out = plan.memory_per_device(
        cfg, policy, mesh_cfg.shape(8), mesh_cfg.logical_rules(), plan.RunShape(8, 8, 16, 8), "cpu"
    )
    assert out["param_bytes_per_device"] == on_device(state.params)
    scalars = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
    assert out["opt_state_bytes_per_device"] == on_device(state.opt_state) - scalars


def _measured_activations(cfg: ModelConfig, policy, rows: int, seq: int) -> int:
    """XLA's temp bytes of the compiled gradient pass of one micro-batch (the update's)."""
    model = Transformer(cfg, policy)
    rl = RLConfig()
    grad_fn = make_grad_fn(model, rl)

    def grads(params, batch):
        g, metrics, _ = grad_fn(params, prepare_batch(batch, rl, model))
        return g, metrics["loss"]

    params = jax.eval_shape(
        lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    )
    spec = lambda dtype: jax.ShapeDtypeStruct((rows, seq), dtype)  # noqa: E731
    batch = {
        "tokens": spec(jnp.int32),
        "valid": spec(bool),
        "action_mask": spec(bool),
        "advantages": spec(jnp.float32),
        "rollout_logprobs": spec(jnp.float32),
    }
    compiled = jax.jit(grads).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


BASE = ModelConfig(
    vocab_size=512, d_model=128, n_layers=2, layer_pattern="DD", n_heads=4, n_kv_heads=2,
    head_dim=32, d_ff=384, window=256, sparse_block_size=16, sparse_topk_tokens=256,
)  # fmt: skip


@pytest.mark.parametrize(
    "cfg,rows,seq",
    [
        (BASE.replace(layer_pattern="SF", n_layers=4), 4, 1024),  # S and F, a scanned depth
        (BASE.replace(layer_pattern="D", n_experts=8, experts_per_token=2, d_expert=128), 8, 512),
    ],
    ids=["SF", "moe"],
)
def test_activation_estimate_against_memory_analysis(cfg, rows, seq):
    """The estimate is within [0.75, 1.35] of XLA's temp bytes on this CPU (the XLA attention
    paths); ratios over 14 configs (S, D, F and SF depths, T 256-2048, windows 128/256, MoE,
    remat='full'): 0.79-1.24."""
    measured = _measured_activations(cfg, BF16, rows, seq)
    estimate = plan.activation_bytes(cfg, BF16, rows, seq, "cpu")
    assert 0.75 <= estimate / measured <= 1.35, (estimate, measured)


def test_flash_kernels_keep_no_scores():
    """Flash kernels keep row statistics per head; the XLA paths keep fp32 probabilities over
    each query chunk's keys (a 512-key band, or the keys up to the chunk's end)."""
    cfg = BASE.replace(layer_pattern="SSSD", n_layers=4, head_dim=128, window=512)
    xla = plan.activation_bytes(cfg, BF16, 1, 8192, "cpu")
    gpu = plan.activation_bytes(cfg, BF16, 1, 8192, "gpu")  # cuDNN for S and D layers
    assert gpu < xla / 4
    for kind in "SD":
        assert plan._attention_bytes(cfg, 2, kind, 8192, "cudnn") == 8 * cfg.n_heads
        assert plan._attention_bytes(cfg, 2, kind, 8192, "xla") > 4 * cfg.n_heads * 512


def test_fit_and_suggestion():
    cfg = ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=32, layer_pattern="D", n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=14336, remat="full",
    )  # fmt: skip
    run = plan.RunShape(batch_rows=64, micro_rows=64, seq=4096, slots=64)
    out = plan.make_plan(cfg, BF16, 8, MeshConfig(), 4096, run=run, accelerator="v6e")
    assert out["mesh"]["data"] == 8 and not out["fits"] and out["peak_fraction"] > 0.85
    suggestion = out["suggestion"]
    mesh, micro = suggestion["mesh"], suggestion["micro_batch"]
    mesh_cfg = MeshConfig(**mesh)
    again = plan.make_plan(
        cfg,
        BF16,
        8,
        mesh_cfg,
        4096,
        run=dataclasses.replace(run, micro_rows=micro),
        accelerator="v6e",
    )
    assert again["fits"] and again["peak_fraction"] <= 0.85
    tiny = plan.make_plan(cfg, BF16, 1, MeshConfig(), 4096, run=run, accelerator="v6e")
    assert tiny["suggestion"]["min_devices"] > 1
    with pytest.raises(ValueError, match="accelerator"):
        plan.make_plan(cfg, BF16, 8, MeshConfig(), 4096, accelerator="a100")
    assert np.isclose(plan.ACCELERATORS["h100"][0] / 2**30, 79.65, atol=0.01)
