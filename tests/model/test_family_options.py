"""The pretrained-family options of ModelConfig against references written from their
definitions: YaRN / linear RoPE, attention sinks in every path, the clamped SwiGLU, routing
variants with router and expert biases, and the validation of every new field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.experts import clamped_swiglu_reference, expert_activation
from agentrl_jax.model.moe import MoE, moe_reference
from agentrl_jax.model.rope import apply_rope, rope_reference
from agentrl_jax.model.sinks import sink_attention, sink_attention_reference
from agentrl_jax.model.transformer import Transformer, forward_chunked, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler

FP32 = get_policy("fp32")


@pytest.mark.parametrize(
    "scaling",
    [
        dict(rope_scaling="yarn", rope_factor=32.0, rope_original_max_len=64, yarn_truncate=False),
        dict(rope_scaling="yarn", rope_factor=8.0, rope_original_max_len=128),
        dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=32, yarn_beta_fast=8.0),
        dict(rope_scaling="yarn", rope_factor=2, rope_original_max_len=32, rope_attention_factor=2),
        dict(rope_scaling="linear", rope_factor=4.0),
    ],
)  # fmt: skip
def test_scaled_rope_matches_reference(scaling):
    """Positions below 256: the float32 angle ``p * inv_freq`` (as the HF reference computes it)
    is then within ~2e-5 rad of the float64 one."""
    cfg = ModelConfig(head_dim=32, rope_theta=150000.0, **scaling)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 9, 3, 32)).astype(np.float32)
    pos = rng.integers(0, 256, (2, 9)).astype(np.int32)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), cfg))
    np.testing.assert_allclose(got, rope_reference(x, pos, cfg), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [4, 1000])
def test_sink_attention_matches_reference(window):
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 12, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 12, 2, 8)).astype(np.float32) for _ in range(2))
    sinks = rng.normal(size=(4,)).astype(np.float32) * 2
    got = sink_attention(*map(jnp.asarray, (q, k, v, sinks)), window=window, policy=FP32)
    want = sink_attention_reference(q, k, v, sinks, window)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_clamped_swiglu_matches_reference():
    cfg = ModelConfig(expert_act="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0)
    rng = np.random.default_rng(2)
    g, u = (rng.normal(size=(64,)).astype(np.float32) * 6 for _ in range(2))
    got = expert_activation(jnp.asarray(g), jnp.asarray(u), cfg)
    np.testing.assert_allclose(
        np.asarray(got), clamped_swiglu_reference(g, u, 1.702, 7.0), rtol=1e-5
    )
    assert np.abs(g).max() > 7 and np.abs(u).max() > 7  # the clamps are exercised


@pytest.mark.parametrize(
    "opts",
    [
        dict(
            routing="topk_softmax", router_bias=True, expert_bias=True, expert_act="clamped_swiglu"
        ),
        dict(route_renorm=False, router_bias=True),
    ],
)  # fmt: skip
def test_moe_family_variants_match_reference(opts):
    cfg = ModelConfig(
        d_model=32, n_experts=4, experts_per_token=2, d_expert=16, init_std=0.3, **opts
    )
    mod = MoE(cfg, FP32)
    x = jax.random.normal(jax.random.key(3), (2, 5, 32))
    params = jax.tree.map(
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(4), a.shape),
        nn.unbox(mod.init(jax.random.key(5), x))["params"],
    )  # biases away from their zero init
    (y, routes, _), (y_ref, routes_ref) = jax.jit(
        lambda p: (mod.apply({"params": p}, x), moe_reference(p, x, cfg))
    )(params)
    np.testing.assert_array_equal(np.asarray(routes), np.asarray(routes_ref))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5)


SINK_CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
    layer_pattern="SD", window=6, d_ff=48, attn_sinks=True, attn_bias=True, qk_norm=True,
    window_gate=False, scaled_embeddings=False, norm_offset=False, tie_embeddings=False,
    rope_scaling="yarn", rope_factor=4.0, rope_original_max_len=16, init_std=0.3,
)  # fmt: skip


def _sink_params():
    params = init_params(Transformer(SINK_CFG, FP32), jax.random.key(6))
    return jax.tree.map(lambda a: a + 0.5 * jax.random.normal(jax.random.key(7), a.shape), params)


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_sink_model_chunked_and_decode_match_teacher_forced():
    """Sinks on every path: teacher-forced, chunked prefill against the ring / paged cache, and
    the sampler's decode (whose D layers then skip the paged decode kernel)."""
    model, params = Transformer(SINK_CFG, FP32), _sink_params()
    tokens = jax.random.randint(jax.random.key(8), (2, 21), 0, 64)
    teacher, chunked = jax.jit(
        lambda p: (
            model.apply(p, tokens)[0],
            forward_chunked(model, p, tokens, chunk=4, page_size=8, max_len=32)[0],
        )
    )(params)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(teacher), atol=2e-5)
    sampler = get_sampler(model, RolloutConfig(max_new_tokens=8, max_len=32, page_size=8))
    state = sampler.init_state(2)
    toks = np.zeros((2, sampler.prefill_width(13)), np.int32)
    toks[:, :13] = np.asarray(tokens[:, :13])
    state, _ = sampler.prefill(params, state, toks, np.full(2, 13, np.int32))
    _, out = sampler.decode(
        params, state, jax.random.key(9), np.arange(2, dtype=np.int32), np.ones(2, bool),
        np.full(2, 8, np.int32), np.int32(2), None,
    )  # fmt: skip
    seq = jnp.concatenate([tokens[:, :13], jnp.asarray(out.tokens)], axis=1)
    logits = jax.jit(model.apply)(params, seq)[0]
    logp = jax.nn.log_softmax(logits[:, 12:-1], -1)
    want = jnp.take_along_axis(logp, seq[:, 13:, None], -1)[..., 0]
    # float32, two summation orders (the one-row decode against the teacher pass) through four
    # layers of weights at std ~0.6: the rounding scales with the logprob (up to 7e-6 of it seen
    # on AVX-512 machines), hence a relative term beside the absolute one
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_sinks_change_the_output():
    """A sink model with its sinks at -inf computes what the model without sinks computes (up
    to float rounding: that model attends through the kernels, the sink model through
    ``model.sinks``), and its real sinks change the logits."""
    params = _sink_params()
    tokens = jax.random.randint(jax.random.key(10), (1, 10), 0, 64)
    no_sink_cfg = SINK_CFG.replace(attn_sinks=False)
    stripped = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.full_like(a, -1e30) if "sinks" in jax.tree_util.keystr(p) else a, params
    )
    plain = {"params": jax.tree.map(lambda a: a, stripped["params"])}
    for layer in plain["params"]["groups"].values():
        layer["attn"].pop("sinks")
    apply = jax.jit(lambda cfg, p: Transformer(cfg, FP32).apply(p, tokens)[0], static_argnums=0)
    with_sinks = apply(SINK_CFG, params)
    minus_inf, without = apply(SINK_CFG, stripped), apply(no_sink_cfg, plain)
    np.testing.assert_allclose(np.asarray(minus_inf), np.asarray(without), atol=1e-5)
    assert np.abs(np.asarray(with_sinks) - np.asarray(without)).max() > 1e-3


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("qk_norm", 1, "qk_norm=1 must be a bool"),
        ("rope_scaling", "ntk", "rope_scaling='ntk'; allowed"),
        ("routing", "sigmoid", "routing='sigmoid'; allowed"),
        ("expert_act", "gelu", "expert_act='gelu'; allowed"),
        ("attn_sinks", True, "attn_sinks=True needs a layer_pattern over S and D"),
        ("rope_factor", 0.5, "rope_factor=0.5 must be >= 1"),
        ("rope_scaling", "yarn", "rope_original_max_len=0 must be > 0"),
        ("yarn_beta_slow", 40.0, "yarn_beta_fast=32.0 must be > yarn_beta_slow=40.0"),
        ("rope_attention_factor", -1.0, "rope_attention_factor=-1.0 must be >= 0"),
        ("swiglu_limit", 0.0, "swiglu_limit=0.0 must be > 0"),
        ("swiglu_alpha", -1.0, "swiglu_alpha=-1.0 must be > 0"),
    ],
)
def test_family_fields_are_validated(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{field: value})
