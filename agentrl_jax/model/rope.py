"""Rotary position embedding with the scalings pretrained families use (linear, YaRN).

Legend: B batch, T time, N heads, H head dim.

``ModelConfig.rope_scaling == 'none'`` goes through ``layers.rope`` unchanged (the project's own
models keep their numbers). 'linear' divides every inverse frequency by ``rope_factor``.
'yarn' (YaRN, arXiv 2309.00071) blends interpolated (``1 / (factor * base^(2i/H))``) and
extrapolated (``1 / base^(2i/H)``) inverse frequencies with a linear ramp over the dimensions
whose wavelengths fall between ``yarn_beta_fast`` and ``yarn_beta_slow`` rotations of the
original context, and multiplies cos and sin by the attention factor
(``0.1 ln(factor) + 1`` unless ``rope_attention_factor`` is set). The frequencies are
computed on the host in float32 as the Hugging Face reference computes them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.layers import rope


def yarn_ramp_range(cfg: ModelConfig) -> tuple[float, float]:
    """YaRN's (low, high) dimension bounds of the ramp between extrapolation and interpolation."""
    dim, base = cfg.head_dim, cfg.rope_theta

    def correction_dim(rotations: float) -> float:
        ctx = cfg.rope_original_max_len
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.yarn_beta_fast), correction_dim(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


@functools.cache
def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies float32 [H/2] and the cos/sin scale of ``cfg``'s RoPE.

    Raises:
      ValueError: for an odd ``head_dim``.
    """
    dim = cfg.head_dim
    if dim % 2:
        raise ValueError(f"ModelConfig.head_dim={dim} must be even for RoPE")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(cfg.rope_theta) ** exponents
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if cfg.rope_scaling == "linear":
        return (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32), 1.0
    if cfg.rope_scaling != "yarn":
        return inv_freq, 1.0
    factor = cfg.rope_factor
    interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    low, high = yarn_ramp_range(cfg)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap_weight = (1 - ramp).astype(np.float32)
    inv_freq = interp * (1 - extrap_weight) + inv_freq * extrap_weight
    scale = cfg.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq.astype(np.float32), float(scale)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotates ``x [B, T, N, H]`` (half-split layout) at int32 ``positions [B, T]``.

    Returns the same shape and dtype; the rotation is computed in float32.
    """
    if cfg.rope_scaling == "none":
        return rope(x, positions, cfg.rope_theta)
    inv_freq, scale = rope_inv_freq(cfg)
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = (jnp.cos(angle) * scale)[:, :, None, :]
    sin = (jnp.sin(angle) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rope_reference(x: np.ndarray, positions: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """float64 numpy RoPE of ``x [B, T, N, H]`` from the YaRN / linear formulas (for tests)."""
    dim, base = cfg.head_dim, float(cfg.rope_theta)
    i = np.arange(0, dim, 2, dtype=np.float64) / dim
    extrap = 1.0 / base**i
    scale = 1.0
    if cfg.rope_scaling == "linear":
        inv = extrap / cfg.rope_factor
    elif cfg.rope_scaling == "yarn":
        low, high = yarn_ramp_range(cfg)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
        inv = extrap / cfg.rope_factor * ramp + extrap * (1.0 - ramp)
        scale = cfg.rope_attention_factor or 0.1 * math.log(cfg.rope_factor) + 1.0
    else:
        inv = extrap
    angle = positions.astype(np.float64)[..., None] * inv
    cos, sin = np.cos(angle)[:, :, None] * scale, np.sin(angle)[:, :, None] * scale
    x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
