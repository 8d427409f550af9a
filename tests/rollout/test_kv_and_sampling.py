"""Page allocator, KV accounting, sampling filters vs numpy references, KV eviction replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_setup import CFG, N_SLOTS, SAMPLING
from test_agent_loop import play

from agentrl_jax.model.chunked import fixed_order_logprobs, tempered
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.kv_cache import EvictionConfig, PagePool, dense_kv_bytes, kv_bytes_per_seq
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import (
    RolloutConfig,
    categorical,
    episode_keys,
    filter_logits,
    first_argmax,
    sample_tokens,
    token_keys,
)


def test_page_pool_alloc_trim_release_holes():
    pool = PagePool(slots=2, n_pages=5, page_size=4, max_len=16)
    assert pool.ensure(0, 9) and pool.owned(0) == 3 and pool.in_use == 3
    assert not pool.ensure(1, 12)  # needs 3, only 2 free: nothing changes
    assert pool.owned(1) == 0 and pool.in_use == 3
    assert pool.ensure(1, 5) and len(pool.free) == 0
    pool.trim(0, 4)
    assert pool.owned(0) == 1 and len(pool.free) == 2
    assert pool.waste_tokens([4, 5]) == 3  # slot 1: 2 pages for 5 tokens
    assert pool.release_pages(1, [0]) == 1 and pool.tables[1, 0] == -1
    assert pool.ensure(1, 8) and pool.tables[1, 0] == -1  # an evicted entry stays empty
    pool.release(1)
    assert pool.in_use == 1 and not pool.holes[1]
    assert not pool.can_hold(0, 20)  # beyond max_len
    with pytest.raises(ValueError, match="usable"):
        PagePool(1, 4, 4, 16, usable=5)


def test_kv_bytes():
    pol = get_policy("fp32")
    per_tok = 2 * CFG.n_kv_heads * CFG.head_dim * 4
    # "SF": one ring of `window` tokens + pages of the F layer
    assert kv_bytes_per_seq(CFG, pol, 10, 8) == (CFG.window + 16) * per_tok
    assert dense_kv_bytes(CFG, pol, 10) == 2 * 10 * per_tok


def _np_filter(x, temperature, top_k, top_p):
    x = x / temperature
    if top_k:
        kth = np.sort(x)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        order = np.argsort(-x, kind="stable")
        p = np.exp(x[order] - x[order][0])
        p /= p.sum()
        before = np.cumsum(p) - p
        keep = order[before < top_p]
        out = np.full_like(x, -np.inf)
        out[keep] = x[keep]
        x = out
    return x


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.6), (0.7, 5, 1.0), (1.3, 7, 0.5)])
def test_filter_logits_matches_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(top_k)
    x = rng.normal(size=(3, 40)).astype(np.float32) * 2
    cfg = RolloutConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_len=16)
    got = np.asarray(filter_logits(jnp.asarray(x), cfg))
    for row in range(3):
        want = _np_filter(x[row].astype(np.float64), temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isinf(got[row]), np.isinf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[row][fin], want[fin], rtol=1e-6)


def test_sample_tokens_greedy_rows():
    """Rows marked greedy take the argmax; the other rows keep the tokens they sample without
    the mask; every logprob is of the tempered distribution (the policy sampled from), greedy
    rows' too."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(6, 40)).astype(np.float32) * 2)
    keys = jax.random.split(jax.random.key(5), 6)
    cfg = RolloutConfig(temperature=1.3, max_len=16)
    rows = np.array([True, False, True, False, False, True])
    free, _ = sample_tokens(x, keys, cfg)
    tok, lp = sample_tokens(x, keys, cfg, jnp.asarray(rows))
    want = np.where(rows, np.argmax(np.asarray(x), -1), np.asarray(free))
    np.testing.assert_array_equal(np.asarray(tok), want)
    assert (np.asarray(free)[rows] != want[rows]).any()  # the mask changed something
    want_lp = fixed_order_logprobs(tempered(x, cfg.temperature), tok)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(want_lp))
    assert not np.allclose(np.asarray(lp), np.asarray(fixed_order_logprobs(x, tok)))


def test_first_argmax_matches_argmax_ties_nan_inf():
    """The two-reduction argmax returns jnp.argmax's index: the first of tied maxima, the first
    NaN, 0 for an all -inf row; jitted, on integer-valued random rows (many ties)."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, size=(64, 37)).astype(np.float32)
    x[3, [5, 9]] = np.nan
    x[4] = -np.inf
    x[5, [2, 30]] = np.inf
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got[3] == 5 and got[4] == 0 and got[5] == 2
    y = rng.normal(size=(2, 3, 50)).astype(np.float32)  # leading batch dims
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(y))), y.argmax(-1))


def test_categorical_equals_jax_random_categorical():
    """Same tokens as ``jax.vmap(jax.random.categorical)`` for the same keys, including rows
    with -inf (filtered) entries, jitted as the sampler runs it."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(32, 300)).astype(np.float32) * 3
    x[:, ::7] = -np.inf
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(2), i))(jnp.arange(32))
    got = jax.jit(categorical)(keys, jnp.asarray(x))
    want = jax.vmap(jax.random.categorical)(keys, jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.isfinite(x[np.arange(32), np.asarray(got)]).all()
    assert len(set(np.asarray(got).tolist())) > 8  # draws, not one argmax


def test_rollout_config_validation():
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_k=-1), dict(chunk=0),
                dict(max_len=20, page_size=16)):  # fmt: skip
        with pytest.raises(ValueError, match="RolloutConfig"):
            RolloutConfig(**bad)


def test_kv_eviction_replay_is_exact(fp32_model, tokenizer):
    """Evicted observation blocks change logits; replaying the recorded masks gives 0."""
    model, params = fp32_model
    traj, _, stats = play(
        model, params, tokenizer, eviction=EvictionConfig(threshold=0.9, min_block=2)
    )
    assert stats.evicted_tokens > 0 and (~traj.kv_keep_mask & traj.valid).sum() > 0
    ev = traj.kv_evict_at[~traj.kv_keep_mask]
    assert np.all(ev % SAMPLING.chunk == 0)  # takes effect at chunk-aligned positions
    act = traj.action_mask
    replay, _ = trainer_logprobs(
        model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS, replay_kv=True
    )
    np.testing.assert_array_equal(replay[act], traj.rollout_logprobs[act])
    full, _ = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    assert np.abs(full[act] - traj.rollout_logprobs[act]).max() > 0


def test_episode_keys_then_position_equal_token_keys():
    """The decode loop's split of ``token_keys`` (episode part hoisted out of the loop)."""
    rng = jax.random.key(7)
    uids = jnp.asarray([0, 5, 3, 1000], jnp.int32)
    pos = jnp.asarray([0, 17, 64, 3], jnp.int32)
    got = jax.vmap(jax.random.fold_in)(episode_keys(rng, uids), pos)
    want = token_keys(rng, uids, pos)
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    assert len({tuple(k) for k in np.asarray(jax.random.key_data(got))}) == 4
