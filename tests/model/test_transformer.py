"""Transformer: causality, attention kinds vs references, chunked path, replay, gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.attention import masked_attention, select_blocks, sparse_coverage
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.decode_params import unstack_groups
from agentrl_jax.model.transformer import (
    CacheSpec,
    Transformer,
    forward_chunked,
    init_cache,
    init_params,
    token_logprobs,
)
from agentrl_jax.precision import get_policy

TINY = dict(
    vocab_size=64,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    window=4,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    d_ff=48,
    init_std=0.2,
)
MOE = dict(n_experts=4, experts_per_token=2, d_expert=16, n_shared_experts=1)


def make(pattern="SFD", n_layers=3, moe=False, policy="fp32", **kw):
    cfg = ModelConfig(
        layer_pattern=pattern, n_layers=n_layers, **{**TINY, **(MOE if moe else {}), **kw}
    )
    model = Transformer(cfg, get_policy(policy))
    params = init_params(model, jax.random.key(0))
    return cfg, model, params


def tokens_for(cfg, b, t, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)


def test_causality():
    cfg, model, params = make(moe=True)
    fwd = jax.jit(model.apply)
    toks = tokens_for(cfg, 2, 20)
    logits, _, _ = fwd(params, toks)
    changed = toks.at[:, 13].set((toks[:, 13] + 1) % cfg.vocab_size)
    logits2, _, _ = fwd(params, changed)
    np.testing.assert_array_equal(np.asarray(logits[:, :13]), np.asarray(logits2[:, :13]))
    assert not np.allclose(np.asarray(logits[:, 13:]), np.asarray(logits2[:, 13:]))
    assert logits.dtype == jnp.float32


def test_full_topk_sparse_equals_dense():
    """F with top-k covering the whole context == D (identical parameter trees)."""
    t = 24
    _, model_f, params = make("FF", 2, sparse_topk_tokens=32)
    cfg_d = model_f.cfg.replace(layer_pattern="DD")
    model_d = Transformer(cfg_d, model_f.policy)
    toks = tokens_for(model_f.cfg, 2, t)
    lf, _, _ = jax.jit(model_f.apply)(params, toks)
    ld, _, _ = jax.jit(model_d.apply)(params, toks)
    np.testing.assert_allclose(np.asarray(lf), np.asarray(ld), atol=2e-5, rtol=1e-5)


def _dense_ref(q, k, v, mask):
    """Plain softmax attention with a [B,T,S] mask, GQA by repeating kv heads."""
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)
    v = jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, -1), v)


@pytest.mark.parametrize("window", [1, 3, 40])
def test_swa_kernel_path_matches_dense_masked(window):
    from agentrl_jax import kernels

    rng = np.random.default_rng(window)
    q, k, v = (
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in [(2, 20, 4, 8), (2, 20, 2, 8), (2, 20, 2, 8)]
    )
    out = kernels.sliding_window_attention(q, k, v, window=window, impl="xla")
    i = np.arange(20)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    ref = _dense_ref(q, k, v, jnp.broadcast_to(mask, (2, 20, 20)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


def test_select_blocks_and_sparse_matches_dense_masked():
    from agentrl_jax import kernels

    rng = np.random.default_rng(0)
    b, t, bs = 2, 32, 4
    q = jnp.asarray(rng.normal(size=(b, t, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    idx = select_blocks(q, k, block_size=bs, topk_blocks=3, q_positions=pos)
    assert idx.shape == (b, t, 2, 3)
    idx_np = np.asarray(idx)
    qblock = np.arange(t) // bs
    # own block always selected, never a future block, -1 only when fewer blocks exist
    assert np.all(np.any(idx_np == qblock[None, :, None, None], axis=-1))
    assert np.all(idx_np <= qblock[None, :, None, None])
    assert np.all(
        (idx_np >= 0) == (np.arange(3)[None, None, None, :] <= qblock[None, :, None, None])
    )
    out = kernels.block_sparse_attention(q, k, v, idx, block_size=bs, impl="xla")
    # dense reference with the selection as a mask (per kv head -> expand to q heads)
    kblock = np.arange(t) // bs
    sel = np.any(idx_np[..., None] == kblock, axis=-2)  # [B,T,K,S]
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    outs = []
    for kh in range(2):
        m = jnp.asarray(sel[:, :, kh] & causal)
        outs.append(
            _dense_ref(q[:, :, 2 * kh : 2 * kh + 2], k[:, :, kh : kh + 1], v[:, :, kh : kh + 1], m)
        )
    ref = jnp.concatenate(outs, axis=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    cov = sparse_coverage(q, k, idx, block_size=bs)
    assert cov.shape == (b, t, 4)
    assert np.all(np.asarray(cov) <= 1 + 1e-6) and np.all(np.asarray(cov[:, : 3 * bs]) > 1 - 1e-6)


def test_masked_attention_empty_row_is_zero():
    pol = get_policy("fp32")
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 2, 2, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 3, 1, 4)), jnp.float32)
    mask = jnp.asarray([[[[False] * 3], [[True, False, True]]]])
    out = masked_attention(q, k, k, mask, pol)
    assert np.all(np.asarray(out[0, 0]) == 0) and np.all(np.isfinite(np.asarray(out)))


def test_chunked_cache_matches_teacher():
    """Prefill in ragged chunks through the paged/ring cache == teacher-forced logits."""
    cfg, model, params = make(moe=True)
    b, t = 2, 22
    toks = tokens_for(cfg, b, t)
    ref, _, _ = jax.jit(model.apply)(params, toks)
    cache = init_cache(cfg, model.policy, CacheSpec(b, 32, page_size=8))
    step = jax.jit(lambda p, tk, c: model.apply(p, tk, cache=c))
    outs, start = [], 0
    for c in (5, 1, 16):
        logits, cache, _ = step(params, toks[:, start : start + c], cache)
        outs.append(logits)
        start += c
    got = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=5e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache["lengths"]), [t, t])


# fp32 in the slow tier (CI time): bf16 runs the same code path with the same bitwise claim
@pytest.mark.parametrize("policy", [pytest.param("fp32", marks=pytest.mark.slow), "bf16"])
def test_forward_chunked_bitwise_equals_padded_decode(policy):
    """Parity by construction: decode (one valid row padded to the chunk) == chunked teacher."""
    cfg, model, params = make(moe=True, policy=policy)
    b, t, chunk, max_len = 2, 12, 4, 16
    toks = tokens_for(cfg, b, t)
    teacher, extras = forward_chunked(
        model, params, toks, chunk=chunk, page_size=8, max_len=max_len
    )
    step = jax.jit(lambda p, tk, c, v: model.apply(p, tk, cache=c, valid=v))
    cache = init_cache(cfg, model.policy, CacheSpec(b, max_len, page_size=8))
    got = []
    for i in range(t):
        tk = jnp.zeros((b, chunk), jnp.int32).at[:, 0].set(toks[:, i])
        valid = jnp.zeros((b, chunk), bool).at[:, 0].set(True)
        logits, cache, ex = step(params, tk, cache, valid)
        got.append(logits[:, 0])
    got = jnp.stack(got, axis=1)
    lp_t = token_logprobs(teacher[:, :-1], toks[:, 1:])
    lp_d = token_logprobs(got[:, :-1], toks[:, 1:])
    np.testing.assert_array_equal(np.asarray(lp_t), np.asarray(lp_d))


def test_routing_replay_reproduces_logits():
    cfg, model, params = make(moe=True)
    toks = tokens_for(cfg, 2, 16)
    logits, _, extras = jax.jit(model.apply)(params, toks)
    routes = extras["routes"]
    assert routes.shape == (2, 16, cfg.n_layers, cfg.experts_per_token)
    replay = jax.jit(lambda p, t, r: model.apply(p, t, replay_routes=r))
    replayed, _, ex2 = replay(params, toks, routes)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(replayed))
    np.testing.assert_array_equal(np.asarray(routes), np.asarray(ex2["routes"]))
    # forcing other experts changes the output: replay is really used
    forced, _, _ = replay(params, toks, (routes + 1) % cfg.n_experts)
    assert not np.allclose(np.asarray(forced), np.asarray(logits))


def test_gradients_finite_and_match_finite_differences():
    """Directional derivative vs a central difference. fp32 with eps=1e-3: truncation error
    O(eps^2) and rounding error O(ulp(loss)/eps) ~ 5e-4 relative, hence rtol 1e-2."""
    # Expert and key-block choices are discrete: replaying the routes taken at `params` and a
    # top-k that keeps every block keep the loss smooth under the +-eps perturbation (gradients
    # still reach the router through the gates). Kernel tests cover gradients of sparse blocks.
    cfg, model, params = make("SFD", 3, moe=True, sparse_topk_tokens=16)
    toks = tokens_for(cfg, 2, 12)
    _, _, extras0 = jax.jit(model.apply)(params, toks)

    @jax.jit
    def loss(p):
        logits, _, extras = model.apply(p, toks, replay_routes=extras0["routes"])
        return -jnp.mean(token_logprobs(logits[:, :-1], toks[:, 1:])) + extras["aux_loss"]

    grads = jax.jit(jax.grad(loss))(params)
    leaves = jax.tree.leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads["params"]["groups"]))
    rng = np.random.default_rng(0)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    eps = 1e-3
    plus = loss(jax.tree.map(lambda a, d: a + eps * d, params, direction))
    minus = loss(jax.tree.map(lambda a, d: a - eps * d, params, direction))
    fd = (float(plus) - float(minus)) / (2 * eps)
    an = float(sum(jnp.sum(g * d) for g, d in zip(leaves, jax.tree.leaves(direction))))
    np.testing.assert_allclose(fd, an, rtol=1e-2)


def test_model_config_validation():
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(n_heads=3, n_kv_heads=2)
    with pytest.raises(ValueError, match="layer_pattern"):
        ModelConfig(layer_pattern="SXF")
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig(layer_pattern="SSSF", n_layers=6)
    with pytest.raises(ValueError, match="sparse_topk_tokens"):
        ModelConfig(sparse_block_size=8, sparse_topk_tokens=12)
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelConfig(n_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="remat"):
        ModelConfig(remat="some")


@pytest.mark.parametrize("remat", ["full"])
def test_remat_same_loss_and_grads(remat):
    cfg, model, params = make("SF", 4)
    model_r = Transformer(cfg.replace(remat=remat), model.policy)
    toks = tokens_for(cfg, 2, 10)

    def loss(m, p):
        logits, _, _ = m.apply(p, toks)
        return jnp.mean(token_logprobs(logits[:, :-1], toks[:, 1:]))

    g1 = jax.jit(jax.grad(lambda p: loss(model, p)))(params)
    g2 = jax.jit(jax.grad(lambda p: loss(model_r, p)))(params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


# the dense variant is in the slow tier (make test-slow): the MoE one runs the same loop
@pytest.mark.parametrize("moe", [pytest.param(False, marks=pytest.mark.slow), True])
def test_unstacked_groups_equal_the_depth_scan(moe):
    """Two pattern groups as a loop over per-group parameters (``unstack_groups``): the same
    routes, and logits and cache within fp32 rounding (XLA fuses the unrolled groups otherwise
    than the loop body), as the scan over the stacked ones, for a prefill chunk and a one-row
    decode-kernel step on random tokens."""
    extra = dict(n_experts=4, experts_per_token=2, d_expert=16) if moe else dict(d_ff=48)
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="SD", window=8, init_std=0.3, **extra,
    )  # fmt: skip
    pol = get_policy("fp32")
    params = init_params(Transformer(cfg, pol), jax.random.key(0))
    flat = unstack_groups(params, cfg.n_groups)
    assert "groups" not in flat["params"] and {"group_0", "group_1"} <= set(flat["params"])
    b, t = 3, 12
    toks = jax.random.randint(jax.random.key(1), (b, t + 1), 0, 64)

    @functools.partial(jax.jit, static_argnames="unstacked")
    def run(p, unstacked):
        model = Transformer(cfg, pol, decode_kernel=True, unstacked=unstacked)
        cache = init_cache(cfg, pol, CacheSpec(b, 32, page_size=8))
        valid = jnp.arange(t)[None, :] < jnp.asarray([[5], [12], [9]])
        lg1, cache, ex1 = model.apply(p, toks[:, :t], cache=cache, valid=valid)
        lg2, cache, ex2 = model.apply(p, toks[:, t:], cache=cache)
        return lg1, lg2, cache, ex1.get("routes"), ex2.get("routes")

    want, got = run(params, False), run(flat, True)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    jax.tree.map(close, got[:3], want[:3])
    jax.tree.map(np.testing.assert_array_equal, got[3:], want[3:])


def test_logits_rows_runs_the_head_on_one_row_per_sequence():
    cfg, model, params = make(moe=True)
    toks = tokens_for(cfg, 3, 12)
    full, _, full_extras = jax.jit(model.apply)(params, toks)
    rows = jnp.array([11, 0, 5], jnp.int32)
    apply_rows = jax.jit(functools.partial(model.apply, logits_rows=rows))
    got, _, extras = apply_rows(params, toks)
    assert got.shape == (3, 1, cfg.vocab_size)
    want = np.asarray(full)[np.arange(3), np.asarray(rows)]
    np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(extras["routes"]), np.asarray(full_extras["routes"]))
    with pytest.raises(ValueError, match=r"logits_rows.shape=\(3, 1\), expected \(3,\)"):
        jax.eval_shape(functools.partial(model.apply, logits_rows=rows[:, None]), params, toks)
