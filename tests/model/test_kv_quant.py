"""int8 page quantiser vs a numpy reference, and the in-place pool update of the chunk path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.attention import int8_page_update
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.kv_quant import fake_quant_pages, page_scales, quantize_pages
from agentrl_jax.model.transformer import (
    CacheSpec,
    Transformer,
    forward_chunked,
    init_cache,
    init_params,
)
from agentrl_jax.precision import get_policy

NEVER = np.iinfo(np.int32).max


def _np_fake_quant(x, mark, page, out_dtype=np.float32):
    """Per (page, head): scale = max |x| over marked tokens * fp32(1/127); round half to even."""
    x32 = x.astype(np.float32)
    b, s, k, h = x.shape
    out = x32.copy()
    codes = np.zeros(x.shape, np.int8)
    scales = np.zeros((b, s // page, k), np.float32)
    for i in range(b):
        for j in range(s // page):
            sl = slice(j * page, (j + 1) * page)
            m = mark[i, sl]
            for kk in range(k):
                if not m.any():
                    continue
                sc = np.float32(np.abs(x32[i, sl][m, kk]).max()) * np.float32(1 / 127)
                scales[i, j, kk] = sc
                q = np.clip(np.round(x32[i, sl, kk] / (sc if sc > 0 else 1)), -127, 127)
                q = np.where(m[:, None], q, 0)
                codes[i, sl, kk] = q
                deq = (q.astype(np.float32) * sc).astype(out_dtype).astype(np.float32)
                out[i, sl, kk] = np.where(m[:, None], deq, x32[i, sl, kk])
    return out, codes, scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page", [4, 8])
def test_quantiser_matches_numpy(dtype, page):
    rng = np.random.default_rng(page)
    x = (rng.normal(size=(2, 16, 3, 5)) * rng.uniform(0.1, 4, size=(2, 16, 3, 1))).astype(
        np.float32
    )
    x = np.array(jnp.asarray(x, dtype).astype(jnp.float32))  # representable in dtype
    mark = rng.random((2, 16)) < 0.5
    mark[0, :page] = False  # a page without marked tokens
    x[1, page : 2 * page] = 0.0
    mark[1, page : 2 * page] = True  # an all-zero marked page: scale 0, zeros out
    xj = jnp.asarray(x, dtype)
    got = jax.jit(fake_quant_pages, static_argnums=2)(xj, jnp.asarray(mark), page)
    want, codes, scales = _np_fake_quant(x, mark, page, jnp.dtype(dtype))
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.astype(np.float32))
    q, sc = quantize_pages(xj, jnp.asarray(mark), page)
    np.testing.assert_array_equal(np.asarray(q), codes)
    np.testing.assert_array_equal(np.asarray(sc), scales)
    np.testing.assert_array_equal(np.asarray(page_scales(xj, jnp.asarray(mark), page)), scales)
    assert np.abs(np.asarray(q, np.int32)).max() == 127  # the page maximum maps to +-127
    # unmarked tokens untouched; marked tokens within half a quantisation step
    np.testing.assert_array_equal(np.asarray(got, np.float32)[~mark], x[~mark])
    step = np.repeat(scales, page, axis=1)[..., None]
    err = np.abs(np.asarray(got, np.float32) - x)[mark]
    tol = 0.5 * step[mark] * (1 + 1e-5) + (0.02 * np.abs(x[mark]) if dtype == jnp.bfloat16 else 0)
    assert np.all(err <= tol)


def test_quantiser_gradient_is_straight_through():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 4)), jnp.float32)
    mark = jnp.arange(8)[None] < 6
    g = jax.grad(lambda x: jnp.sum(fake_quant_pages(x, mark, 4) * 3.0))(x)
    np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))
    with pytest.raises(ValueError, match="multiple of page_size"):
        page_scales(x, mark, 3)


def test_int8_page_update_applies_decisions_once_per_page():
    """Pages holding a decision that falls in [lengths, new_len) are re-quantised in place."""
    rng = np.random.default_rng(1)
    page, n_pages = 4, 6
    pool_k = jnp.asarray(rng.normal(size=(n_pages, page, 2, 3)), jnp.float32)
    pool_v = jnp.asarray(rng.normal(size=(n_pages, page, 2, 3)), jnp.float32)
    tables = jnp.asarray([[2, 0, 5], [1, -1, 3]], jnp.int32)  # row 1: page 1 evicted (hole)
    int8_at = np.full((2, 12), NEVER, np.int32)
    int8_at[0, 1:6] = 8  # pages 0 and 1 of row 0, taking effect at 8
    int8_at[1, 9:11] = 12  # row 1: decision outside this chunk
    lengths, new_len = jnp.asarray([8, 8]), jnp.asarray([12, 12])
    fn = jax.jit(int8_page_update)
    nk, nv = fn(pool_k, pool_v, tables, jnp.asarray(int8_at), lengths, new_len)
    for pool, new in ((pool_k, nk), (pool_v, nv)):
        x = np.asarray(pool)[np.asarray([2, 0, 5])].reshape(1, 12, 2, 3)
        want, _, _ = _np_fake_quant(x, int8_at[:1] < 12, page)
        want_pool = np.asarray(pool).copy()
        want_pool[[2, 0, 5]] = want.reshape(3, page, 2, 3)
        np.testing.assert_array_equal(np.asarray(new), want_pool)
    # the next chunk: row 0's pages are not touched again (no double rounding); row 1's
    # decision at 12 now applies to its page 3 (positions 9, 10)
    again = np.asarray(fn(nk, nv, tables, jnp.asarray(int8_at), new_len, new_len + 4)[0])
    want_pool = np.asarray(nk).copy()
    mark = (np.arange(page) >= 1) & (np.arange(page) <= 2)
    want_pool[3] = _np_fake_quant(want_pool[3][None], mark[None], page)[0][0]
    np.testing.assert_array_equal(again, want_pool)


def test_int8_kv_policy_quantises_completed_pages():
    """bf16-int8kv: same numbers as bf16 until the first page completes, then different."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="SD", window=4, d_ff=48, init_std=0.2,
    )  # fmt: skip
    q8, bf = (Transformer(cfg, get_policy(n)) for n in ("bf16-int8kv", "bf16"))
    params = init_params(bf, jax.random.key(0))
    cache = init_cache(cfg, q8.policy, CacheSpec(2, 32, 8))
    assert cache["layers"]["layer_1"]["k"].dtype == jnp.bfloat16  # float buffers (simulated)
    toks = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    run = jax.jit(
        lambda m, p, t: forward_chunked(m, p, t, chunk=4, page_size=8)[0], static_argnums=0
    )
    a, b = np.asarray(run(q8, params, toks)), np.asarray(run(bf, params, toks))
    np.testing.assert_array_equal(a[:, :8], b[:, :8])  # page 0 is quantised when page 1 starts
    assert np.abs(a[:, 8:] - b[:, 8:]).max() > 0


def test_int8_pool_holds_the_codes_and_reads_back_the_float_round_trip():
    """Pages that become all int8 get codes + scales in the int8 pool (numpy reference); reading
    them from there gives bitwise the float pool's round-tripped values, also once the float
    page is gone; partly-int8 pages and pages without an int8 page stay float."""
    from agentrl_jax.model.paged import Int8Pool, int8_pages_read, read_pages, read_tokens

    rng = np.random.default_rng(2)
    page, n_pages, kh, h = 4, 6, 2, 3
    pool_k = jnp.asarray(rng.normal(size=(n_pages, page, kh, h)), jnp.bfloat16)
    pool_v = jnp.asarray(rng.normal(size=(n_pages, page, kh, h)), jnp.bfloat16)
    tables = jnp.asarray([[2, 0, 5], [1, 4, 3]], jnp.int32)
    int8_at = np.full((2, 12), NEVER, np.int32)
    int8_at[0, 0:6] = 8  # row 0: page 0 all int8, page 1 half
    int8_at[1, 4:8] = 8  # row 1: page 1 all int8, but no int8 page assigned
    tables8 = jnp.asarray([[1, 0, -1], [-1, -1, -1]], jnp.int32)
    zeros8 = jnp.zeros((3, page, kh, h), jnp.int8)
    int8 = Int8Pool(zeros8, zeros8, jnp.zeros((3, kh)), jnp.zeros((3, kh)), tables8)
    lengths, new_len = jnp.asarray([8, 8]), jnp.asarray([12, 12])
    args = (pool_k, pool_v, tables, jnp.asarray(int8_at), lengths, new_len)
    fk, fv = jax.jit(int8_page_update)(*args)
    nk, nv, new8 = jax.jit(int8_page_update)(*args, int8)
    np.testing.assert_array_equal(np.asarray(nk, np.float32), np.asarray(fk, np.float32))
    np.testing.assert_array_equal(np.asarray(nv, np.float32), np.asarray(fv, np.float32))
    x = np.asarray(pool_k, np.float32)[np.asarray([2, 0, 5])].reshape(1, 12, kh, h)
    _, codes, scales = _np_fake_quant(x, int8_at[:1] < 12, page)
    np.testing.assert_array_equal(np.asarray(new8.k)[1], codes[0, :page])  # row 0 page 0
    np.testing.assert_array_equal(np.asarray(new8.ks)[1], scales[0, 0])
    assert not np.asarray(new8.k)[0].any() and not np.asarray(new8.ks)[0].any()  # half page
    use8 = np.asarray(int8_pages_read(new8, jnp.asarray(int8_at), new_len))
    np.testing.assert_array_equal(use8, [[True, False, False], [False, False, False]])
    # free row 0's float page 2 (now stored in int8): reads still give the round-tripped values
    freed = nk.at[2].set(jnp.nan)
    safe, safe8 = jnp.maximum(tables, 0), jnp.maximum(tables8, 0)
    want = np.asarray(read_pages(nk, safe), np.float32)
    got = read_pages(freed, safe, new8.k, new8.ks, safe8, jnp.asarray(use8))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    pos = jnp.asarray(rng.integers(0, 12, size=(2, 5, kh)), jnp.int32)
    heads = jnp.arange(kh)[None, None, :]
    tok = read_tokens(freed, tables, pos, heads, new8.k, new8.ks, (tables8, jnp.asarray(use8)))
    want_tok = want[np.arange(2)[:, None, None], np.asarray(pos), np.arange(kh)[None, None, :]]
    np.testing.assert_array_equal(np.asarray(tok, np.float32), want_tok)
