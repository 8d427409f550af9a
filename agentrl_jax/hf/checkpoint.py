"""Hugging Face checkpoints in and out: ``load_pretrained`` / ``save_pretrained``.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` or several
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``weight_map``).
Tensors are read through ``safetensors.safe_open(...).get_slice``: without a mesh every
parameter is read whole; under a mesh each parameter is a ``jax.make_array_from_callback``
whose callback reads, for one device, only the HF slices that device's shard needs (the
logical-axis rules of ``agentrl_jax.sharding`` decide the shards), so no process materialises a
full sharded tensor. :class:`SafetensorsReader` can record every read (``log``) to check that.

gpt-oss MXFP4 expert weights (``*_blocks`` uint8 ``[E, R, G, 16]``, ``*_scales`` uint8
``[E, R, G]``) are dequantised on load (:func:`mxfp4_dequantize`): each byte holds two FP4
(E2M1) values, the low nibble first; a group of 32 values shares the scale ``2^(s - 127)``
(E8M0); the dequantised ``[E, R, G*32]`` is transposed to the ``[E, in, R]`` layout of the
unquantised tensor. ``save_pretrained`` writes dequantised tensors (no re-quantisation).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from safetensors import safe_open
from safetensors.numpy import save_file

from agentrl_jax.hf.families import FAMILIES, TensorMap, family_of, hf_config_json, tensor_maps
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import DTypePolicy, get_policy
from agentrl_jax.sharding import MeshConfig, logical_to_sharding

logger = logging.getLogger(__name__)

FLOAT_DTYPES = ("F32", "BF16", "F16")
_FP4 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_NP_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32: uint8 blocks ``[..., G, 16]`` and scales ``[..., G]`` -> ``[..., G*32]``.

    Raises:
      ValueError: if the shapes do not pair up or the dtypes are not uint8.
    """
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} must be scales {scales.shape} + (16,)")
    vals = np.stack([_FP4[blocks & 0x0F], _FP4[blocks >> 4]], axis=-1)  # [..., G, 16, 2]
    vals = vals.reshape(*scales.shape, 32)
    out = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * 32).astype(np.float32)


class SafetensorsReader:
    """Lazy, sliced access to the tensors of an HF directory.

    Args:
      path: the directory.
      log: optional list; every read appends ``(name, read shape, full shape)``.

    Raises:
      FileNotFoundError: no ``model.safetensors`` nor index in ``path``.
    """

    def __init__(self, path: str, log: list | None = None):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), "np") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{path} has no model.safetensors or its index")
        self.path, self.weight_map, self.log = path, weight_map, log
        self._files: dict[str, Any] = {}

    def _slice(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.path, file), "np")
        return self._files[file].get_slice(name)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor ``name`` (or its ``index`` slice), as numpy in its stored dtype."""
        sl = self._slice(name)
        x = sl[index] if index is not None else sl[:]
        if self.log is not None:
            self.log.append((name, tuple(x.shape), tuple(sl.get_shape())))
        return x


def _norm(index, shape) -> tuple[slice, ...]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))


def _flat(index: tuple[slice, ...], shape: tuple[int, ...]):
    """Axes merged row-major into one: (start, stop) of the flat range covering ``index``'s
    first axis and the post-slices for the others."""
    inner = math.prod(shape[1:])
    return index[0].start * inner, index[0].stop * inner, (slice(None), *index[1:])


class _ParamReader:
    """Reads one of our parameters (or a slice of it) from HF tensors (``TensorMap``)."""

    def __init__(self, reader: SafetensorsReader, tm: TensorMap, shape, pattern_len: int):
        self.reader, self.tm, self.shape, self.p = reader, tm, tuple(shape), pattern_len
        self.layer_shape = self.shape[1:] if tm.pos >= 0 else self.shape
        first = tm.mxfp4.format(l=max(tm.pos, 0)) + "_blocks"
        self.use_mxfp4 = bool(tm.mxfp4) and first in reader

    def hf_names(self, layer: int | None) -> list[str]:
        tm = self.tm
        if self.use_mxfp4:
            base = tm.mxfp4.format(l=layer)
            return [base + "_blocks", base + "_scales"]
        if tm.kind == "experts":
            return [tm.hf_name(layer, e) for e in range(self.layer_shape[0])]
        return [tm.hf_name(layer)]

    def expected_shape(self, name: str) -> tuple[int, ...]:
        s, tm = self.layer_shape, self.tm
        if self.use_mxfp4:
            rows = 2 * s[2] if tm.kind in ("even", "odd") else s[2]
            if name.endswith("_blocks"):
                return (s[0], rows, s[1] // 32, 16)
            return (s[0], rows, s[1] // 32)
        if tm.kind == "linear":
            return (math.prod(s[tm.n_in :]), math.prod(s[: tm.n_in]))
        if tm.kind == "experts":
            return (math.prod(s[1 + tm.n_in :]), math.prod(s[1 : 1 + tm.n_in]))
        if tm.kind in ("even", "odd"):
            return (*s[:-1], 2 * s[-1])
        if tm.kind == "flat":
            return (math.prod(s),)
        return s

    def check(self, layers) -> None:
        """Raises ValueError for a missing tensor, a shape mismatch or an unexpected dtype."""
        where = "params/" + "/".join(self.tm.path)
        for layer in layers:
            for name in self.hf_names(layer):
                want = self.expected_shape(name)
                if name not in self.reader:
                    raise ValueError(
                        f"tensor {name} is missing from {self.reader.path} "
                        f"(needed for {where}, expected shape {want})"
                    )
                got = self.reader.shape(name)
                if got != want:
                    raise ValueError(f"tensor {name} has shape {got}; expected {want} ({where})")
                dt, allowed = self.reader.dtype(name), ("U8",) if self.use_mxfp4 else FLOAT_DTYPES
                if dt not in allowed:
                    raise ValueError(
                        f"tensor {name} has dtype {dt}; expected one of {allowed} "
                        f"(shape {want}, {where})"
                    )

    def read(self, index=None) -> np.ndarray:
        """float32 slice ``index`` of the parameter (whole when None)."""
        index = _norm(index or (), self.shape)
        if self.tm.pos < 0:
            return self._layer(None, index)
        g = index[0]
        parts = [self._layer(gi * self.p + self.tm.pos, index[1:]) for gi in range(g.start, g.stop)]
        return np.stack(parts, axis=0)

    def _layer(self, layer, index) -> np.ndarray:
        tm, rd, s = self.tm, self.reader, self.layer_shape
        if self.use_mxfp4:
            return self._mxfp4(layer, index)
        if tm.kind == "same":
            return rd.read(tm.hf_name(layer), index).astype(np.float32)
        if tm.kind == "flat":
            a0, a1, post = _flat(index, s)
            x = rd.read(tm.hf_name(layer), (slice(a0, a1),)).astype(np.float32)
            return x.reshape(-1, *s[1:])[post]
        if tm.kind in ("even", "odd"):
            last = index[-1]
            x = rd.read(tm.hf_name(layer), (*index[:-1], slice(2 * last.start, 2 * last.stop)))
            return x[..., (tm.kind == "odd") :: 2].astype(np.float32)
        if tm.kind == "linear":
            return _linear(rd, tm.hf_name(layer), s, tm.n_in, index)
        e = index[0]
        return np.stack(
            [
                _linear(rd, tm.hf_name(layer, j), s[1:], tm.n_in, index[1:])
                for j in range(*e.indices(s[0])[:2])
            ]
        )

    def _mxfp4(self, layer, index) -> np.ndarray:
        e, i, r = index  # ours [E, in, R']
        g0, g1 = i.start // 32, -(-i.stop // 32)
        paired = self.tm.kind in ("even", "odd")
        rows = slice(2 * r.start, 2 * r.stop) if paired else r
        blocks_name, scales_name = self.hf_names(layer)
        blocks = self.reader.read(blocks_name, (e, rows, slice(g0, g1)))
        scales = self.reader.read(scales_name, (e, rows, slice(g0, g1)))
        x = mxfp4_dequantize(blocks, scales).transpose(0, 2, 1)  # [e, in', rows]
        x = x[:, i.start - 32 * g0 : i.stop - 32 * g0]
        return x[..., (self.tm.kind == "odd") :: 2] if paired else x


def _linear(rd: SafetensorsReader, name: str, shape, n_in: int, index) -> np.ndarray:
    """Slice ``index`` of ours (``shape``; first ``n_in`` axes = the input dim) from the HF
    ``[out, in]`` weight ``name``: reads only the covering rows and columns."""
    in_shape, out_shape = shape[:n_in], shape[n_in:]
    a0, a1, post_in = _flat(index[:n_in], in_shape)
    b0, b1, post_out = _flat(index[n_in:], out_shape)
    t = rd.read(name, (slice(b0, b1), slice(a0, a1))).astype(np.float32)
    x = t.T.reshape(
        (a1 - a0) // math.prod(in_shape[1:]),
        *in_shape[1:],
        (b1 - b0) // math.prod(out_shape[1:]),
        *out_shape[1:],
    )
    return x[(*post_in, *post_out)]


def read_hf_config(path: str) -> dict[str, Any]:
    """``config.json`` of an HF directory as a dict. Raises FileNotFoundError."""
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _param_specs(cfg: ModelConfig, policy: DTypePolicy):
    """Shapes and logical partition specs of the model's parameters (no compute)."""
    model = Transformer(cfg, policy)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def load_pretrained(
    path: str,
    policy: str | DTypePolicy = "fp32",
    mesh: jax.sharding.Mesh | None = None,
    *,
    mesh_cfg: MeshConfig | None = None,
    log: list | None = None,
) -> tuple[ModelConfig, dict]:
    """Loads an HF directory into the project's model.

    Args:
      path: directory with ``config.json`` and safetensors (single file or sharded index).
      policy: dtype policy (parameters are stored in ``policy.param``).
      mesh: optional mesh; each parameter is then sharded by the logical-axis rules of
        ``mesh_cfg`` (default ``MeshConfig()``) and each device's shard is read on its own.
      mesh_cfg: the rules (``MeshConfig.rules``) used with ``mesh``.
      log: optional list receiving every tensor read (``SafetensorsReader``).

    Returns:
      ``(cfg, {"params": ...})`` with the same tree as ``model.transformer.init_params``.

    Raises:
      ValueError: unknown architecture, an unsupported config field, a missing tensor, a shape
        mismatch or an unexpected dtype (naming the tensor and the expected shape).
      FileNotFoundError: no ``config.json`` or safetensors.
    """
    policy = get_policy(policy)
    hf = read_hf_config(path)
    family = family_of(hf)
    cfg = family.model_config(hf)
    reader = SafetensorsReader(path, log=log)
    shapes, specs = _param_specs(cfg, policy)
    maps = {tm.path: tm for tm in tensor_maps(family.name, cfg)}
    shardings = logical_to_sharding(specs, mesh, mesh_cfg) if mesh is not None else None
    p = len(cfg.layer_pattern)
    used: set[str] = set()
    out: dict = {}
    for path_, leaf in _leaves(shapes["params"]):
        tm = maps.get(path_)
        if tm is None:
            raise ValueError(f"params/{'/'.join(path_)} has no source tensor in {family.name}")
        pr = _ParamReader(reader, tm, leaf.shape, p)
        layers = [g * p + tm.pos for g in range(cfg.n_groups)] if tm.pos >= 0 else [None]
        pr.check(layers)
        for layer in layers:
            used.update(pr.hf_names(layer))
        dtype = policy.param
        if shardings is None:
            value = jnp.asarray(pr.read(), dtype)
        else:
            sharding = _at(shardings["params"], path_)
            value = jax.make_array_from_callback(
                leaf.shape, sharding, lambda idx, pr=pr, dtype=dtype: pr.read(idx).astype(dtype)
            )
        _set(out, path_, value)
    unused = sorted(set(reader.weight_map) - used)
    if unused:
        logger.warning("%d tensors of %s are not used: %s", len(unused), path, unused[:8])
    return cfg, {"params": out}


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def infer_family(cfg: ModelConfig) -> str:
    """The HF family whose options ``cfg`` uses (sinks: gpt_oss; q/k norm: qwen3 / qwen3_moe;
    neither, dense full attention with HF's embeddings and norms: llama).

    Raises:
      ValueError: a config of none of them.
    """
    if cfg.attn_sinks and cfg.is_moe:
        return "gpt_oss"
    if cfg.qk_norm and not cfg.scaled_embeddings:
        return "qwen3_moe" if cfg.is_moe else "qwen3"
    plain = not (cfg.scaled_embeddings or cfg.norm_offset or cfg.attn_sinks or cfg.is_moe)
    if plain and set(cfg.layer_pattern) == {"D"}:
        return "llama"
    raise ValueError("ModelConfig matches no HF family (llama, qwen3, qwen3_moe, gpt_oss)")


def _hf_tensors(family: str, cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our parameters as HF tensors (inverse of the read maps), float32/param dtype."""
    tree = params["params"] if "params" in params else params
    out: dict[str, np.ndarray] = {}
    p = len(cfg.layer_pattern)
    for tm in tensor_maps(family, cfg):
        x = np.asarray(jax.device_get(_at(tree, tm.path)))
        layers = (
            [(g * p + tm.pos, x[g]) for g in range(cfg.n_groups)] if tm.pos >= 0 else [(None, x)]
        )
        for layer, v in layers:
            name = tm.hf_name(layer)
            if tm.kind == "linear":
                out[name] = v.reshape(math.prod(v.shape[: tm.n_in]), -1).T
            elif tm.kind == "experts":
                for e in range(v.shape[0]):
                    out[tm.hf_name(layer, e)] = (
                        v[e].reshape(math.prod(v.shape[1 : 1 + tm.n_in]), -1).T
                    )
            elif tm.kind == "flat":
                out[name] = v.reshape(-1)
            elif tm.kind in ("even", "odd"):
                if name not in out:
                    out[name] = np.empty((*v.shape[:-1], 2 * v.shape[-1]), v.dtype)
                out[name][..., (tm.kind == "odd") :: 2] = v
            else:
                out[name] = v
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(
    path: str,
    cfg: ModelConfig,
    params: dict,
    *,
    family: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
) -> list[str]:
    """Writes an HF directory (``config.json`` + safetensors) that ``transformers`` loads.

    Args:
      path: output directory (created).
      cfg: the model config.
      params: ``{"params": ...}`` (or the inner tree).
      family: 'llama' | 'qwen3' | 'qwen3_moe' | 'gpt_oss'; None infers it from ``cfg``.
      dtype: tensor dtype ('float32', 'bfloat16', 'float16'); None keeps the parameters'.
      max_shard_bytes: split into ``model-0000k-of-0000n.safetensors`` files of at most this
        many bytes plus ``model.safetensors.index.json``; None writes one file.
      extra_config: ``config.json`` fields to add or override (e.g. token ids).

    Returns:
      The safetensors file names written.

    Raises:
      ValueError: unknown family or dtype.
    """
    family = family or infer_family(cfg)
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}; allowed: {sorted(FAMILIES)}")
    if dtype is not None and dtype not in _NP_DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {sorted(_NP_DTYPES)}")
    tensors = _hf_tensors(family, cfg, params)
    if dtype is not None:
        tensors = {k: v.astype(_NP_DTYPES[dtype]) for k, v in tensors.items()}
    os.makedirs(path, exist_ok=True)
    stored = jnp.dtype(next(iter(tensors.values())).dtype).name
    config = {**hf_config_json(family, cfg), "dtype": stored, **(extra_config or {})}
    config.pop("quantization_config", None)  # tensors are written dequantised
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
            "weight_map": {k: f for f, shard in zip(files, shards) for k in shard},
        }
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
    return files
