"""Teacher-forced passes the RL loop runs outside the update: the frozen reference policy's
logprobs for the KL penalty (``rl.loss.kl_coef > 0``), and the shared no-entropy forward the
critic and expert guidance use."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from agentrl_jax.model.chunked import as_chunk_spec, sequence_logprobs
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer


def teacher_forced(model_cfg: ModelConfig, sampling, policy, params, tokens, valid):
    """``(logp f32 [B, T-1], extras)`` of a no-entropy teacher-forced pass under ``policy``
    (the sampler's chunk geometry ``sampling`` for parity policies)."""
    logp, _, extras = sequence_logprobs(
        Transformer(model_cfg, policy),
        params,
        tokens,
        valid=valid,
        chunk_spec=as_chunk_spec(sampling),
        with_entropy=False,
    )
    return logp, extras


def _logprobs(model_cfg: ModelConfig, sampling, policy, params, tokens, valid) -> jax.Array:
    logp, _ = teacher_forced(model_cfg, sampling, policy, params, tokens, valid)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def make_logprobs_fn(model_cfg: ModelConfig, sampling):
    """Jitted ``logprobs(policy, params, tokens, valid) -> f32 [B, T]`` of ``tokens`` (column 0
    is 0), in the trajectory's alignment: the reference policy's for the KL penalty, the current
    policy's for an expert's episode. ``policy`` is static."""
    return jax.jit(functools.partial(_logprobs, model_cfg, sampling), static_argnums=0)
