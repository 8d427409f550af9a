"""``agentrl plan``: size a run without allocating it (``jax.eval_shape`` only).

Counts total and active parameters, FLOPs per token for prefill and decode, KV-cache bytes per
token per layer kind and per sequence (at ``context_tokens``), and, on N devices of an
accelerator, the memory per device of a training run under the experiment's mesh: parameters,
AdamW state and gradients sharded by the same logical rules as training
(``sharding.fit_spec``), activations of one micro-batch (:func:`activation_bytes`) and the KV
cache of the configured rollout batch. It says whether the peak fits in 85% of the device's
memory and, when it does not, which mesh or micro-batch would.

FLOPs count multiply-adds as 2; attention FLOPs are ``4 * keys * n_heads * head_dim`` per token
and layer (scores + weighted values), with ``keys`` the keys a token actually attends to:
``window`` for S layers, ``sparse_topk_tokens`` (plus the block scorer's ``2 * context/B * K * H``)
for F, the context for D.

Memory per device: ``params + opt_state + max(grads + activations, kv_cache)`` (rollout and
update alternate on the same devices; the optimiser's temporaries are not counted).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
from flax import linen as nn

from agentrl_jax.config import load_config, to_dataclass
from agentrl_jax.kernels.block_sparse_xla import uses_dense_form
from agentrl_jax.kernels.chunked_causal import causal_chunks
from agentrl_jax.kernels.select import OpShape
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.dispatch import kernel_impl
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.sharding import MESH_AXES, MeshConfig, fit_spec

# Device memory (bytes) per accelerator: what nvidia-smi reports for the 80 GB H100 SXM and the
# 141 GB H200 (81559 and 143771 MiB), HBM per chip for TPU v5p (95 GiB) and v6e (32 GiB).
ACCELERATORS = {
    "h100": (81559 * 2**20, "gpu"),
    "h200": (143771 * 2**20, "gpu"),
    "v5p": (95 * 2**30, "tpu"),
    "v6e": (32 * 2**30, "tpu"),
}
WATERMARK = 0.85  # the guide's safe peak-memory fraction
FLASH_IMPLS = ("cudnn", "pallas", "pallas_tpu")  # kernels that keep no [T, keys] scores


def abstract_params(cfg: ModelConfig, policy):
    """Boxed abstract parameters (ShapeDtypeStructs with logical axis names)."""
    model = Transformer(cfg, policy)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(lambda r, t: model.init(r, t), jax.random.key(0), tokens)["params"]


def _leaves_with_axes(boxed):
    out = []
    for leaf in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)):
        if isinstance(leaf, nn.Partitioned):
            out.append((leaf.value, tuple(leaf.names)))
        else:
            out.append((leaf, (None,) * len(leaf.shape)))
    return out


def count_params(cfg: ModelConfig, policy=None) -> dict[str, int]:
    """total, expert (routed) and active-per-token parameter counts."""
    policy = policy or get_policy("fp32")
    total = expert = embed = 0
    for value, names in _leaves_with_axes(abstract_params(cfg, policy)):
        n = math.prod(value.shape)
        total += n
        if "expert" in names:
            expert += n
        if "vocab" in names:
            embed += n
    active = total - expert
    if cfg.is_moe:
        active += expert * cfg.experts_per_token // cfg.n_experts
    return {"total": total, "expert": expert, "embedding": embed, "active": active}


def attention_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Attention FLOPs of one token that sees ``context`` earlier tokens (all layers)."""
    per_key = 4 * cfg.n_heads * cfg.head_dim
    counts = cfg.layer_counts()
    s_keys = min(cfg.window, context)
    f_keys = min(cfg.sparse_topk_tokens, context)
    scorer = 2 * (context / cfg.sparse_block_size) * cfg.n_kv_heads * cfg.head_dim
    return (
        counts["S"] * per_key * s_keys
        + counts["F"] * (per_key * f_keys + scorer)
        + counts["D"] * per_key * context
    )


def kv_bytes(cfg: ModelConfig, dtype_bytes: int, seq_len: int) -> dict[str, float]:
    """KV bytes per token per layer kind and per sequence (ring buffers vs dense cache)."""
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    counts = cfg.layer_counts()
    ring = counts["S"] * per_token_layer * min(cfg.window, seq_len)
    full = (counts["F"] + counts["D"]) * per_token_layer * seq_len
    dense = cfg.n_layers * per_token_layer * seq_len
    return {
        "kv_bytes_per_token_per_layer": {k: per_token_layer for k, c in counts.items() if c},
        "kv_bytes_per_token_all_layers": cfg.n_layers * per_token_layer,
        "kv_bytes_per_seq_ring": ring + full,
        "kv_bytes_per_seq_dense": dense,
    }


def plan_mesh(cfg: ModelConfig, n_devices: int, mesh_cfg: MeshConfig | None = None) -> dict:
    """Mesh sizes for ``n_devices``: the configured ``mesh_cfg`` as given, or without one,
    experts over ``expert`` (largest power-of-two divisor of both) and the rest over ``fsdp``.

    Raises:
      ValueError: ``mesh_cfg`` cannot use exactly ``n_devices`` devices (both named).
    """
    if mesh_cfg is not None:
        try:
            return mesh_cfg.shape(n_devices)
        except ValueError as e:
            sizes = {a: getattr(mesh_cfg, a) for a in MESH_AXES}
            raise ValueError(
                f"the configured mesh {sizes} cannot use {n_devices} devices ({e}); "
                "pick a device count it divides or set mesh.* (-1: all remaining devices)"
            ) from None
    expert = 1
    if cfg.is_moe:
        while (
            expert * 2 <= n_devices
            and n_devices % (expert * 2) == 0
            and cfg.n_experts % (expert * 2) == 0
        ):
            expert *= 2
    return {"data": 1, "fsdp": n_devices // expert, "expert": expert, "tensor": 1}


def sharded_bytes(boxed, mesh: dict[str, int], rules) -> int:
    """Bytes per device of a boxed abstract tree (e.g. :func:`abstract_params`) whose logical
    axes are sharded by ``rules`` over a mesh of ``mesh`` sizes, an axis only where it divides
    the dimension (as training places them: ``sharding.tree_shardings``)."""
    rule = dict(rules)
    total = 0
    for value, names in _leaves_with_axes(boxed):
        axes = [rule.get(n) for n in names]
        spec = fit_spec(jax.sharding.PartitionSpec(*axes), value.shape, mesh)
        used = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
        shards = math.prod(mesh[a] for a in used)
        total += math.prod(value.shape) * jnp.dtype(value.dtype).itemsize // shards
    return total


def per_device_param_bytes(cfg: ModelConfig, policy, mesh: dict, rules) -> int:
    """Parameter bytes per device when logical axes are sharded by ``rules`` over ``mesh``."""
    return sharded_bytes(abstract_params(cfg, policy), mesh, rules)


def _attention_impl(cfg: ModelConfig, policy, kind: str, rows: int, seq: int, backend: str) -> str:
    """The kernel a training pass of layer ``kind`` runs (``model.dispatch.kernel_impl``)."""
    dtype = jnp.dtype(policy.compute).name
    g = cfg.n_heads // cfg.n_kv_heads
    shape = OpShape(cfg.head_dim, g, dtype, seq, rows, cfg.n_kv_heads, cfg.sparse_block_size)
    if kind == "F":
        n_sel = -(-cfg.sparse_topk_tokens // cfg.sparse_block_size)
        shape = dataclasses.replace(shape, n_sel=n_sel)
    op = "block_sparse" if kind == "F" else "sliding_window"
    return kernel_impl(policy, op, shape, backend)


def _attention_bytes(cfg: ModelConfig, c: int, kind: str, seq: int, impl: str) -> float:
    """Bytes per token a layer of ``kind`` keeps for its attention's backward pass."""
    n, k, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    flash = impl in FLASH_IMPLS
    if kind == "F":
        topk = min(cfg.sparse_topk_tokens, seq)
        scorer = 8 * n * -(-seq // cfg.sparse_block_size)  # block scores, all implementations
        if flash:
            return scorer + 8 * n
        n_sel = -(-cfg.sparse_topk_tokens // cfg.sparse_block_size)
        if impl == "xla" and uses_dense_form(seq, n_sel, cfg.sparse_block_size):
            return scorer + _chunked_causal_bytes(n, seq)  # dense masked scores
        return scorer + 4 * k * topk * h * c + 12 * n * topk  # gathered blocks
    if flash:
        return 8 * n  # log-sum-exp and row statistics
    if kind == "S" and cfg.window < seq:  # banded XLA path: chunks of keys per query chunk
        chunk = min(seq, max(16, min(cfg.window, 256)))
        return 8 * n * (-(-(cfg.window - 1) // chunk) + 1) * chunk
    return _chunked_causal_bytes(n, seq)


def _chunked_causal_bytes(n: int, seq: int) -> float:
    """Per token: the XLA causal path's fp32 probabilities over the keys up to each query
    chunk's end (``kernels.chunked_causal``), and one chunk's dP and dS in its backward pass."""
    chunks = causal_chunks(seq)
    kept = sum((e - s) * e for s, e in chunks) / seq
    return 4 * n * kept + 8 * n * seq * max(e - s for s, e in chunks) / seq


def activation_bytes(
    cfg: ModelConfig, policy, rows: int, seq: int, backend: str | None = None
) -> int:
    """Estimated bytes the gradient pass of one micro-batch of ``rows`` x ``seq`` tokens keeps.

    Per token and layer: the block's saved tensors (``c`` bytes each, the compute dtype) of
    ``12 D + 2 (N + 2K) H + 2 N H + 5 F`` elements (F the dense or shared-expert width), MoE
    dispatch buffers (``n_experts`` rows per token when dropless, ``capacity_factor * k``
    otherwise, of ``3 (D + d_expert)`` elements) and routing, and the attention's own: nothing
    but row statistics for flash kernels (cuDNN / Pallas, where ``kernels.select`` picks them on
    ``backend``), else the scores it materialises (:func:`_attention_bytes`). The scanned depth
    keeps one more group's worth in its loop; ``remat='full'`` keeps each layer's input and one
    group's working set (other remat policies are counted as none: an upper bound). Plus fp32
    logits, log-softmax and their gradient, ``12 V`` bytes per token. Checked against XLA's
    memory analysis of the compiled gradient pass (``tests/model/test_plan.py``).
    """
    backend = backend or jax.default_backend()
    c, f = jnp.dtype(policy.compute).itemsize, 4
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    width, moe = cfg.d_ff, 0.0
    if cfg.is_moe:
        per_token = (
            cfg.n_experts
            if cfg.capacity_factor == 0
            else (cfg.capacity_factor * cfg.experts_per_token)
        )
        moe = c * per_token * 3 * (d + cfg.d_expert) + c * cfg.experts_per_token * d
        moe += f * 3 * cfg.n_experts
        width = cfg.n_shared_experts * cfg.d_expert
    block = c * (12 * d + 2 * (n + 2 * k) * h + 2 * n * h + 5 * width) + moe
    group = sum(
        block
        + _attention_bytes(
            cfg, c, kind, seq, _attention_impl(cfg, policy, kind, rows, seq, backend)
        )
        for kind in cfg.layer_pattern
    )
    g = cfg.n_groups
    if cfg.remat == "full":
        layers = g * len(cfg.layer_pattern) * 2 * c * d + group
    else:
        layers = (g + (g > 1)) * group
    return int(rows * seq * (layers + 3 * f * cfg.vocab_size))


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a training run puts on the devices (from the experiment's sections).

    Attributes:
      batch_rows: sequences per update (``data.batch_size * data.group_size``).
      micro_rows: sequences per gradient micro-batch (``rl.micro_batch`` or the minibatch).
      seq: tokens per sequence (``rollout.max_len``).
      slots: rollout slots (the RL loop decodes ``batch_rows`` sequences together).
    """

    batch_rows: int
    micro_rows: int
    seq: int
    slots: int

    @classmethod
    def from_config(cls, cfg) -> RunShape:
        rows = cfg.data.batch_size * cfg.data.group_size
        micro = cfg.rl.micro_batch or rows // cfg.rl.n_minibatches
        return cls(rows, micro, cfg.rollout.max_len, rows)


def memory_per_device(cfg: ModelConfig, policy, mesh: dict, rules, run: RunShape, backend) -> dict:
    """Bytes per device of a training run (module docstring) on a mesh of ``mesh`` sizes."""
    param = sharded_bytes(abstract_params(cfg, policy), mesh, rules)
    axes = dict(rules).get("batch") or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    spec = fit_spec(jax.sharding.PartitionSpec(axes), (run.micro_rows,), mesh)
    shards = math.prod(mesh[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e))
    rows = -(-run.micro_rows // shards)
    act = activation_bytes(cfg, policy, rows, run.seq, backend)
    kv_item = jnp.dtype(policy.compute if policy.kv_cache_dtype == "int8" else policy.kv_cache)
    per_slot = kv_bytes(cfg, kv_item.itemsize, run.seq)["kv_bytes_per_seq_ring"]
    data = mesh["data"] if run.slots % mesh["data"] == 0 else 1  # slots over data
    tensor = mesh["tensor"] if cfg.n_kv_heads % mesh["tensor"] == 0 else 1  # KV heads
    kv = int(per_slot * run.slots / (data * tensor))
    out = {
        "param_bytes_per_device": param,
        # AdamW's mu and nu have the parameters' shapes, dtypes and shardings
        "opt_state_bytes_per_device": 2 * param,
        "grad_bytes_per_device": param,
        "activation_bytes_per_device": act,
        "micro_batch_rows_per_device": rows,
        "kv_cache_bytes_per_device": kv,
    }
    out["peak_bytes_per_device"] = 3 * param + max(param + act, kv)
    return out


def _candidate_meshes(cfg: ModelConfig, n_devices: int):
    """Meshes over ``n_devices`` to try when the configured one does not fit: KV heads over
    ``tensor`` (1, 2, 4, 8 dividing both), experts over ``expert`` (divisors of both), the rest
    over ``fsdp``."""
    for tensor in (1, 2, 4, 8):
        if n_devices % tensor or cfg.n_kv_heads % tensor:
            continue
        rest = n_devices // tensor
        for expert in range(1, rest + 1 if cfg.is_moe else 2):
            if rest % expert == 0 and (not cfg.is_moe or cfg.n_experts % expert == 0):
                yield {"data": 1, "fsdp": rest // expert, "expert": expert, "tensor": tensor}


def suggest(cfg: ModelConfig, policy, n_devices: int, rules, run: RunShape, backend, limit):
    """What would fit ``limit`` bytes per device: the first candidate mesh (the ones
    :func:`_candidate_meshes` yields) with the largest micro-batch that fits (halved down to
    1 row). Nothing fitting: ``min_devices``, the devices the fully sharded state would need."""
    for mesh in _candidate_meshes(cfg, n_devices):
        micro = run.micro_rows
        while micro >= 1:
            shape = dataclasses.replace(run, micro_rows=micro)
            peak = memory_per_device(cfg, policy, mesh, rules, shape, backend)
            if peak["peak_bytes_per_device"] <= limit:
                return {"mesh": mesh, "micro_batch": micro}
            micro //= 2
    one = memory_per_device(cfg, policy, plan_mesh(cfg, 1), rules, run, backend)
    return {"min_devices": math.ceil(one["peak_bytes_per_device"] / limit)}


def make_plan(
    cfg: ModelConfig,
    policy,
    n_devices: int,
    mesh_cfg: MeshConfig,
    context: int,
    *,
    run: RunShape | None = None,
    accelerator: str | None = None,
) -> dict:
    """The plan as a JSON-ready dict (see module docstring).

    Args:
      cfg, policy: the model and its dtype policy.
      n_devices: devices of the run.
      mesh_cfg: the experiment's mesh (its rules shard parameters as in training).
      context: tokens per sequence for FLOPs and the ``kv_bytes_per_seq_*`` keys.
      run: batch, micro-batch, sequence length and rollout slots (default: the base config's).
      accelerator: one of ``ACCELERATORS``: adds its memory, ``peak_fraction``, ``fits``
        (peak <= 85%) and, when it does not fit, ``suggestion``.

    Raises:
      ValueError: ``mesh_cfg`` cannot use ``n_devices``, or an unknown accelerator (checked
        before any tracing).
    """
    if accelerator is not None and accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator={accelerator!r}; allowed: {sorted(ACCELERATORS)}")
    mesh = plan_mesh(cfg, n_devices, mesh_cfg)
    counts = count_params(cfg, policy)
    matmul = 2 * (counts["active"] - counts["embedding"]) + 2 * cfg.d_model * cfg.vocab_size
    kv_dtype_bytes = 1 if policy.kv_cache_dtype == "int8" else jnp.dtype(policy.kv_cache).itemsize
    kv_1m = kv_bytes(cfg, kv_dtype_bytes, 1 << 20)
    out = {
        "n_layers": cfg.n_layers,
        "layer_pattern": cfg.layer_pattern,
        "layer_counts": cfg.layer_counts(),
        "total_params": counts["total"],
        "expert_params": counts["expert"],
        "active_params_per_token": counts["active"],
        "context_tokens": context,
        # causal prefill: a token attends to context/2 keys on average
        "prefill_flops_per_token": matmul + attention_flops_per_token(cfg, context // 2),
        "decode_flops_per_token": matmul + attention_flops_per_token(cfg, context),
        "kv_dtype": policy.kv_cache_dtype,
        **kv_bytes(cfg, kv_dtype_bytes, context),  # per sequence of context_tokens
        "kv_bytes_per_seq_1m_ring": kv_1m["kv_bytes_per_seq_ring"],
        "kv_bytes_per_seq_1m_dense": kv_1m["kv_bytes_per_seq_dense"],
        "devices": n_devices,
        "mesh": {a: mesh[a] for a in MESH_AXES},
    }
    run = run or RunShape(batch_rows=8, micro_rows=8, seq=512, slots=8)
    backend = ACCELERATORS[accelerator][1] if accelerator else jax.default_backend()
    rules = mesh_cfg.logical_rules()
    memory = memory_per_device(cfg, policy, mesh, rules, run, backend)
    out.update(memory)
    out["train_state_bytes_per_device"] = 4 * memory["param_bytes_per_device"]
    out.update(micro_batch=run.micro_rows, seq_len=run.seq, rollout_slots=run.slots)
    if accelerator:
        capacity = ACCELERATORS[accelerator][0]
        out["accelerator"], out["device_memory_bytes"] = accelerator, capacity
        out["peak_fraction"] = round(memory["peak_bytes_per_device"] / capacity, 4)
        out["fits"] = bool(memory["peak_bytes_per_device"] <= WATERMARK * capacity)
        if not out["fits"]:
            limit = WATERMARK * capacity
            out["suggestion"] = suggest(cfg, policy, n_devices, rules, run, backend, limit)
    return out


def run_from_cli(args) -> int:
    """``agentrl plan SPEC [--devices N] [--accelerator A] [--context T] [--set k=v]``: prints
    one JSON line.

    Raises:
      ValueError: a bad config, ``--devices`` < 1, an unknown accelerator, or a configured mesh
        that cannot use the devices.
    """
    cfg = load_config(args.spec, getattr(args, "set", None) or [])
    model_cfg = to_dataclass(cfg.model, ModelConfig)
    mesh_cfg = to_dataclass(cfg.mesh, MeshConfig)
    policy = get_policy(cfg.policy, kernel_impl=cfg.kernel_impl, kernels=dict(cfg.kernels))
    n = getattr(args, "devices", None) or len(jax.devices())
    context = getattr(args, "context", None) or 131072
    if n <= 0:
        raise ValueError(f"--devices={n} must be > 0")
    run = RunShape.from_config(cfg)
    plan = make_plan(
        model_cfg,
        policy,
        n,
        mesh_cfg,
        context,
        run=run,
        accelerator=getattr(args, "accelerator", None),
    )
    sys.stdout.write(json.dumps(plan) + "\n")
    return 0
