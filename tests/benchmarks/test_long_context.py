"""benchmarks/long_context.py: the decode part's random fill against a real prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.sampler import Sampler
from benchmarks import script

lc = script("long_context")

# 2 layers (S, F), 8-token blocks, top-k 64 tokens (8 blocks): far fewer than the context's 48
# blocks (less the evicted ones), as at 32k.
CONTEXT, N, OBS, NEW = 416, 384, 32, 4
CFG = lc.MODEL.replace(n_layers=2, layer_pattern="SF", sparse_topk_tokens=64)
DECODE_ARGS = (jax.random.key(2), np.zeros(1, np.int32), np.ones(1, bool))


def sampler(gather: bool, kernel: bool = False) -> Sampler:
    model = Transformer(CFG.replace(sparse_gather=gather), get_policy("fp32"))
    cfg = lc.sampling(CONTEXT, decode_kernel=kernel, stop_tokens=(-1,), record_blocks=True)
    return Sampler(model, cfg)


@pytest.fixture(scope="module")
def states():
    """The gather model's params, stats and int8+evict start states: prefilled and random."""
    params = init_params(Transformer(CFG, get_policy("fp32")), jax.random.key(0))
    smp = sampler(gather=True)
    real, counts, _ = lc.decode_start(smp, params, N, "int8+evict", "prefill", OBS)
    stats = lc.stored_stats(real, CFG.layer_pattern)
    fake, counts_r, _ = lc.decode_start(smp, params, N, "int8+evict", "random", OBS, stats)
    assert counts == counts_r and counts["int8_tokens"] > 0 and counts["evicted_tokens"] > 0
    return params, stats, real, fake


def copy(state):
    return jax.tree.map(lambda a: a.copy(), state)  # decode donates its state


def test_random_fill_has_the_prefilled_layout_and_magnitudes(states):
    _, stats, real, fake = states
    leaves, tree = jax.tree.flatten(real)
    leaves_r, tree_r = jax.tree.flatten(fake)
    assert tree == tree_r
    assert [(a.shape, a.dtype) for a in leaves] == [(a.shape, a.dtype) for a in leaves_r]
    for key in ("lengths", "block_tables", "int8_tables"):
        np.testing.assert_array_equal(real.cache[key], fake.cache[key])
    np.testing.assert_array_equal(real.evict_at, fake.evict_at)
    np.testing.assert_array_equal(real.int8_at, fake.int8_at)
    tables = np.asarray(fake.cache["block_tables"][0])
    for name, layer in fake.cache["layers"].items():
        kind, ref = CFG.layer_pattern[int(name[6:])], real.cache["layers"][name]
        for key in ("k", "v"):
            x = np.asarray(layer[key][0])
            if kind != "S":
                x = x[tables].reshape(-1, *x.shape[2:])  # by position
                assert not np.any(x[N:]) and np.all(np.any(x[:N] != 0, axis=(1, 2)))
                x = x[:N]
            mean, std = stats[name][key]
            assert abs(x.std() / std[0] - 1) < 0.05 and abs(x.mean() - mean[0]) < 0.05 * std[0]
        if "kmean" in layer:  # block means of the stored keys (numpy reference)
            keys = np.asarray(layer["k"][0], np.float64)[tables].reshape(-1, *layer["k"].shape[3:])
            bs = CFG.sparse_block_size
            want = np.zeros(layer["kmean"].shape[1:], np.float64)
            for j in range(-(-N // bs)):
                want[0, :, j] = keys[j * bs : min(N, (j + 1) * bs)].mean(axis=0)
            np.testing.assert_allclose(layer["kmean"][0], want, rtol=1e-5, atol=1e-6)
        if "k8" in layer:  # int8 pages: the same pages written, holding the float pages' values
            written = np.asarray(layer["ks"][0]).max(axis=1) > 0
            np.testing.assert_array_equal(written, np.asarray(ref["ks"][0]).max(axis=1) > 0)
            assert written.sum() >= 4
            for c, s, f in (("k8", "ks", "k"), ("v8", "vs", "v")):
                deq = (
                    np.asarray(layer[c][0], np.float32) * np.asarray(layer[s][0])[:, None, :, None]
                )
                np.testing.assert_array_equal(deq[written], np.asarray(layer[f][0])[written])
    assert abs(float(fake.logits.std()) / stats["logits"][1] - 1) < 0.2


def decoded_blocks(smp, params, state, kernel):
    """Selected-block count per decoded token and kv head: int [NEW, 1, K]."""
    assert smp.uses_decode_kernel(state) == kernel
    state, out = smp.decode(params, state, *DECODE_ARGS, np.full(1, NEW, np.int32), 1)
    assert int(out.n_new[0]) == NEW and int(state.cache["lengths"][0]) == N + NEW
    return np.asarray(jnp.sum(state.blocks[0, N : N + NEW] >= 0, axis=-1))


@pytest.mark.parametrize("kernel", [False, True], ids=["chunk", "kernel"])
def test_random_fill_decode_reads_as_many_blocks_as_after_prefill(states, kernel):
    params, _, real, fake = states
    smp = sampler(gather=True, kernel=kernel)
    used = [decoded_blocks(smp, params, copy(s), kernel) for s in (real, fake)]
    np.testing.assert_array_equal(used[0], used[1])
    assert used[1].shape == (NEW, 1, CFG.n_kv_heads)
    np.testing.assert_array_equal(used[1], CFG.sparse_topk_blocks)  # the top-k binds


def test_decode_start_and_random_fill_reject_bad_input(states):
    params, stats, real, _ = states
    smp = sampler(gather=True)
    with pytest.raises(ValueError, match="--decode-fill 'zeros'; allowed: prefill, random"):
        lc.decode_start(smp, params, N, "dense", "zeros", OBS, stats)
    with pytest.raises(ValueError, match="allowed: prefill, random"):
        lc.decode_start(smp, params, N, "dense", "random", OBS, None)
    with pytest.raises(ValueError, match=r"n=500 must be in \[1, max_len=448\]"):
        lc.random_fill(smp, real, 500, stats, jax.random.key(0))
