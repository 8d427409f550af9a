"""benchmarks/common.py: the shared timing helper and model presets."""

import pytest

from benchmarks import common


def test_time_ms_warms_up_syncs_each_call_and_reports_ms(monkeypatch):
    calls, synced = [], []
    clock = iter([0.0, 0.25, 1.0, 1.625, 2.0, 2.375])  # three calls: 250, 625 and 375 ms
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))

    def fn():
        calls.append(len(calls))
        return len(calls)

    t = common.time_ms(fn, reps=3, warmup=2, sync=synced.append)
    assert len(calls) == 5 and synced == [1, 2, 3, 4, 5]  # warm-up calls are synced too
    assert t == common.Timing(median_ms=375.0, min_ms=250.0, max_ms=625.0, reps=3)
    assert t.fields("step_ms", digits=0) == {
        "step_ms": 375.0,
        "step_ms_min": 250.0,
        "step_ms_max": 625.0,
    }


def test_time_ms_default_sync_blocks_on_jax_arrays():
    import jax.numpy as jnp

    t = common.time_ms(lambda: jnp.ones((4, 4)) @ jnp.ones((4, 4)), reps=2)
    assert t.reps == 2 and 0 < t.min_ms <= t.median_ms <= t.max_ms


@pytest.mark.parametrize("kw", [{"reps": 0}, {"warmup": -1}])
def test_time_ms_rejects_bad_counts(kw):
    with pytest.raises(ValueError, match="reps=.* must be >= 1 and warmup="):
        common.time_ms(lambda: None, sync=lambda _: None, **kw)


def test_timing_from_ms_rejects_empty():
    with pytest.raises(ValueError, match="times_ms is empty"):
        common.Timing.from_ms([])


def test_presets_build_model_configs():
    for name in common.PRESETS:
        cfg = common.preset(name)
        assert cfg.d_model == common.PRESETS[name]["d_model"]
    moe = common.bench_model("moe", "SSSF", capacity_factor=1.25)
    assert (moe.n_experts, moe.layer_pattern, moe.capacity_factor) == (8, "SSSF", 1.25)
    dense = common.bench_model("dense", "D")
    assert (dense.n_experts, dense.d_ff, dense.vocab_size) == (0, 768, 1024)
    with pytest.raises(ValueError, match="model preset 'huge' unknown"):
        common.preset("huge")
    with pytest.raises(ValueError, match="kind='mlp'"):
        common.bench_model("mlp", "D")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_update_matmul_flops_counts_every_weight_matmul(kind):
    """The analytic count against the model's own parameters: every weight of a matmul
    multiplies each token once (experts: k of E), plus causal attention and the tied head."""
    import jax
    import numpy as np

    from agentrl_jax.model.transformer import Transformer, init_params
    from agentrl_jax.precision import get_policy

    cfg = common.bench_model(kind, "D")
    model = Transformer(cfg, get_policy("fp32"))
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    macs = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "norm" in name:
            continue
        expert = "['moe']" in name and "router" not in name  # [G, E, ., .]: k of E per token
        share = cfg.experts_per_token / cfg.n_experts if expert else 1.0
        macs += share * np.prod(leaf.shape)  # the tied embedding: once, as the LM head
    b, t = 8, common.PROMPT + common.NEW
    attn = cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * (t + 1) / 2
    assert common.update_matmul_flops(kind) == pytest.approx(6 * b * t * (macs + attn), rel=1e-9)
    with pytest.raises(ValueError, match="kind='x'"):
        common.update_matmul_flops("x")
