"""Sparse full attention reading only its selected blocks: the pieces against references, the
chunked pass against the masked path and the teacher-forced pass, and block-selection replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.chunked import ChunkSpec, chunked_logits
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.select import select_blocks
from agentrl_jax.model.sparse_blocks import (
    gathered_attention,
    gathered_mask,
    gathered_mass,
    score_blocks,
    sparse_attention_reference,
    update_block_means,
)
from agentrl_jax.model.transformer import CacheSpec, Transformer, init_cache, init_params
from agentrl_jax.precision import get_policy

CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    layer_pattern="SF", window=8, sparse_block_size=4, sparse_topk_tokens=8, d_ff=48,
    init_std=0.3, sparse_gather=True,
)  # fmt: skip
SPEC = ChunkSpec(chunk=4, page_size=8, max_len=64)


def _random_selection(rng, b, c, kh, n, positions, bs):
    """Own block first, then distinct earlier blocks, some slots unused (-1)."""
    out = np.full((b, c, kh, n), -1, np.int32)
    for i in range(b):
        for r in range(c):
            own = positions[i, r] // bs
            for k in range(kh):
                others = rng.permutation(own)[: rng.integers(0, n)]
                out[i, r, k, : 1 + len(others)] = [own, *others]
    return out


def test_gathered_attention_matches_reference():
    rng = np.random.default_rng(0)
    b, c, n, kh, h, s, bs, n_sel = 2, 3, 4, 2, 8, 32, 4, 3
    q = rng.normal(size=(b, c, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    v = rng.normal(size=(b, s, kh, h)).astype(np.float32)
    positions = rng.integers(4, s, size=(b, c)).astype(np.int32)
    new_len = positions.max(axis=1) + 1
    keep = rng.random((b, s)) > 0.2
    blocks = _random_selection(rng, b, c, kh, n_sel, positions, bs)
    pos, mask = gathered_mask(
        jnp.asarray(blocks), jnp.asarray(positions), jnp.asarray(new_len), jnp.asarray(keep), bs
    )
    pos = np.asarray(pos)
    heads = np.arange(kh)[None, None, :, None]
    kg, vg = (
        k[np.arange(b)[:, None, None, None], pos, heads],
        v[np.arange(b)[:, None, None, None], pos, heads],
    )
    out, p = gathered_attention(jnp.asarray(q), kg, vg, mask, get_policy("fp32"))
    valid = keep & (np.arange(s)[None, :] < new_len[:, None])
    want = sparse_attention_reference(q, k, v, blocks, positions, valid, bs)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=0)
    # the attention mass per position is the scatter of the probabilities (mean over heads)
    rows = np.asarray([[True, False, True], [True, True, True]])
    got = np.asarray(gathered_mass(p, jnp.asarray(pos), jnp.asarray(rows), s))
    want_mass = np.zeros((b, s))
    pn = np.asarray(p).sum(axis=3) / n  # [B, C, K, M]
    for i, r, kk, m in np.ndindex(pn.shape):
        if rows[i, r]:
            want_mass[i, pos[i, r, kk, m]] += pn[i, r, kk, m]
    np.testing.assert_allclose(got, want_mass, atol=1e-6, rtol=0)


def test_stored_block_means_select_what_select_blocks_selects():
    """Means kept by ``update_block_means`` over chunks score like ``select_blocks`` on the keys."""
    rng = np.random.default_rng(1)
    b, s, kh, h, n, bs, c = 2, 32, 2, 8, 4, 4, 4
    k = jnp.asarray(rng.normal(size=(b, s, kh, h)), jnp.float32)
    new_len = jnp.asarray([30, 17])
    kmean = jnp.zeros((b, kh, s // bs, h), jnp.float32)
    heads = jnp.arange(kh)[None, None, :]
    read = lambda pos: k[jnp.arange(b)[:, None, None], pos[:, :, None], heads]  # noqa: E731
    for lo in range(0, s, c):  # chunk by chunk, as the chunked path writes them
        pos = jnp.broadcast_to(jnp.arange(lo, lo + c), (b, c)).astype(jnp.int32)
        valid = pos < new_len[:, None]
        kmean = update_block_means(kmean, read, pos, valid, jnp.minimum(lo + c, new_len), bs)
    q = jnp.asarray(rng.normal(size=(b, 5, n, h)), jnp.float32)
    qpos = jnp.asarray(rng.integers(0, 17, size=(b, 5)), jnp.int32)
    k_valid = jnp.arange(s)[None, :] < new_len[:, None]
    visible = jnp.any(k_valid.reshape(b, s // bs, bs), axis=2)
    got = score_blocks(q, kmean, qpos, visible, block_size=bs, n_sel=3)
    want = select_blocks(q, k, block_size=bs, topk_blocks=3, q_positions=qpos, k_valid=k_valid)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(got)[..., 0] == np.asarray(qpos)[:, :, None] // bs).all()  # own first


@pytest.fixture(scope="module")
def gather_run():
    """One chunked pass of the gather model recording its blocks, tokens [2, 32]."""
    pol = get_policy("fp32")
    model = Transformer(CFG, pol, record_blocks=True)
    params = init_params(model, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 32), 0, 64)
    logits, extras = jax.jit(lambda p, t: chunked_logits(model, p, t, SPEC))(params, toks)
    return model, params, toks, logits, extras["blocks"]


def test_gather_path_reads_exactly_the_selected_blocks(gather_run):
    """Same logits as the masked path and the teacher-forced pass given the same blocks; the
    chunked pass replaying its own record reproduces itself bitwise."""
    model, params, toks, logits, blocks = gather_run
    assert blocks.shape == (2, 32, 1, CFG.n_kv_heads, 2) and blocks.dtype == jnp.int32
    assert (np.asarray(blocks)[..., 0] == np.arange(32)[None, :, None, None] // 4).all()
    masked = Transformer(CFG.replace(sparse_gather=False), model.policy)
    run = jax.jit(
        lambda m, p, t, r: chunked_logits(m, p, t, SPEC, replay_blocks=r)[0], static_argnums=0
    )
    np.testing.assert_allclose(run(masked, params, toks, blocks), logits, atol=2e-5, rtol=0)
    teacher = jax.jit(lambda p, t, r: masked.apply(p, t, replay_blocks=r)[0])(params, toks, blocks)
    np.testing.assert_allclose(teacher, logits, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(run(model, params, toks, blocks), logits)
    # another selection changes the numbers: replay is not ignored
    other = jnp.where(jnp.arange(2) == 1, -1, blocks)
    assert np.abs(np.asarray(run(model, params, toks, other) - logits)).max() > 1e-4


def test_one_row_kernel_step_matches_gather_chunk_path(gather_run):
    """The decode kernel over the blocks chosen from the stored means: close to the gathered
    chunk path; the block means written are the same."""
    model, params, toks, _, _ = gather_run
    fast = Transformer(CFG, model.policy, decode_kernel=True)
    lens = jnp.asarray([13, 27])

    @jax.jit
    def run(params, toks):
        cache = init_cache(CFG, model.policy, CacheSpec(2, 64, page_size=8))
        valid = jnp.arange(32)[None, :] < lens[:, None]
        _, cache, _ = model.apply(params, toks, cache=cache, valid=valid)
        one = jnp.ones((2, 1), bool)
        ref, ref_cache, _ = model.apply(params, toks[:, :1] + 1, cache=cache, valid=one)
        got, got_cache, _ = fast.apply(params, toks[:, :1] + 1, cache=cache, valid=one)
        return ref, got, ref_cache, got_cache

    ref, got, ref_cache, got_cache = run(params, toks)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(
        got_cache["layers"]["layer_1"]["kmean"], ref_cache["layers"]["layer_1"]["kmean"]
    )


def test_replay_blocks_shape_is_checked(gather_run):
    model, params, toks, _, blocks = gather_run
    with pytest.raises(ValueError, match="replay_blocks"):
        model.apply(params, toks, replay_blocks=blocks[:, :, :, :1])
    with pytest.raises(ValueError, match="max_len"):
        from agentrl_jax.model.attention import init_layer_cache

        init_layer_cache("F", CFG, model.policy, batch=1, n_pages=2, page_size=8)
