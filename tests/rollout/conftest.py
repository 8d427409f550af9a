"""Shared fixtures of the rollout tests: the tokenizer and the tiny MoE model of
``rollout_setup.CFG`` per policy.

Every test reuses the same model config, sampling config and slot count (``rollout_setup``) so
the jitted prefill, decode and trainer functions compile once per policy (``get_sampler`` and
the trainer's logprob function are cached).
"""

import jax
import pytest
from rollout_setup import CFG

from agentrl_jax.envs.coderepair import CodeTokenizer
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy


@pytest.fixture(scope="package")
def tokenizer():
    return CodeTokenizer()


@pytest.fixture(scope="package")
def fp32_model():
    model = Transformer(CFG, get_policy("fp32-parity"))
    return model, init_params(model, jax.random.key(0))


@pytest.fixture(scope="package")
def bf16_model(fp32_model):
    """bf16-parity model; parameters are stored in fp32 by both policies, so they are shared."""
    return Transformer(CFG, get_policy("bf16-parity")), fp32_model[1]
