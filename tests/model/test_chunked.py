"""The chunked forward shared by sampler and trainer: fixed-order logprobs, chunk geometry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.chunked import (
    ChunkSpec,
    as_chunk_spec,
    chunked_logits,
    fixed_order_logprobs,
    sequence_logprobs,
)
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, forward_chunked, init_params
from agentrl_jax.precision import get_policy

CFG = ModelConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
    layer_pattern="SF", window=8, sparse_block_size=4, sparse_topk_tokens=8, d_ff=48,
    init_std=0.3,
)  # fmt: skip


def test_fixed_order_logprobs_matches_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 37)).astype(np.float32) * 3
    t = rng.integers(0, 37, size=(2, 5))
    ref = x - np.log(np.exp(x.astype(np.float64)).sum(-1, keepdims=True))
    want = np.take_along_axis(ref, t[..., None], -1)[..., 0]
    got = np.asarray(fixed_order_logprobs(jnp.asarray(x), jnp.asarray(t)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fixed_order_logprobs_same_bits_for_a_row_and_a_block():
    """A [B, V] row batch and the same rows inside a [B, T, V] block give the same bits."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 6, 50)).astype(np.float32) * 4)
    t = jnp.asarray(rng.integers(0, 50, size=(3, 6)))
    block = np.asarray(jax.jit(fixed_order_logprobs)(x, t))
    rows = np.asarray(jax.jit(fixed_order_logprobs)(x[:, 2], t[:, 2]))
    np.testing.assert_array_equal(rows, block[:, 2])


@pytest.mark.parametrize(
    "meta,want",
    [
        (None, None),
        (ChunkSpec(8, 4), ChunkSpec(8, 4)),
        ({"chunk": 2, "max_len": 32}, ChunkSpec(2, 16, 32)),
        ({"chunk": 4, "page_size": 8, "n_slots": 3}, ChunkSpec(4, 8, None, 3)),
    ],
)
def test_as_chunk_spec(meta, want):
    assert as_chunk_spec(meta) == want


def test_chunk_spec_validation():
    for field, bad in (("chunk", 0), ("page_size", 0), ("max_len", 0), ("n_slots", 0)):
        with pytest.raises(ValueError, match=f"ChunkSpec.{field}"):
            ChunkSpec(**{"chunk": 4, field: bad})
    with pytest.raises(ValueError, match="chunk"):
        as_chunk_spec({"page_size": 8})


def test_chunked_logits_is_forward_chunked_and_parity_needs_a_spec():
    """Without recorded evictions the scan equals ``forward_chunked`` bitwise."""
    model = Transformer(CFG, get_policy("fp32-parity"))
    params = init_params(model, jax.random.key(0))
    toks = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
    spec = ChunkSpec(chunk=4, page_size=8, max_len=32)
    got, _ = jax.jit(lambda p, t: chunked_logits(model, p, t, spec))(params, toks)
    want, _ = jax.jit(lambda p, t: forward_chunked(model, p, t, chunk=4, page_size=8, max_len=32))(
        params, toks
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="multiple of chunk"):
        chunked_logits(model, params, toks[:, :10], spec)
    with pytest.raises(ValueError, match="chunk_spec"):
        sequence_logprobs(model, params, toks)


def test_padding_routes_never_take_other_rows_experts():
    """A stored route of padding (e.g. [0, 0], one expert twice) is not replayed: replayed, it
    overflows that expert's dropless capacity in the chunked path, where every row takes
    capacity, and drops the pairs of a longer row that comes after it."""
    cfg = CFG.replace(layer_pattern="DD", n_experts=4, experts_per_token=2, d_expert=16)
    model = Transformer(cfg, get_policy("fp32-parity"))  # chunked: every row takes capacity
    params = init_params(model, jax.random.key(0))
    b, t = 4, 16
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, 64)
    valid = jnp.arange(t)[None, :] < jnp.array([4, 4, 4, t])[:, None]  # rows 0-2 end early
    routes = jax.random.randint(jax.random.key(2), (b, t, 2, 1), 1, 4)
    routes = jnp.concatenate([routes, jnp.zeros_like(routes)], axis=-1)  # [e, 0], e in 1..3
    stored = jnp.where(valid[:, :, None, None], routes, 0)  # padding stored as [0, 0]
    routed = jnp.where(valid[:, :, None, None], routes, -1)  # padding left to the router
    spec = ChunkSpec(chunk=4, page_size=4, max_len=t)

    def logp(r):
        f = lambda p: sequence_logprobs(  # noqa: E731
            model, p, toks, valid=valid, replay_routes=r, chunk_spec=spec, with_entropy=False
        )
        lp, _, extras = jax.jit(f)(params)
        return np.asarray(lp), float(extras["dropped_fraction"])

    got, dropped = logp(stored)
    want, dropped_want = logp(routed)
    assert dropped == dropped_want == 0.0
    np.testing.assert_array_equal(got[3], want[3])
