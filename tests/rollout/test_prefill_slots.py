"""Prefill of only the slots with new tokens (``Sampler.prefill_slots``) vs the all-slot one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rollout_setup import CFG, SAMPLING

from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.sampler import get_sampler

B = 6
TOL = {"fp32": 1e-5, "bf16": 2e-2}  # bf16 cache entries: one bf16 ulp of a value ~1


def _state_with_history(sampler, params, rng, n_pages):
    """A state whose slots already hold random histories of different lengths."""
    state = sampler.init_state(B, n_pages)
    if n_pages is not None:  # shared pool: slots own scattered pages
        per = SAMPLING.max_len // SAMPLING.page_size
        tables = rng.permutation(n_pages)[: B * per].reshape(B, per)
        state = sampler.reset_slots(state, np.zeros(B, bool), tables)
    n0 = rng.integers(3, 40, size=B).astype(np.int32)
    toks = rng.integers(20, 400, size=(B, 64)).astype(np.int32)
    state, _ = sampler.prefill(params, state, toks, n0)
    return state


def _both(sampler, params, base, toks, n_new):
    copy = lambda s: jax.tree.map(jnp.copy, s)
    want = sampler.prefill(params, copy(base), toks, n_new)
    got = sampler.prefill_slots(params, copy(base), toks, n_new)
    return want, got


# bf16 in the slow tier (CI time): the fp32 groups make the same bitwise claim on the same path
@pytest.mark.parametrize(
    "policy,n_pages",
    [("fp32", None), pytest.param("bf16", None, marks=pytest.mark.slow), ("fp32", 120)],
)
@pytest.mark.parametrize("busy", [(4,), (1, 4), (0, 1, 2, 3, 4, 5)])
def test_prefill_slots_matches_all_slot_prefill(fp32_model, policy, n_pages, busy):
    """1, 2 (padded to 4) and all 6 slots busy; S and F layers, MoE routes, own or pooled pages."""
    params = fp32_model[1]
    sampler = get_sampler(Transformer(CFG, get_policy(policy)), SAMPLING)
    rng = np.random.default_rng(7)
    base = _state_with_history(sampler, params, rng, n_pages)
    n_new = np.zeros(B, np.int32)
    n_new[list(busy)] = rng.integers(1, 30, size=len(busy))
    toks = rng.integers(20, 400, size=(B, 128)).astype(np.int32)
    (want, want_routes), (got, got_routes) = _both(sampler, params, base, toks, n_new)
    flat_w, tree_w = jax.tree.flatten(want)
    flat_g, tree_g = jax.tree.flatten(got)
    assert tree_w == tree_g
    tol = TOL[policy]
    for w, g in zip(flat_w, flat_g, strict=True):
        w, g = np.asarray(w).astype(np.float32), np.asarray(g).astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
    for s in np.flatnonzero(n_new):
        np.testing.assert_array_equal(
            got_routes[s, : n_new[s]], np.asarray(want_routes)[s, : n_new[s]]
        )
    idle = n_new == 0  # untouched, bit for bit
    for name in ("logits", "evict_at", "int8_at"):
        np.testing.assert_array_equal(
            np.asarray(getattr(got, name))[idle], np.asarray(getattr(base, name))[idle]
        )
    assert not np.allclose(np.asarray(got.logits)[~idle], np.asarray(base.logits)[~idle])
    np.testing.assert_array_equal(
        np.asarray(got.cache["lengths"]), np.asarray(base.cache["lengths"]) + n_new
    )
    ring = np.asarray(got.cache["layers"]["layer_0"]["k"])  # S layer: [G, B, W, K, H]
    np.testing.assert_array_equal(
        ring[:, idle], np.asarray(base.cache["layers"]["layer_0"]["k"])[:, idle]
    )


@pytest.mark.parametrize("policy", ["fp32-parity", "bf16-parity"])
def test_prefill_slots_is_bitwise_under_parity(fp32_model, policy):
    """A one-slot prefill through a 1-row batch changes last bits; parity keeps the full batch."""
    params = fp32_model[1]
    sampler = get_sampler(Transformer(CFG, get_policy(policy)), SAMPLING)
    rng = np.random.default_rng(3)
    base = _state_with_history(sampler, params, rng, None)
    toks = rng.integers(20, 400, size=(B, 128)).astype(np.int32)
    n_new = np.asarray([0, 0, 0, 9, 0, 0], np.int32)
    (want, _), (got, _) = _both(sampler, params, base, toks, n_new)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("n_pages", [None, 120])
def test_copy_slots_equals_prefilling_the_same_tokens(fp32_model, n_pages):
    """Two slots holding one history: copying one onto the other equals prefilling both."""
    params = fp32_model[1]
    sampler = get_sampler(fp32_model[0], SAMPLING)  # fp32-parity: all-slot prefill, exact
    rng = np.random.default_rng(5)
    base = _state_with_history(sampler, params, rng, n_pages)
    toks = rng.integers(20, 400, size=(B, 128)).astype(np.int32)
    toks[4] = toks[1]
    copy = lambda s: jax.tree.map(jnp.copy, s)
    # slots 1 and 4 start from the same history, then get the same new tokens
    hist = rng.integers(20, 400, size=(B, 64)).astype(np.int32)
    hist[4] = hist[1]
    n0 = np.asarray([0, 21, 0, 0, 21, 0], np.int32)
    start = sampler.reset_slots(copy(base), n0 > 0)
    start, _ = sampler.prefill(params, start, hist, n0)
    n_new = np.asarray([3, 17, 0, 0, 17, 8], np.int32)
    want, _ = sampler.prefill(params, copy(start), toks, n_new)
    only = n_new.copy()
    only[4] = 0
    got, _ = sampler.prefill(params, copy(start), toks, only)
    got = sampler.copy_slots(got, [1], [4])
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="disjoint"):
        sampler.copy_slots(got, [1, 4], [4, 2])


def test_fast_prefill_runs_the_head_on_the_last_row_only(fp32_model):
    """Non-parity prefill (``RolloutConfig.last_row_logits``): the LM head on each slot's last
    new row gives the logits the every-row head gives there; parity policies keep every row."""
    parity_model, params = fp32_model
    model = Transformer(CFG, get_policy("fp32"))
    rng = np.random.default_rng(3)
    toks = rng.integers(20, 400, size=(B, 64)).astype(np.int32)
    n_new = rng.integers(1, 64, size=B).astype(np.int32)
    n_new[2] = 0  # a slot left untouched keeps its (zero) logits

    def prefill(last_row, model=model):
        s = get_sampler(model, SAMPLING.replace(last_row_logits=last_row))
        text = s.prefill.lower(params, s.init_state(B), toks, n_new).as_text()
        chunk_logits = f"tensor<{B}x{s.prefill_rows}x{CFG.vocab_size}xf32>"  # every row's
        return s.prefill(params, s.init_state(B), toks, n_new)[0].logits, chunk_logits in text

    (got, every_row_last), (want, every_row_all) = prefill(True), prefill(False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert every_row_all and not every_row_last
    assert prefill(True, parity_model)[1]  # parity: the trainer's chunks run every row too
