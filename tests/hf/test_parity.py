"""Qwen3, Qwen3-MoE and gpt-oss loaded from ``transformers``' own checkpoints compute
``transformers``' numbers: logits, greedy continuations and logprobs; and what we save loads
back into ``transformers`` with the same tensors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from agentrl_jax.hf import load_pretrained, save_pretrained
from agentrl_jax.hf.tiny import FAMILY_NAMES
from agentrl_jax.model.transformer import Transformer, token_logprobs
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler

FAMILIES = pytest.mark.parametrize("family", FAMILY_NAMES)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def tensors(path: str) -> dict[str, np.ndarray]:
    import glob

    out = {}
    for file in sorted(glob.glob(f"{path}/*.safetensors")):
        with safe_open(file, "np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def loaded(hf_models):
    return {f: load_pretrained(path) for f, (path, _) in hf_models.items()}


@FAMILIES
def test_logits_match_transformers(hf_models, loaded, family):
    """fp32 logits on random token batches (42 tokens: past gpt-oss's window of 8)."""
    cfg, params = loaded[family]
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 42))
    ours = Transformer(cfg, get_policy("fp32")).apply(params, jnp.asarray(tokens))[0]
    ref = hf_logits(hf_models[family][1], tokens)
    assert np.abs(np.asarray(ours) - ref).max() <= 1e-4


@FAMILIES
def test_save_load_roundtrip(hf_models, loaded, family, tmp_path):
    """load -> save: the same tensors byte for byte (a sharded index for the MoE families), and
    transformers loads what we saved and computes the same logits."""
    path, model = hf_models[family]
    cfg, params = loaded[family]
    shard = 200_000 if cfg.is_moe else None
    files = save_pretrained(str(tmp_path), cfg, params, max_shard_bytes=shard)
    assert (len(files) > 1) == cfg.is_moe
    before, after = tensors(path), tensors(str(tmp_path))
    assert sorted(before) == sorted(after)
    for name, x in before.items():
        assert after[name].dtype == x.dtype and after[name].shape == x.shape, name
        assert after[name].tobytes() == x.tobytes(), name
    again = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 24))
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(model, tokens))
    cfg2, params2 = load_pretrained(str(tmp_path))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def _generate(cfg, params, prompt, *, greedy, rng=0):
    """The project's sampler: prefill ``prompt`` [B, T], decode 32 tokens (no stop token);
    ``greedy`` rows take the argmax (one sampling config: one compile for both tests)."""
    model = Transformer(cfg, get_policy("fp32"))
    sampling = RolloutConfig(max_new_tokens=32, max_len=128, page_size=16)
    sampler = get_sampler(model, sampling)
    b, t = prompt.shape
    state = sampler.init_state(b)
    toks = np.zeros((b, sampler.prefill_width(t)), np.int32)
    toks[:, :t] = prompt
    state, _ = sampler.prefill(params, state, toks, np.full(b, t, np.int32))
    active = np.ones(b, bool)
    _, out = sampler.decode(
        params, state, jax.random.key(rng), np.arange(b, dtype=np.int32), active,
        np.full(b, 32, np.int32), np.int32(b), np.full(b, greedy),
    )  # fmt: skip
    return np.asarray(out.tokens), np.asarray(out.logprobs)


@FAMILIES
def test_greedy_continuation_equals_generate(hf_models, loaded, family):
    cfg, params = loaded[family]
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    ours, _ = _generate(cfg, params, prompt, greedy=True)
    with torch.no_grad():
        ref = hf_models[family][1].generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=32, do_sample=False,
            min_new_tokens=32, pad_token_id=0,
        )  # fmt: skip
    np.testing.assert_array_equal(ours, ref[:, 10:].numpy())


@FAMILIES
def test_logprobs_of_sampled_continuation_match(hf_models, loaded, family):
    """The sampler's logprobs and the teacher-forced ones both equal transformers' (1e-4)."""
    cfg, params = loaded[family]
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 10)).astype(np.int32)
    cont, sampler_lp = _generate(cfg, params, prompt, greedy=False, rng=5)
    seq = np.concatenate([prompt, cont], axis=1)
    ref = torch.log_softmax(torch.as_tensor(hf_logits(hf_models[family][1], seq)), -1).numpy()
    ref_lp = np.take_along_axis(ref[:, 9:-1], seq[:, 10:, None], axis=-1)[..., 0]
    logits = Transformer(cfg, get_policy("fp32")).apply(params, jnp.asarray(seq))[0]
    ours = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(seq[:, 1:])))[:, 9:]
    assert np.abs(ours - ref_lp).max() <= 1e-4
    assert np.abs(sampler_lp - ref_lp).max() <= 1e-4
    assert len(set(cont[0].tolist())) > 4  # a sampled continuation, not one repeated token
