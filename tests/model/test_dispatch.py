"""Tests for agentrl_jax.model.dispatch: the attention-path table and the kernel choice."""

import dataclasses

import pytest

from agentrl_jax import kernels
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.dispatch import (
    PATH_NAMES,
    AttentionCall,
    attention_path,
    describe,
    kernel_impl,
    one_row_decode,
    op_shapes,
)
from agentrl_jax.precision import get_policy


@pytest.mark.parametrize(
    "call, want",
    [
        (AttentionCall("S", cached=False), "sliding_window"),
        (AttentionCall("D", cached=False), "sliding_window"),
        (AttentionCall("F", cached=False), "block_sparse"),
        (AttentionCall("F", cached=False, sinks=True), "sinks"),
        (AttentionCall("S", cached=True, one_row=True), "ring"),
        (AttentionCall("D", cached=True, one_row=True), "decode_dense"),
        (AttentionCall("D", cached=True, one_row=True, sinks=True), "live_dense"),
        (AttentionCall("D", cached=True, one_row=True, tracks_mass=True), "masked"),
        (AttentionCall("D", cached=True), "live_dense"),
        (AttentionCall("D", cached=True, parity=True), "masked"),
        (AttentionCall("F", cached=True, one_row=True), "decode_sparse"),
        (AttentionCall("F", cached=True, one_row=True, sparse_gather=True), "decode_gathered"),
        (AttentionCall("F", cached=True, sparse_gather=True), "gathered"),
        (AttentionCall("F", cached=True), "masked"),
    ],
)
def test_attention_path_table(call, want):
    """The first matching row of the table, by hand for each kind of call."""
    assert attention_path(call) == want


def test_every_path_is_reachable_and_bad_kind_fails():
    """Each row of the table is the answer for some call (no dead row); an unknown layer kind
    is refused by name."""
    seen = set()
    flags = ("cached", "one_row", "sinks", "tracks_mass", "sparse_gather", "parity")
    for kind in "SFD":
        for bits in range(2 ** len(flags)):
            call = AttentionCall(kind, **{f: bool(bits >> i & 1) for i, f in enumerate(flags)})
            seen.add(attention_path(call))
    assert seen == set(PATH_NAMES)
    with pytest.raises(ValueError, match="kind='X'"):
        attention_path(AttentionCall("X", cached=False))


def test_one_row_decode_needs_no_parity_and_no_mass():
    fp32, parity = get_policy("fp32"), get_policy("fp32-parity")
    assert one_row_decode(fp32, True, tracks_mass=False)
    assert not one_row_decode(fp32, False, tracks_mass=False)
    assert not one_row_decode(fp32, True, tracks_mass=True)
    assert not one_row_decode(parity, True, tracks_mass=False)


def test_kernel_choice_reaches_the_op_table():
    """A per-op choice overrides ``kernel_impl`` for that op only; 'xla' is always allowed;
    an impl the op does not have is refused when the policy is made."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=64,
                      layer_pattern="SF", window=8, sparse_block_size=4,
                      sparse_topk_tokens=8)  # fmt: skip
    pol = get_policy("fp32", kernel_impl="xla", kernels={"decode_matmul": "xla"})
    shapes = op_shapes(cfg, pol, seq_len=64, page_size=8)
    assert set(shapes) == set(kernels.OPS)
    for op in kernels.OPS:
        assert kernel_impl(pol, op, shapes[op], "cpu") == "xla"
    assert shapes["paged_decode"].max_pages == 8
    assert dataclasses.replace(pol, kernels=()).kernel_choice("decode_matmul") == "auto"
    with pytest.raises(ValueError, match="DTypePolicy.kernels"):
        get_policy("fp32", kernels={"decode_matmul": "no_such_impl"})
    line = describe(cfg, pol, seq_len=64, page_size=8, backend="cpu")
    for op in kernels.OPS:
        assert f"{op}=xla" in line
    assert "S sliding_window/ring/ring" in line and "F block_sparse/masked/decode_sparse" in line
