"""benchmarks/matmul_peak.py: the update step's weight-matmul chain."""

import numpy as np
import pytest

from benchmarks import common, script

matmul_peak = script("matmul_peak")


def test_chain_is_every_weight_matmul_of_the_dense_step():
    """The chain's [K, N] against the dense benchmark model's own parameters (every 2-D weight
    of a matmul, the tied embedding once as the LM head), and its FLOPs against the step's
    count less causal attention's."""
    import jax

    from agentrl_jax.model.transformer import Transformer, init_params
    from agentrl_jax.precision import get_policy

    cfg = common.bench_model("dense", "D")
    model = Transformer(cfg, get_policy("fp32"))
    shapes = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    macs = sum(
        np.prod(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
        if leaf.ndim >= 2 and "norm" not in jax.tree_util.keystr(path)
    )
    chain = matmul_peak.chain_shapes()
    assert len(chain) == 7 * cfg.n_layers + 1 and chain[-1] == (cfg.d_model, cfg.vocab_size)
    assert sum(k * n for k, n in chain) == macs
    b, t = 8, common.PROMPT + common.NEW
    attn = 6 * b * t * cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * (t + 1) / 2
    assert matmul_peak.chain_flops() == pytest.approx(common.update_matmul_flops("dense") - attn)


def test_jax_chain_computes_each_product():
    """One call at the micro-batch rows: the forward, input-gradient and summed weight-gradient
    products of the first and last weights (the LM head) equal numpy's."""
    rows = matmul_peak.CHAIN_ROWS[1]
    outs = matmul_peak._jax_chain("fp32", rows)()
    ws, xs, gs = matmul_peak._operands(np.random.default_rng(0), np.asarray, rows)
    u = len(xs[0])
    per_weight = 2 * u + 1
    assert len(outs) == per_weight * len(ws) and u == matmul_peak.ROWS // rows
    for i in (0, len(ws) - 1):
        got = outs[i * per_weight : (i + 1) * per_weight]
        w, x, g = ws[i].astype(np.float32), xs[i].astype(np.float32), gs[i].astype(np.float32)
        for j in range(u):
            np.testing.assert_allclose(got[2 * j], x[j] @ w, rtol=2e-4, atol=2e-4)
            np.testing.assert_allclose(got[2 * j + 1], g[j] @ w.T, rtol=2e-4, atol=2e-4)
        dw = np.einsum("umk,umn->kn", x, g)
        np.testing.assert_allclose(got[-1], dw, rtol=2e-4, atol=2e-3)


def test_bad_arguments_are_refused(capsys):
    for argv, msg in ((["--chain-reps", "-1"], "--chain-reps >= 0"), (["--dtypes", "fp8"], "fp8")):
        with pytest.raises(SystemExit):
            matmul_peak.main(argv)
        assert msg in capsys.readouterr().err
