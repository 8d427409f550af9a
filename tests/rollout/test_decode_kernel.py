"""Fast-policy decode through ``kernels.paged_decode_attention``: same numbers, kernel called."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from agentrl_jax.kernels import skinny_matmul_cpu
from rollout_setup import CFG, N_SLOTS, SAMPLING
from test_agent_loop import play

from agentrl_jax import kernels
from agentrl_jax.model.attention import over_live_pages, page_buckets
from agentrl_jax.model.config import ModelConfig
from agentrl_jax.model.decode_params import (
    DecodeParams,
    decode_form,
    fuse_projections,
    pack_weights,
    prepare_decode,
    transpose_head,
)
from agentrl_jax.model.layers import DecodeForm
from agentrl_jax.model.transformer import (
    CacheSpec,
    Transformer,
    init_cache,
    init_params,
)
from agentrl_jax.precision import get_policy
from agentrl_jax.rollout.parity import trainer_logprobs
from agentrl_jax.rollout.sampler import Sampler

# fp32 tolerance: the kernel reduces in another order than the chunk path's masked softmax
ATOL = 2e-5


def test_one_row_step_matches_chunk_path_dense_and_sparse():
    """D and F layers, ragged cached lengths (F selects 2 of up to 9 blocks): logits and the
    written keys close (layer 0's bitwise: same input)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="DF", window=8, sparse_block_size=4, sparse_topk_tokens=8, d_ff=48,
        init_std=0.3,
    )  # fmt: skip
    pol = get_policy("fp32")
    plain, fast = Transformer(cfg, pol), Transformer(cfg, pol, decode_kernel=True)
    params = init_params(plain, jax.random.key(0))
    b, t = 3, 32
    toks = jax.random.randint(jax.random.key(1), (b, t), 0, 64)
    lens = jnp.asarray([0, 17, 32])  # empty slot, mid-page, full pages

    @jax.jit
    def run(params, toks):
        cache = init_cache(cfg, pol, CacheSpec(b, 64, page_size=8))
        valid = jnp.arange(t)[None, :] < lens[:, None]
        _, cache, _ = plain.apply(params, toks, cache=cache, valid=valid)
        step = toks[:, :1] + 1
        one = jnp.ones((b, 1), bool)
        ref, ref_cache, _ = plain.apply(params, step, cache=cache, valid=one)
        got, got_cache, _ = fast.apply(params, step, cache=cache, valid=one)
        return ref, got, ref_cache, got_cache

    ref, got, ref_cache, got_cache = run(params, toks)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, got_cache["layers"]["layer_0"],
                 ref_cache["layers"]["layer_0"])  # fmt: skip
    close = lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)  # noqa: E731
    jax.tree.map(close, got_cache, ref_cache)


def test_fuse_projections_joins_dense_mlp_weights_only():
    """``w_gate_up`` = [w_gate | w_up] per stacked group; attention and MoE experts untouched;
    the model computes the same numbers (chunked with a cache, one row) from either tree."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="SD", window=8, d_ff=48, init_std=0.3,
    )  # fmt: skip
    pol = get_policy("fp32")
    model = Transformer(cfg, pol, decode_kernel=True)
    params = init_params(model, jax.random.key(3))
    fused = fuse_projections(params)
    for layer in ("layer_0", "layer_1"):
        mlp, want = fused["params"]["groups"][layer]["mlp"], params["params"]["groups"][layer]
        assert sorted(mlp) == ["w_down", "w_gate_up"] and mlp["w_gate_up"].shape == (2, 32, 96)
        joined = jnp.concatenate([want["mlp"]["w_gate"], want["mlp"]["w_up"]], axis=-1)
        np.testing.assert_array_equal(mlp["w_gate_up"], joined)
        assert fused["params"]["groups"][layer]["attn"].keys() == want["attn"].keys()
    moe_cfg = cfg.replace(n_experts=4, experts_per_token=2, d_expert=16)
    moe_params = init_params(Transformer(moe_cfg, pol), jax.random.key(4))
    assert jax.tree.structure(fuse_projections(moe_params)) == jax.tree.structure(moe_params)

    b = 3
    toks = jax.random.randint(jax.random.key(5), (b, 9), 0, 64)

    def stepper(model):
        @jax.jit
        def step(params):
            cache = init_cache(cfg, pol, CacheSpec(b, 32, page_size=8))
            _, cache, _ = model.apply(params, toks, cache=cache)
            return model.apply(params, toks[:, :1], cache=cache)[0]

        return step

    fused_model = model.clone(form=DecodeForm(fused_mlp=True))  # reads w_gate_up
    np.testing.assert_allclose(stepper(fused_model)(fused), stepper(model)(params), rtol=1e-6,
                               atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("scaled", [True, False])
def test_transpose_head_adds_the_tied_table_transposed(scaled):
    """``table_t`` = ``table``^T next to the table; an untied model unchanged; the tied head's
    logits from either tree close (the matmul library may sum in another order)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="DD", d_ff=48, init_std=0.3, scaled_embeddings=scaled,
    )  # fmt: skip
    pol = get_policy("fp32")
    model = Transformer(cfg, pol, decode_kernel=True)
    params = init_params(model, jax.random.key(6))
    moved = transpose_head(params)
    table = params["params"]["embed"]["table"]
    assert sorted(moved["params"]["embed"]) == ["table", "table_t"]
    np.testing.assert_array_equal(moved["params"]["embed"]["table_t"], table.T)
    untied = init_params(Transformer(cfg.replace(tie_embeddings=False), pol), jax.random.key(7))
    assert transpose_head(untied) is untied

    toks = jax.random.randint(jax.random.key(8), (3, 5), 0, 64)
    logits = jax.jit(lambda p: model.apply(p, toks)[0])
    transposed = model.clone(form=DecodeForm(head="transposed"))
    logits_t = jax.jit(lambda p: transposed.apply(p, toks)[0])
    got, want = logits_t(moved), logits(params)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    doubled = {**moved["params"]["embed"], "table_t": 2 * table.T}  # the head reads table_t
    doubled = {**moved, "params": {**moved["params"], "embed": doubled}}
    np.testing.assert_allclose(logits_t(doubled), 2 * want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits(doubled), want)  # the plain form reads the table


@pytest.mark.skipif(not skinny_matmul_cpu.available(), reason="no skinny-matmul kernel")
@pytest.mark.parametrize("scaled,tied", [(True, True), (False, True), (True, False)])
def test_pack_weights_packs_the_decode_matmuls(scaled, tied):
    """Every attention projection, dense MLP and MoE expert weight gets ``<name>_packed`` (its
    [contract, out] view, stacked groups and experts kept), the head ``head_packed`` (the tied
    table transposed and scaled as the head scales it, or ``unembed``). One decode row with a
    cache from the packed tree: logits close to the plain tree's, and the modules read the
    packed copies (doubling the head's doubles the logits; zeroing layer 0's expert down
    projection changes them)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="SD", window=8, d_ff=48, init_std=0.3, scaled_embeddings=scaled,
        tie_embeddings=tied,
    )  # fmt: skip
    pol = get_policy("fp32")
    model = Transformer(cfg, pol, decode_kernel=True)
    params = fuse_projections(init_params(model, jax.random.key(9)))
    packed = pack_weights(params, cfg)
    unpack = skinny_matmul_cpu.unpack
    for layer in ("layer_0", "layer_1"):
        got, want = packed["params"]["groups"][layer], params["params"]["groups"][layer]
        for name in ("wq", "wk", "wv", "wo"):
            w = want["attn"][name]
            view = w.reshape(2, 32, -1) if name != "wo" else w.reshape(2, 32, 32)
            np.testing.assert_array_equal(unpack(got["attn"][name + "_packed"], view.shape[-1]),
                                          view)  # fmt: skip
        for name in ("w_gate_up", "w_down"):
            w = want["mlp"][name]
            np.testing.assert_array_equal(unpack(got["mlp"][name + "_packed"], w.shape[-1]), w)
    embed = params["params"]["embed"]
    head = embed["unembed"] if not tied else embed["table"].T * (32**-0.5 if scaled else 1.0)
    np.testing.assert_allclose(unpack(packed["params"]["embed"]["head_packed"], 64), head,
                               rtol=1e-7, atol=0)  # fmt: skip
    b = 3
    toks = jax.random.randint(jax.random.key(5), (b, 9), 0, 64)

    def stepper(model, cfg):
        @jax.jit
        def step(params):
            cache = init_cache(cfg, pol, CacheSpec(b, 32, page_size=8))
            _, cache, _ = model.apply(params, toks, cache=cache)
            return model.apply(params, toks[:, :1], cache=cache)[0]

        return step

    want = stepper(model.clone(form=DecodeForm(fused_mlp=True)), cfg)(params)
    packed_form = DecodeForm(fused_mlp=True, head="packed", matmul="cpu")
    step = stepper(model.clone(form=packed_form), cfg)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(step(packed), want, rtol=0, atol=1e-5)
    reference = stepper(model.clone(form=DecodeForm(fused_mlp=True, head="packed",
                                                    matmul="reference")), cfg)  # fmt: skip
    np.testing.assert_allclose(reference(packed), want, rtol=0, atol=1e-5)
    embed = {**packed["params"]["embed"]}
    embed["head_packed"] = 2 * embed["head_packed"]
    doubled = {**packed, "params": {**packed["params"], "embed": embed}}
    np.testing.assert_allclose(step(doubled), 2 * want, rtol=0, atol=2e-5)

    # MoE: the experts [G, E, K, n] packed per expert; the router left to XLA
    moe_cfg = cfg.replace(n_experts=4, experts_per_token=2, d_expert=16)
    moe_model = Transformer(moe_cfg, pol, decode_kernel=True)
    moe_params = init_params(moe_model, jax.random.key(4))
    moe_packed = pack_weights(moe_params, moe_cfg)
    got, plain = (p["params"]["groups"]["layer_0"]["moe"] for p in (moe_packed, moe_params))
    assert sorted(got) == sorted([*plain, "w_gate_packed", "w_up_packed", "w_down_packed"])
    for name in ("w_gate", "w_up", "w_down"):
        w = plain[name]  # [G, E, K, n]
        assert got[name + "_packed"].shape[:2] == w.shape[:2]
        np.testing.assert_array_equal(unpack(got[name + "_packed"], w.shape[-1]), w)
    want = stepper(moe_model, moe_cfg)(moe_params)
    moe_step = stepper(moe_model.clone(form=DecodeForm(head="packed", matmul="cpu")), moe_cfg)
    assert float(jnp.std(want)) > 0.1
    np.testing.assert_allclose(moe_step(moe_packed), want, rtol=0, atol=1e-5)
    layer = moe_packed["params"]["groups"]["layer_0"]
    zeroed = {**layer, "moe": {**layer["moe"], "w_down_packed": 0 * got["w_down_packed"]}}
    zeroed = {**moe_packed, "params": {**moe_packed["params"], "groups": {
        **moe_packed["params"]["groups"], "layer_0": zeroed}}}  # fmt: skip
    assert float(jnp.max(jnp.abs(moe_step(zeroed) - want))) > 1e-2  # the experts read the copy


def test_decode_params_rewrites_by_the_table(fp32_model):
    """``decode_form``: a dense model's MLP projections joined except under fp8 matmuls or on a
    mesh of several devices; weights packed under float32 on one device (where the skinny-matmul
    kernel builds, unless ``kernels.decode_matmul='xla'``), else the tied head transposed (fp8
    included: the head is not an fp8 matmul), not on a mesh; shallow models unstacked.
    ``prepare_decode`` makes the rewrites the form names, and the decode reads them: the packed
    decode's matmuls are the kernel's calls; a prepared value is taken as it is."""
    params = fp32_model[1]
    native = skinny_matmul_cpu.available()
    no_pack = {"decode_matmul": "xla"}
    dense = not CFG.is_moe  # a MoE model has no dense MLP to join
    for policy, n_dev, kernels_, want in (
        ("fp32", 1, {}, (dense, "packed" if native else "transposed")),
        ("fp32", 1, no_pack, (dense, "transposed")),
        ("fp32", 2, {}, (False, "table")),
        ("fp8", 1, {}, (False, "transposed")),
        ("bf16", 1, {}, (dense, "transposed")),
    ):  # fmt: skip
        pol = get_policy(policy, kernels=kernels_)
        mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:n_dev])  # fmt: skip
        with jax.set_mesh(mesh):
            form = decode_form(CFG, pol)
            prepared = prepare_decode(params, pol, cfg=CFG)
        assert (form.fused_mlp, form.head) == want, (policy, n_dev, kernels_)
        assert prepared.form == form and form.unstacked  # 1 group <= 16
        assert (form.matmul == "cpu") == (want[1] == "packed")
        inner = prepared.params["params"]
        assert ("groups" in inner) != form.unstacked
        assert ("table_t" in inner["embed"]) == (form.head == "transposed")
        assert ("head_packed" in inner["embed"]) == (form.head == "packed")

        sampler = Sampler(Transformer(CFG, pol), SAMPLING)
        st = sampler.init_state(N_SLOTS, 16)
        ones = np.ones(N_SLOTS, bool)
        args = (jax.random.key(0), np.arange(N_SLOTS, dtype=np.int32), ones)
        budget = np.full(N_SLOTS, 2, np.int32)
        with jax.set_mesh(mesh):
            jaxpr = jax.make_jaxpr(sampler._decode)(prepared, st, *args, budget,
                                                    np.int32(N_SLOTS))  # fmt: skip
        assert (skinny_matmul_cpu.TARGET in str(jaxpr)) == form.packed, (policy, n_dev)


def test_prepared_params_must_fit_the_decode_path(fp32_model):
    """A state that tracks attention mass decodes in chunks: it takes plain parameters
    (``prepare(track_mass=True)``), not ones rewritten for the one-row decode."""
    sampler = Sampler(Transformer(CFG, get_policy("fp32")), SAMPLING)
    params = fp32_model[1]
    plain = sampler.prepare(params, track_mass=True)
    assert isinstance(plain, DecodeParams) and plain.form == DecodeForm()
    assert plain.params is params
    one_row = sampler.prepare(params)
    assert one_row.form != DecodeForm()
    st = sampler.init_state(N_SLOTS, 16, track_mass=True)
    args = (jax.random.key(0), np.arange(N_SLOTS, dtype=np.int32), np.ones(N_SLOTS, bool))
    budget = np.full(N_SLOTS, 2, np.int32)
    with pytest.raises(ValueError, match="prepare\\(track_mass=True\\)"):
        jax.make_jaxpr(sampler._decode)(one_row, st, *args, budget, np.int32(N_SLOTS))


@pytest.fixture(scope="module")
def fast_model(fp32_model):
    """Non-parity fp32 model with the shared (fp32-stored) parameters."""
    return Transformer(CFG, get_policy("fp32")), fp32_model[1]


@pytest.mark.slow  # minutes of 2 cores cold: `make test-slow` (CI runs it)
def test_fast_policy_rollout_same_tokens_and_logprobs(fast_model, tokenizer):
    model, params = fast_model
    ker, _, _ = play(model, params, tokenizer)
    ref, _, _ = play(model, params, tokenizer, sampling_cfg=SAMPLING.replace(decode_kernel=False))
    np.testing.assert_array_equal(ker.tokens, ref.tokens)
    np.testing.assert_array_equal(ker.routes, ref.routes)
    act = ker.action_mask
    assert act.sum() > 20
    np.testing.assert_allclose(ker.rollout_logprobs[act], ref.rollout_logprobs[act], atol=ATOL)
    # the rollout/trainer mismatch of the fast policy stays at its fp32 noise level
    lp, _ = trainer_logprobs(model, params, ker, sampling_cfg=SAMPLING, n_slots=N_SLOTS)
    assert np.abs(lp[act] - ker.rollout_logprobs[act]).max() < 1e-3


@pytest.mark.parametrize("policy,calls", [("fp32", True), ("fp32-parity", False)])
def test_decode_calls_the_kernel_only_for_fast_policies(monkeypatch, fp32_model, policy, calls):
    params = fp32_model[1]
    seen = []

    def spy(name, impl):  # the dispatcher, or the C++ kernel called directly (tables per head)
        real = getattr(kernels, name)

        def call(*args, **kw):
            seen.append(kw.get("impl", impl))
            return real(*args, **kw)

        monkeypatch.setattr(kernels, name, call)

    spy("paged_decode_attention", None)
    spy("paged_decode_attention_cpu", "cpu")
    sampler = Sampler(Transformer(CFG, get_policy(policy)), SAMPLING)
    for track_mass, int8_pages in ((False, 0), (True, 0), (False, 4)):
        seen.clear()
        st = sampler.init_state(N_SLOTS, 16, track_mass=track_mass, int8_pages=int8_pages)
        ones = np.ones(N_SLOTS, bool)
        args = (jax.random.key(0), np.arange(N_SLOTS, dtype=np.int32), ones)
        budget = np.full(N_SLOTS, 2, np.int32)
        jax.make_jaxpr(sampler._decode)(params, st, *args, budget, np.int32(N_SLOTS))
        # eviction's mass tracking keeps the chunk path; an int8 pool takes the kernel
        want = calls and not track_mass
        assert bool(seen) == want and sampler.uses_decode_kernel(st) == want
        # the F layer of "SF": impl from the policy ('auto'), one call per KV head; or on CPU
        # where the C++ kernel builds, the kernel itself (one call over every head's blocks)
        native = kernels.select_impl("paged_decode") == "cpu"
        assert seen == [] or set(seen) == ({"cpu"} if native else {"auto"})


@pytest.mark.parametrize("max_pages", [1, 3, 12, 512])
def test_page_buckets_ascending_down_to_one(max_pages):
    sizes = page_buckets(max_pages)
    assert sizes[0] == 1 and sizes[-1] == max_pages
    assert all(a < b <= 1.25 * a + 1 for a, b in zip(sizes, sizes[1:]))


def test_over_live_pages_takes_the_smallest_bucket_holding_every_slot():
    tables = jnp.zeros((2, 12), jnp.int32)  # buckets 1, 2, 3, 4, 5, 7, 9, 12
    for lens, want in (([0, 0], 1), ([16, 3], 1), ([17, 0], 2), ([81, 5], 7), ([192, 1], 12)):
        got = over_live_pages(lambda n: jnp.int32(n), tables, jnp.asarray(lens), page=16)
        assert int(got) == want, lens


def test_kernel_decode_with_int8_pool_and_eviction_matches_chunk_path(fast_model):
    """Recorded int8 decisions (pages moved to the int8 pool) and evicted tokens: the kernel's
    two-pool decode samples the chunk path's tokens with its logprobs (fp32 noise)."""
    model, params = fast_model
    b, n = 2, 40
    toks = np.asarray(jax.random.randint(jax.random.key(5), (b, n), 3, CFG.vocab_size))
    at = np.full((b, 64), np.iinfo(np.int32).max, np.int32)
    evict, int8_at = at.copy(), at.copy()
    int8_at[:, 8:24] = 32  # pages 1 and 2 int8 from the chunk at 32 on
    evict[0, 26:30] = 32  # a few tokens evicted
    evict[1, 3:6] = 36
    outs = []
    for kernel in (True, False):
        sampler = Sampler(model, SAMPLING.replace(decode_kernel=kernel, max_len=64))
        st = sampler.init_state(b, int8_pages=8)
        assert sampler.uses_decode_kernel(st) == kernel
        tables8 = np.full(st.cache["int8_tables"].shape, -1, np.int32)
        tables8[:, 1:3] = np.arange(2 * b).reshape(b, 2)
        cache = {**st.cache, "int8_tables": jnp.asarray(tables8)}
        st = st._replace(cache=cache, evict_at=jnp.asarray(evict), int8_at=jnp.asarray(int8_at))
        st, _ = sampler.prefill(params, st, toks, np.full(b, n, np.int32))
        ones = np.ones(b, bool)
        args = (jax.random.key(0), np.arange(b, dtype=np.int32), ones, np.full(b, 6, np.int32))
        outs.append(sampler.decode(params, st, *args, np.int32(b))[1])
    ker, ref = outs
    np.testing.assert_array_equal(ker.tokens, ref.tokens)
    np.testing.assert_allclose(ker.logprobs, ref.logprobs, atol=ATOL)


@pytest.mark.skipif(not skinny_matmul_cpu.available(), reason="no skinny-matmul kernel")
def test_pack_weights_packs_bf16_stored_weights_as_float32():
    """A float32 policy over bf16-stored weights multiplies them as float32: so do the packed
    copies. The head's is the table scaled in bf16, as ``Embedder.decode`` writes it (jitted,
    XLA may leave that product unrounded, so the logits are compared without it)."""
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        layer_pattern="DD", d_ff=48, init_std=0.3,
    )  # fmt: skip
    pol = get_policy("fp32", param_dtype="bfloat16")
    model = Transformer(cfg, pol, decode_kernel=True)
    params = init_params(model, jax.random.key(11))
    packed = pack_weights(params, cfg)
    mlp = packed["params"]["groups"]["layer_0"]["mlp"]
    assert params["params"]["groups"]["layer_0"]["mlp"]["w_down"].dtype == jnp.bfloat16
    assert mlp["w_down_packed"].dtype == jnp.float32
    table = params["params"]["embed"]["table"]
    head = packed["params"]["embed"]["head_packed"]
    assert head.dtype == jnp.float32
    want = (table.T * (1.0 / jnp.sqrt(32.0))).astype(jnp.float32)
    np.testing.assert_array_equal(skinny_matmul_cpu.unpack(head, 64), want)
    embed = {k: v for k, v in packed["params"]["embed"].items() if k != "head_packed"}
    body = {**packed, "params": {**packed["params"], "embed": embed}}
    toks = jax.random.randint(jax.random.key(12), (2, 5), 0, 64)
    logits = jax.jit(lambda p: model.apply(p, toks)[0])
    np.testing.assert_allclose(logits(body), logits(params), rtol=0, atol=1e-5)
