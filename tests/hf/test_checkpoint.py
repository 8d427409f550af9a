"""Checkpoint loading: errors that name the tensor, MXFP4 dequantisation, sliced reads under a
mesh of 8 fake devices, and the family config round trip."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from agentrl_jax.hf import load_pretrained
from agentrl_jax.hf.checkpoint import mxfp4_dequantize, read_hf_config
from agentrl_jax.hf.families import family_of, hf_config_json
from agentrl_jax.hf.tiny import FAMILY_NAMES
from agentrl_jax.sharding import MeshConfig, make_mesh

# MXFP4 from the format's definition (OCP Microscaling): E2M1 elements, E8M0 group scales.


def e2m1_value(nibble: np.ndarray) -> np.ndarray:
    """Value of 4-bit E2M1 codes: sign bit, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = np.where(nibble & 0b1000, -1.0, 1.0)
    exp, man = (nibble >> 1) & 0b11, nibble & 1
    mag = np.where(exp == 0, 0.5 * man, 2.0 ** (exp.astype(np.float64) - 1) * (1 + 0.5 * man))
    return sign * mag


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] bytes (low nibble = earlier element) and [..., G] scales -> [..., G*32]."""
    lo, hi = e2m1_value(blocks & 0x0F), e2m1_value(blocks >> 4)
    vals = np.empty((*blocks.shape[:-1], 32))
    vals[..., 0::2], vals[..., 1::2] = lo, hi
    vals = vals * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
    return vals.reshape(*scales.shape[:-1], -1)


def mxfp4_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] floats (K % 32 == 0) -> blocks [..., K/32, 16], scales [..., K/32] (nearest)."""
    groups = x.reshape(*x.shape[:-1], -1, 32).astype(np.float64)
    amax = np.maximum(np.abs(groups).max(-1), 1e-30)
    exp = np.floor(np.log2(amax)) - 2  # the largest E2M1 magnitude is 6 = 1.5 * 2^2
    codes = np.arange(16, dtype=np.uint8)
    table = e2m1_value(codes)
    scaled = groups / 2.0 ** exp[..., None]
    idx = np.abs(scaled[..., None] - table).argmin(-1).astype(np.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    # contiguous: safetensors writes a strided array's buffer as if it were C-ordered
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exp + 127, np.uint8)


def test_mxfp4_dequantize_matches_reference():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 4), dtype=np.uint8)
    np.testing.assert_array_equal(mxfp4_dequantize(blocks, scales), mxfp4_reference(blocks, scales))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_dequantize(blocks.astype(np.int32), scales)


def _tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _rewrite(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(hf_models, tmp_path_factory):
    """The tiny gpt-oss with its expert weights stored as MXFP4 blocks + scales, and the
    reference dequantised ``gate_up_proj`` / ``down_proj`` of each layer."""
    src = hf_models["gpt_oss"][0]
    t = _tensors(src)
    ref = {}
    for name in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = t.pop(name)  # [E, in, R]: quantised along `in` per output row, as released
        blocks, scales = mxfp4_quantize(w.transpose(0, 2, 1))
        t[name + "_blocks"], t[name + "_scales"] = blocks, scales
        ref[name] = mxfp4_reference(blocks, scales).transpose(0, 2, 1)
    cfg = read_hf_config(src)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    return _rewrite(src, tmp_path_factory.mktemp("q") / "gpt_oss", t, cfg), ref


def test_mxfp4_checkpoint_loads_dequantised(gpt_oss_mxfp4):
    path, ref = gpt_oss_mxfp4
    cfg, params = load_pretrained(path)
    groups = params["params"]["groups"]
    for layer in range(cfg.n_layers):
        g, pos = divmod(layer, len(cfg.layer_pattern))
        moe = groups[f"layer_{pos}"]["moe"]
        gate_up = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(moe["w_gate"][g], gate_up[..., 0::2].astype(np.float32))
        np.testing.assert_array_equal(moe["w_up"][g], gate_up[..., 1::2].astype(np.float32))
        down = ref[f"model.layers.{layer}.mlp.experts.down_proj"].astype(np.float32)
        np.testing.assert_array_equal(moe["w_down"][g], down)


MESH = MeshConfig(data=1, fsdp=2, expert=2, tensor=2)


@pytest.mark.parametrize("which", ["qwen3_moe", "gpt_oss_mxfp4"])
def test_mesh_load_reads_only_device_slices(hf_models, gpt_oss_mxfp4, which):
    """Under a 2x2x2 mesh every parameter is sharded as the logical-axis rules say, equals the
    unsharded load, and no read of a tensor behind a sharded parameter is the whole tensor."""
    path = gpt_oss_mxfp4[0] if which == "gpt_oss_mxfp4" else hf_models[which][0]
    mesh = make_mesh(MESH, jax.devices()[:8])
    log: list = []
    cfg, sharded = load_pretrained(path, mesh=mesh, mesh_cfg=MESH, log=log)
    _, whole = load_pretrained(path)
    flat = jax.tree_util.tree_flatten_with_path(sharded)[0]
    assert all(len(x.sharding.device_set) == 8 for _, x in flat)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), sharded, whole)
    assert not any(x.sharding.is_fully_replicated for k, x in flat if "w_gate" in str(k))
    partial = [(n, got, full) for n, got, full in log if np.prod(got) < np.prod(full)]
    assert partial, "nothing was read in slices"
    for name, got, full in log:
        replicated = name.endswith(("_norm.weight", "router.bias"))
        if not replicated:
            assert np.prod(got) < np.prod(full), (name, got, full)


def _qwen3(hf_models):
    return hf_models["qwen3"][0]


def test_unknown_architecture_is_named(hf_models, tmp_path):
    cfg = read_hf_config(_qwen3(hf_models))
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    path = _rewrite(_qwen3(hf_models), tmp_path / "d", config=cfg)
    with pytest.raises(ValueError, match="MistralForCausalLM.*supported"):
        load_pretrained(path)


def test_missing_tensor_is_named_with_shape(hf_models, tmp_path):
    t = _tensors(_qwen3(hf_models))
    del t["model.layers.2.self_attn.k_proj.weight"]
    path = _rewrite(_qwen3(hf_models), tmp_path / "d", t)
    with pytest.raises(ValueError, match=r"model.layers.2.self_attn.k_proj.weight.*\(32, 64\)"):
        load_pretrained(path)


def test_shape_mismatch_is_named(hf_models, tmp_path):
    t = _tensors(_qwen3(hf_models))
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:90]
    path = _rewrite(_qwen3(hf_models), tmp_path / "d", t)
    with pytest.raises(
        ValueError, match=r"up_proj.weight has shape \(90, 64\); expected \(96, 64\)"
    ):
        load_pretrained(path)


def test_dtype_surprise_is_named(hf_models, tmp_path):
    t = _tensors(_qwen3(hf_models))
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    path = _rewrite(_qwen3(hf_models), tmp_path / "d", t)
    with pytest.raises(ValueError, match=r"model.norm.weight has dtype I32.*\(64,\)"):
        load_pretrained(path)


def test_unsupported_config_field_is_named(hf_models, tmp_path):
    cfg = read_hf_config(_qwen3(hf_models))
    cfg["hidden_act"] = "gelu"
    path = _rewrite(_qwen3(hf_models), tmp_path / "d", config=cfg)
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        load_pretrained(path)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_family_config_roundtrip(hf_models, family):
    """config.json -> ModelConfig -> config.json -> the same ModelConfig."""
    hf = read_hf_config(hf_models[family][0])
    fam = family_of(hf)
    assert fam.name == family
    cfg = fam.model_config(hf)
    assert fam.model_config(hf_config_json(family, cfg)) == cfg


def test_convert_then_export_roundtrip(hf_models, tmp_path):
    """``agentrl convert`` writes a run directory the trainer restores (``train.init_from``)
    and whose experiment loads with the HF model config; ``agentrl export`` of it writes the
    source tensors back byte for byte."""
    from agentrl_jax.cli import main
    from agentrl_jax.config import load_config
    from agentrl_jax.model.transformer import Transformer, init_params
    from agentrl_jax.precision import get_policy
    from agentrl_jax.train.stages import initial_params

    src = hf_models["gpt_oss"][0]
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    assert main(["convert", src, run]) == 0
    cfg, params = load_pretrained(src)
    template = init_params(Transformer(cfg, get_policy("fp32")), jax.random.key(0))
    restored = initial_params(run, template)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    exp = load_config(os.path.join(run, "experiment.py"))
    assert exp.train.init_from == run and not exp.train.sft
    assert exp.model.attn_sinks and exp.model.layer_pattern == cfg.layer_pattern
    assert main(["export", run, out]) == 0
    before, after = _tensors(src), _tensors(out)
    assert sorted(before) == sorted(after)
    assert all(after[k].tobytes() == v.tobytes() for k, v in before.items())
    assert main(["convert", src, run]) == 2  # refuses a run directory holding checkpoints
