"""RL update: learning step, non-finite skip, micro-batch accumulation, PPO loops, routing
replay, parity recompute, fallback controller. One tiny MoE model shared by all tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.model.chunked import sequence_logprobs
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.transformer import Transformer, init_params
from agentrl_jax.precision import get_policy
from agentrl_jax.rl.fallback import FallbackController
from agentrl_jax.rl.losses import LossConfig, aggregate, policy_loss
from agentrl_jax.rl.state import RLConfig, init_train_state
from agentrl_jax.rl.update import _micro_weights, make_grad_fn, make_update_fn, prepare_batch
from agentrl_jax.rollout.parity import rollout_aligned_logprobs
from agentrl_jax.rollout.sampler import RolloutConfig

B, T = 4, 16
CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    layer_pattern="D",
    window=4,
    sparse_block_size=4,
    sparse_topk_tokens=8,
    n_experts=4,
    experts_per_token=2,
    d_expert=16,
    init_std=0.2,
)


@pytest.fixture(scope="module")
def setup():
    model = Transformer(CFG, get_policy("fp32"))
    params = init_params(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.ones((B, T), bool)
    valid[1, 12:] = False
    valid[3, 9:] = False
    action = (rng.random((B, T)) < 0.6) & valid
    action[:, :3] = False
    adv = np.where(action, rng.normal(size=(B, T)), 0.0).astype(np.float32)

    def logp_fn(p, t):
        logp, ent, extras = sequence_logprobs(model, p, t)
        return logp, ent, extras["routes"]

    logp_fn = jax.jit(logp_fn)
    lp, _, routes = logp_fn(params, jnp.asarray(tokens))
    rollout = np.zeros((B, T), np.float32)
    rollout[:, 1:] = np.asarray(lp)
    batch = {
        "tokens": tokens,
        "valid": valid,
        "action_mask": action,
        "advantages": adv,
        "rollout_logprobs": rollout,
        "routes": np.asarray(routes),
    }
    return model, params, batch, logp_fn


# One update config (and so one compile) serves every update_fn test: 2 epochs x 2 minibatches
# of 2 sequences, micro-batches of 1, routing replay, MoE aux losses.
UPDATE_CFG = RLConfig(
    lr=1e-2,
    ppo_epochs=2,
    n_minibatches=2,
    micro_batch=1,
    use_routing_replay=True,
    loss=LossConfig(moe_lb_coef=0.01, moe_z_coef=1e-3),
)


@pytest.fixture(scope="module")
def update(setup):
    return make_update_fn(setup[0], UPDATE_CFG)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _mean_action_logp(logp_fn, params, batch):
    lp = np.asarray(logp_fn(params, jnp.asarray(batch["tokens"]))[0])
    return float(lp[(batch["action_mask"] & batch["valid"])[:, 1:]].mean())


def test_step_raises_logprob_of_rewarded_tokens(setup, update):
    model, params, batch, logp_fn = setup
    pos = dict(batch, advantages=np.where(batch["action_mask"], 1.0, 0.0).astype(np.float32))
    state = init_train_state(_copy(params), UPDATE_CFG, jax.random.key(1))
    trace = [_mean_action_logp(logp_fn, params, pos)]
    for i in range(3):
        state, metrics = update(state, pos, jax.random.key(i))
        trace.append(_mean_action_logp(logp_fn, state.params, pos))
        assert float(metrics["skipped"]) == 0.0 and float(metrics["n_updates"]) == 4
    assert int(state.step) == 3
    assert np.all(np.diff(trace) > 0), trace
    assert trace[-1] - trace[0] > 0.05
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert float(metrics["action_tokens"]) == float((pos["action_mask"] & pos["valid"]).sum())
    assert float(metrics["moe_lb_loss"]) > 0 and np.isfinite(float(metrics["loss"]))


def test_nonfinite_step_is_skipped_and_counted(setup, update):
    model, params, batch, _ = setup
    bad = dict(batch, advantages=np.full((B, T), np.nan, np.float32))
    state = init_train_state(_copy(params), UPDATE_CFG, jax.random.key(1))
    state, _ = update(state, batch, jax.random.key(0))  # one good step: non-trivial opt state
    p0, o0 = _host(state.params), _host(state.opt_state)
    for i in (1, 2):
        state, m = update(state, bad, jax.random.key(i))
        assert float(m["skipped"]) == 1.0 and float(m["skipped_updates"]) == 4
        assert float(m["nonfinite_steps"]) == i
        assert int(state.consecutive_nonfinite) == i and int(state.nonfinite_count) == i
    jax.tree.map(np.testing.assert_array_equal, _host(state.params), p0)
    jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), o0)
    state, m = update(state, batch, jax.random.key(3))  # training goes on
    assert float(m["skipped"]) == 0.0 and int(state.consecutive_nonfinite) == 0
    assert int(state.nonfinite_count) == 2 and int(state.step) == 4
    changed = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), state.params, p0)
    assert any(jax.tree.leaves(changed))


def test_routing_replay_is_used_by_the_recompute(setup, update):
    model, params, batch, logp_fn = setup
    forced = dict(batch, routes=(batch["routes"] + 1) % CFG.n_experts)
    state = init_train_state(_copy(params), UPDATE_CFG, jax.random.key(2))
    _, m_nat = update(state, batch, jax.random.key(5))
    state = init_train_state(_copy(params), UPDATE_CFG, jax.random.key(2))
    _, m_forced = update(state, forced, jax.random.key(5))
    # natural routes replayed: recompute == rollout (same numbers up to batch-size rounding)
    assert float(m_nat["mismatch/routing_agreement"]) == 1.0
    assert float(m_nat["mismatch/max_abs_dlogp"]) < 1e-4
    # other routes replayed: train routes are the forced ones, and they change the logprobs
    assert float(m_forced["mismatch/routing_exact_agreement"]) == 1.0
    assert float(m_forced["mismatch/max_abs_dlogp"]) > 1e-2


@pytest.mark.parametrize(
    "agg_mode",
    ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
)
def test_micro_weights_decompose_every_aggregation(agg_mode):
    rng = np.random.default_rng(7)
    loss = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    mask = jnp.asarray(rng.random((6, 5)) < 0.5).at[2].set(False)
    full = aggregate(loss, mask, agg_mode)
    loss_w, tok_w = _micro_weights(mask.reshape(3, 2, 5), agg_mode)
    parts = [
        aggregate(loss[2 * u : 2 * u + 2], mask[2 * u : 2 * u + 2], agg_mode) for u in range(3)
    ]
    np.testing.assert_allclose(float(jnp.sum(loss_w * jnp.stack(parts))), float(full), rtol=1e-6)
    np.testing.assert_allclose(float(jnp.sum(tok_w)), 1.0, rtol=1e-6)


def test_micro_batch_accumulation_equals_full_batch_gradient(setup):
    """Micro-batches of 1 with the fused anchor (no logp_old: the gradient pass's own
    stop-gradient logprobs) == the gradient of the plain full-batch objective anchored at the
    pre-update logprobs."""
    model, params, batch, logp_fn = setup
    loss_cfg = LossConfig(agg_mode="seq-mean-token-mean", entropy_coef=0.01)
    cfg = RLConfig(micro_batch=1, loss=loss_cfg)
    data = prepare_batch(batch, cfg, model)
    data.pop("rollout_routes")
    logp0 = logp_fn(params, data["tokens"])[0]

    def reference(p):  # straightforward full-batch objective
        logp, ent, _ = sequence_logprobs(model, p, data["tokens"], valid=data["valid"])
        loss, _ = policy_loss(logp, logp0, None, data["adv"], data["mask"], loss_cfg, entropy=ent)
        return loss

    grads, metrics, aux = jax.jit(make_grad_fn(model, cfg))(params, data)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    real = np.asarray(batch["valid"][:, 1:])  # padding rows differ: they take no MoE expert
    np.testing.assert_allclose(np.asarray(aux["logp"])[real], np.asarray(logp0)[real], atol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5, atol=1e-6)
    flat_ref = np.concatenate([np.ravel(g) for g in jax.tree.leaves(ref_grads)])
    flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    np.testing.assert_allclose(flat, flat_ref, rtol=1e-4, atol=1e-6 * np.abs(flat_ref).max())
    # the single-sequence gradients really differ: a wrong micro-batch weighting would show
    assert np.abs(flat_ref).max() > 1e-3


def test_parity_recompute_is_bitwise_the_rollout_recompute(setup):
    """fp32-parity: sequence_logprobs == rollout.parity.rollout_aligned_logprobs, bit for bit,
    with routing replay and recorded KV evictions (none in row 0)."""
    model, params, batch, logp_fn = setup
    pol = get_policy("fp32-parity")
    sc = RolloutConfig(chunk=4, page_size=8, max_len=24)
    rng = np.random.default_rng(11)
    never = np.iinfo(np.int32).max
    evict = np.where(rng.random((B, T)) < 0.3, rng.integers(8, 20, (B, T)), never)
    evict[0] = never
    evict = jnp.asarray(evict, jnp.int32)
    toks, routes = jnp.asarray(batch["tokens"]), jnp.asarray(batch["routes"])

    def both(p, ev):
        mine = sequence_logprobs(
            model,
            p,
            toks,
            pol,
            chunk_spec=sc,
            replay_routes=routes,
            evict_at=ev,
            with_entropy=False,
        )[0]
        theirs, _ = rollout_aligned_logprobs(
            model.clone(policy=pol), p, toks, sc, evict_at=ev, replay_routes=routes
        )
        return mine, theirs[:, 1:]

    got, want = jax.jit(both)(params, evict)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    full = np.asarray(logp_fn(params, toks)[0])  # natural routes = the replayed ones here
    # row 0 (nothing evicted): the full-sequence distribution up to rounding; others: evicted
    np.testing.assert_allclose(np.asarray(got)[0], full[0], atol=1e-4)
    assert np.abs(np.asarray(got)[1:] - full[1:]).max() > 1e-3
    with pytest.raises(ValueError, match="chunk_spec"):
        sequence_logprobs(model, params, toks, pol)
    with pytest.raises(ValueError, match="evict_at"):
        sequence_logprobs(model, params, toks, evict_at=evict)


def test_fallback_controller_switches_after_n_and_back():
    cfg = RLConfig(max_consecutive_nonfinite=2, fallback_policy="bf16", fallback_steps=3)
    built, calls = [], []
    outcomes = iter([0, 1, 0, 1, 1, 0, 0, 0, 1, 0])

    def build(policy):
        built.append(policy.name)

        def fn(state, batch, rng=None):
            calls.append(policy.name)
            return state, {"skipped": np.float32(next(outcomes))}

        return fn

    ctl = FallbackController(build, cfg, get_policy("fp8"))
    active = []
    for _ in range(10):
        _, m = ctl(None, None)
        active.append(m["fallback_active"])
    # non-finite at calls 2, 4, 5 -> 2 in a row at call 5 -> bf16 for calls 6-8 -> back at 9
    assert calls == ["fp8"] * 5 + ["bf16"] * 3 + ["fp8"] * 2
    assert ctl.events == [(5, "fallback", "bf16"), (8, "primary", "fp8")]
    assert active == [0.0] * 5 + [1.0] * 3 + [0.0] * 2
    assert built == ["fp8", "bf16"]  # cached: switching back does not rebuild


def test_config_and_input_validation(setup):
    model, params, batch, _ = setup
    for bad in (
        dict(lr=0.0),
        dict(ppo_epochs=0),
        dict(micro_batch=0),
        dict(b2=1.0),
        dict(old_logprobs="x"),
        dict(fallback_policy="fp4"),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RLConfig(**bad)
    with pytest.raises(ValueError, match="use_kv_mask_replay=True needs a parity policy"):
        make_update_fn(model, RLConfig(use_kv_mask_replay=True))
    with pytest.raises(ValueError, match="sampling_meta"):
        make_update_fn(model, RLConfig(), get_policy("fp32-parity"))
    cfg = RLConfig(n_minibatches=3)
    state = init_train_state(_copy(params), cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="n_minibatches"):
        make_update_fn(model, cfg)(state, batch, jax.random.key(0))
    with pytest.raises(ValueError, match="advantages"):
        prepare_batch({"tokens": batch["tokens"], "action_mask": batch["action_mask"]}, cfg, model)
