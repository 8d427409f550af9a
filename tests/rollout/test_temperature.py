"""A sampler at temperature T and the trainer agree on the policy: softmax(logits / T)."""

import jax
import numpy as np
from rollout_setup import N_SLOTS, SAMPLING
from scipy.special import logsumexp
from test_agent_loop import play

from agentrl_jax.model.chunked import ChunkSpec, sequence_logprobs
from agentrl_jax.model.transformer import Transformer
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.parity import trainer_logprobs


def test_rollout_logprobs_are_the_tempered_policy(fp32_model, tokenizer):
    model, params = fp32_model
    hot = SAMPLING.replace(temperature=0.7)
    traj, _, _ = play(model, params, tokenizer, sampling_cfg=hot)
    act = traj.action_mask
    assert act.sum() > 20
    lp, _ = trainer_logprobs(model, params, traj, sampling_cfg=hot, n_slots=N_SLOTS)
    np.testing.assert_array_equal(lp[act], traj.rollout_logprobs[act])  # parity: bitwise
    untempered, _ = trainer_logprobs(model, params, traj, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    assert np.abs(untempered[act] - traj.rollout_logprobs[act]).max() > 1e-3


def test_sequence_logprobs_temper_the_logits(fp32_model):
    model, params = fp32_model
    fast = Transformer(model.cfg, get_policy("fp32"))
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, 40)
    logits = np.asarray(fast.apply(params, tokens)[0], np.float64)[:, :-1] / 0.5
    logp = logits - logsumexp(logits, axis=-1, keepdims=True)
    want = np.take_along_axis(logp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    lp, ent, _ = sequence_logprobs(fast, params, tokens, chunk_spec=ChunkSpec(temperature=0.5))
    np.testing.assert_allclose(np.asarray(lp), want, atol=2e-5)
    _, ent1, _ = sequence_logprobs(fast, params, tokens, chunk_spec=ChunkSpec())
    assert float(np.mean(np.asarray(ent))) < float(np.mean(np.asarray(ent1)))
