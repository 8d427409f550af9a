"""benchmarks/decode_profile.py: a rollout's decode time by model part, from a profiler trace."""

import jax
import pytest

from benchmarks import script

decode_profile = script("decode_profile")


def test_ops_are_attributed_by_name_scope_and_control_flow_is_left_out():
    hlo = "\n".join([
        '  %ffi_call.3 = f32[2] custom-call(), metadata={op_name="jit(_decode)/while/body/'
        'Transformer/group_0/layer_0/attn/attn._chunk/ffi_call"}',
        '  %ynn_fusion.2 = f32[2] fusion(), metadata={op_name="jit(_decode)/while/body/'
        'Transformer/group_0/layer_0/mlp/mk,kn->mn/dot_general"}',
        '  %fusion.9 = f32[2] fusion(), metadata={op_name="jit(_decode)/while/body/'
        'Transformer/group_0/layer_0/attn_norm/mul"}',
        '  %ynn_fusion.7 = f32[2] fusion(), metadata={op_name="jit(_decode)/while/body/'
        'Transformer/embed.decode/dot_general"}',
        '  %reduce.1 = s32[2] reduce(), metadata={op_name="jit(_decode)/while/body/sample/'
        'reduce_min"}',
        '  %while.4 = (s32[]) while(), metadata={op_name="jit(_decode)/while/body/sample/while"}',
    ])  # fmt: skip
    assert decode_profile.op_parts(hlo) == {
        "ffi_call.3": "attention",
        "ynn_fusion.2": "ffn",
        "fusion.9": "other",
        "ynn_fusion.7": "lm_head",
        "reduce.1": "sampling",
    }
    assert decode_profile.part_of(".../layer_0/moe/ECD,EDF->ECF/dot_general") == "ffn"


@pytest.mark.slow  # compiles and traces the benchmark rollout (about 20 s)
def test_profile_line_of_the_dense_rollout():
    line = decode_profile.profile_line("dense", 2, reps=1)
    assert line["variant"] == "dense/D/b2/fp32" and line["step_us"] > 0
    shares = [line[f"{p}_share"] for p in decode_profile.PARTS]
    assert sum(shares) == pytest.approx(1.0)
    # every part of the decode step shows up: the scopes match the model's and sampler's names
    assert min(line[f"{p}_us"] for p in decode_profile.PARTS) > 0
    # the memory floor: the weights as stored, the cached rows' K/V bytes of every layer
    bench = decode_profile.build("dense", "D", 2, decode_profile.get_policy("fp32"), 1, True)
    cfg = bench.model_cfg
    per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4  # k and v, float32
    assert decode_profile.kv_bytes_per_token(bench.sampler.init_state(2).cache) == per_token
    rows = decode_profile.PROMPT + (decode_profile.NEW + 1) / 2
    assert line["kv_mb_per_step"] == pytest.approx(2 * rows * per_token / 1e6)
    assert line["weight_mb"] == pytest.approx(
        sum(x.nbytes for x in jax.tree.leaves(bench.params)) / 1e6
    )
    assert line["stream_gb_per_s"] > 0
    floor = 1e3 * (line["weight_mb"] + line["kv_mb_per_step"]) / line["stream_gb_per_s"]  # us
    assert line["floor_us"] == pytest.approx(floor)
    assert line["step_over_floor"] == pytest.approx(line["step_us"] / floor)
