"""Times the attention ops per impl beside jax.nn.dot_product_attention; one JSON line each.

Ops: sliding-window (banded FLOPs), block-sparse with top-k blocks per query (selected FLOPs,
vs dense causal attention), paged decode (bytes of owned K/V pages). Impls: reference, xla,
pallas (skipped on CPU unless --pallas-interpret), pallas_tpu (block-sparse and paged decode:
the scalar-prefetch Mosaic kernels; timed only on TPU, elsewhere one "skipped" line per pass),
and 'dpa' (jax.nn.dot_product_attention: cuDNN on GPU when it accepts the inputs, XLA
otherwise). Imports only jax/numpy. Where the reference ran on the same inputs (seq_len <=
--ref-max-seq), each impl's line carries ``rel_err_vs_reference``: ||out - ref|| / ||ref|| of
the output (fwd) or of the three gradients (fwd_bwd, the largest of the three), so a GPU run
also checks the compiled kernels.

  python benchmarks/kernels.py                       # modest CPU shapes (< 2 min)
  python benchmarks/kernels.py --seq 32768 --batch 1 --heads-q 32 --heads-kv 8 --head-dim 128 \
      --window 4096 --decode-batch 64 --decode-context 32768   # GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _import_kernels():
    """agentrl_jax.kernels, also from a bare checkout (no `pip install -e .`)."""
    try:
        from agentrl_jax import kernels

        return kernels
    except ImportError:
        import importlib.util

        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root))
        spec = importlib.util.spec_from_file_location(
            "agentrl_jax.kernels",
            root / "kernels" / "__init__.py",
            submodule_search_locations=[str(root / "kernels")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["agentrl_jax.kernels"] = module
        spec.loader.exec_module(module)
        return module


K = _import_kernels()

log = logging.getLogger("benchmarks.kernels")


def _time(fn, args, reps):
    """-> (median ms, min ms, max ms, first output)."""
    out = fn(*args)  # compile + warm-up
    jax.block_until_ready(out)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times), out


def _rel_err(out, ref) -> float:
    """max over the pytree's leaves of ||out - ref|| / ||ref||, in float32 (NaN if any
    output element is not finite)."""
    errs = []
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
        if not np.all(np.isfinite(o)):
            return float("nan")
        errs.append(float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)))
    return max(errs)


def _interpret(a, impl: str) -> bool:
    """Interpret mode for the generic Pallas impl under --pallas-interpret (CPU timing)."""
    return impl == "pallas" and a.pallas_interpret


def _grad_fn(op):
    """fwd+bwd of sum(op(q, k, v)) with respect to q, k, v."""
    loss = lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))


def _dpa(impl_pref, **kw):
    """jax.nn.dot_product_attention with cuDNN when requested and accepted, else XLA."""

    def make(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl, **kw)

    return make, impl_pref


class Bench:
    def __init__(self, args):
        self.args = args
        self.backend = jax.default_backend()
        self.common = dict(
            bench="kernels",
            backend=self.backend,
            devices=f"{jax.device_count()}x{jax.devices()[0].device_kind}",
            jax_version=jax.__version__,
        )
        impls = ["reference", "xla"]
        if self.backend != "cpu" or args.pallas_interpret:
            impls.append("pallas")
        impls.append("pallas_tpu")  # reported as skipped off TPU
        self.impls = [i for i in impls if i in args.impls.split(",")]

    def emit(self, **row):
        print(json.dumps({**self.common, **row}), flush=True)

    def timed(self, fn, inputs):
        try:
            return _time(jax.jit(fn), inputs, self.args.reps)
        except Exception as e:  # an impl that fails on this backend is reported, not fatal
            log.warning("failed: %s", str(e).splitlines()[0][:300])
            return None

    def dpa_time(self, make, inputs, grad):
        """Times dot_product_attention: cuDNN first on GPU, XLA as the fallback."""
        for impl in ["cudnn", "xla"] if self.backend == "gpu" else ["xla"]:
            fn = make(impl)
            t = self.timed(_grad_fn(fn) if grad else fn, inputs)
            if t is not None:
                return t, impl
        return None, None

    def run_op(self, op, ops, inputs, dpa_make, dpa_inputs, work, shape, unit):
        """ops: impl -> fn(*inputs). work: (fwd, dpa_fwd) FLOPs or bytes. unit: tflops|gb."""
        differentiable = not op.startswith("paged_decode")
        passes = ["fwd"] + (["fwd_bwd"] if differentiable and self.args.grad else [])
        for pas in passes:
            grad = pas == "fwd_bwd"
            mult = 3.5 if grad else 1.0  # backward ~2.5x forward matmul FLOPs
            dpa_t, dpa_impl = self.dpa_time(dpa_make, dpa_inputs, grad)
            times = {}
            for impl in self.impls:
                if impl not in ops:  # e.g. pallas_tpu for sliding-window
                    continue
                if impl == "reference" and shape["seq_len"] > self.args.ref_max_seq:
                    continue
                if impl == "pallas_tpu" and self.backend != "tpu":
                    self.emit(
                        variant=f"{op}/{impl}/{pas}",
                        op=op,
                        impl=impl,
                        **{"pass": pas},
                        skipped=f"needs a TPU (backend={self.backend}); interpret mode would "
                        "time the interpreter, not the kernel",
                        **shape,
                    )
                    continue
                fn = _grad_fn(ops[impl]) if grad else ops[impl]
                times[impl] = self.timed(fn, inputs)
            for impl, t in [*times.items(), ("dpa", dpa_t)]:
                if t is None:
                    continue
                w = (work[1] if impl == "dpa" else work[0]) * mult
                rate = (
                    {"tflops_per_s": w / (t[0] * 1e-3) / 1e12}
                    if unit == "tflops"
                    else {"gb_per_s": w / (t[0] * 1e-3) / 1e9}
                )
                ref = times.get("reference")
                err = None
                if ref is not None and impl != "dpa":
                    err = _rel_err(t[3], ref[3])
                self.emit(
                    variant=f"{op}/{impl}/{pas}",
                    op=op,
                    impl=impl,
                    dpa_impl=dpa_impl,
                    **{"pass": pas},
                    time_ms=round(t[0], 4),
                    time_ms_min=round(t[1], 4),
                    time_ms_max=round(t[2], 4),
                    **{k: round(v, 4) for k, v in rate.items()},
                    ref_time_ms=None if ref is None else round(ref[0], 4),
                    rel_err_vs_reference=None if err is None else float(f"{err:.3g}"),
                    dpa_time_ms=None if dpa_t is None else round(dpa_t[0], 4),
                    speedup_vs_dpa=None if dpa_t is None else round(dpa_t[0] / t[0], 3),
                    **shape,
                )


def _qkv(rng, b, t, hq, hkv, d, dtype):
    ks = jax.random.split(rng, 3)
    return [
        jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
        for kk, h in zip(ks, (hq, hkv, hkv))
    ]


def bench_sliding_window(bench, a, dtype):
    q, k, v = _qkv(jax.random.key(0), a.batch, a.seq, a.heads_q, a.heads_kv, a.head_dim, dtype)
    w = a.window
    pairs = sum(min(t + 1, w) for t in range(a.seq))
    flops = 4.0 * a.batch * a.heads_q * a.head_dim * pairs
    ops = {
        "reference": functools.partial(K.sliding_window_attention_reference, window=w),
        "xla": functools.partial(K.sliding_window_attention, window=w, impl="xla"),
        "pallas": functools.partial(
            K.sliding_window_attention, window=w, impl="pallas", interpret=_interpret(a, "pallas")
        ),
    }
    make, _ = _dpa(None, is_causal=True, local_window_size=(w - 1, 0))
    shape = dict(batch=a.batch, seq_len=a.seq, heads_q=a.heads_q, heads_kv=a.heads_kv)
    shape.update(head_dim=a.head_dim, window=w, dtype=jnp.dtype(dtype).name)
    bench.run_op("sliding_window", ops, (q, k, v), make, (q, k, v), (flops, flops), shape, "tflops")


def _topk_blocks(rng, b, t, hkv, bs, n_sel):
    """Per query block: its own block plus random earlier blocks (shared by the block's tokens)."""
    nblk = -(-t // bs)
    scores = jax.random.uniform(rng, (b, nblk, hkv, nblk))
    qb = jnp.arange(nblk)[None, :, None, None]
    kb = jnp.arange(nblk)[None, None, None, :]
    scores = jnp.where(kb == qb, 2.0, jnp.where(kb < qb, scores, -1.0))
    top, idx = jax.lax.top_k(scores, n_sel)
    idx = jnp.where(top >= 0, idx, -1).astype(jnp.int32)
    return jnp.repeat(idx, bs, axis=1)[:, :t]


def bench_block_sparse(bench, a, dtype):
    q, k, v = _qkv(jax.random.key(1), a.batch, a.seq, a.heads_q, a.heads_kv, a.head_dim, dtype)
    bs = a.block_size
    n_sel = max(1, round(a.topk_frac * a.seq / bs))
    idx = _topk_blocks(jax.random.key(2), a.batch, a.seq, a.heads_kv, bs, n_sel)
    # Visible (query, key) pairs per (batch, token, kv head): selected blocks, causal.
    ids = np.asarray(idx)
    t = np.arange(a.seq)[None, :, None, None]
    visible = np.where(ids >= 0, np.clip(t - ids * bs + 1, 0, bs), 0).sum()
    g = a.heads_q // a.heads_kv
    flops = 4.0 * a.head_dim * g * float(visible)
    dense = 4.0 * a.batch * a.heads_q * a.head_dim * a.seq * (a.seq + 1) / 2
    ops = {
        impl: functools.partial(
            K.block_sparse_attention,
            block_indices=idx,
            block_size=bs,
            query_block=a.query_block,
            impl=impl,
            interpret=_interpret(a, impl),
        )
        for impl in ("xla", "pallas", "pallas_tpu")
    }
    ops["reference"] = functools.partial(
        K.block_sparse_attention_reference, block_indices=idx, block_size=bs
    )
    make, _ = _dpa(None, is_causal=True)
    shape = dict(batch=a.batch, seq_len=a.seq, heads_q=a.heads_q, heads_kv=a.heads_kv)
    shape.update(head_dim=a.head_dim, block_size=bs, n_sel=n_sel, dtype=jnp.dtype(dtype).name)
    shape.update(query_block=a.query_block)
    shape.update(dense_causal_flops=dense, selected_flops=flops)
    bench.run_op("block_sparse", ops, (q, k, v), make, (q, k, v), (flops, dense), shape, "tflops")


def bench_paged_decode(bench, a, dtype, int8):
    b, ctx, ps = a.decode_batch, a.decode_context, a.page_size
    hq, hkv, d = a.heads_q, a.heads_kv, a.head_dim
    max_pages = -(-ctx // ps)
    rng = np.random.default_rng(3)
    lengths = rng.integers(ctx // 2, ctx + 1, b).astype(np.int32)
    num_pages = b * max_pages
    tables = rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32)
    kk, kv, kq = jax.random.split(jax.random.key(4), 3)
    shape5 = (num_pages, ps, hkv, d)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dtype)
    if int8:
        k_pages = jax.random.randint(kk, shape5, -127, 128, jnp.int32).astype(jnp.int8)
        v_pages = jax.random.randint(kv, shape5, -127, 128, jnp.int32).astype(jnp.int8)
        scales = dict(
            k_scales=jnp.full((num_pages, hkv), 0.01, jnp.float32),
            v_scales=jnp.full((num_pages, hkv), 0.01, jnp.float32),
        )
    else:
        k_pages = jax.random.normal(kk, shape5, jnp.float32).astype(dtype)
        v_pages = jax.random.normal(kv, shape5, jnp.float32).astype(dtype)
        scales = {}
    tables, lengths = jnp.asarray(tables), jnp.asarray(lengths)
    owned_tokens = float((-(-np.asarray(lengths) // ps) * ps).sum())
    item = jnp.dtype(k_pages.dtype).itemsize
    nbytes = 2 * owned_tokens * hkv * d * item + 2 * b * hq * d * jnp.dtype(dtype).itemsize
    ops = {}
    for impl in ("reference", "xla", "pallas", "pallas_tpu"):
        fn = (
            K.paged_decode_attention_reference
            if impl == "reference"
            else functools.partial(
                K.paged_decode_attention, impl=impl, interpret=_interpret(a, impl)
            )
        )
        ops[impl] = (lambda f: lambda q, kp, vp: f(q, kp, vp, tables, lengths, **scales))(fn)
    # dot_product_attention on the same tokens laid out contiguously (dequantised for int8).
    kc = k_pages[tables].reshape(b, max_pages * ps, hkv, d).astype(dtype)
    vc = v_pages[tables].reshape(b, max_pages * ps, hkv, d).astype(dtype)
    make, _ = _dpa(None, key_value_seq_lengths=lengths)
    dpa_inputs = (q[:, None], kc, vc)
    dpa_bytes = 2 * owned_tokens * hkv * d * jnp.dtype(dtype).itemsize
    shape = dict(batch=b, seq_len=ctx, heads_q=hq, heads_kv=hkv, head_dim=d, page_size=ps)
    shape.update(kv_dtype=jnp.dtype(k_pages.dtype).name, dtype=jnp.dtype(dtype).name)
    op = "paged_decode_int8" if int8 else "paged_decode"
    bench.run_op(op, ops, (q, k_pages, v_pages), make, dpa_inputs, (nbytes, dpa_bytes), shape, "gb")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="sliding_window,block_sparse,paged_decode,paged_decode_int8")
    p.add_argument("--impls", default="reference,xla,pallas,pallas_tpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--topk-frac", type=float, default=0.25, help="selected fraction of context")
    p.add_argument(
        "--query-block",
        type=int,
        default=None,
        help="tokens sharing one selection (default: block size; the inputs share it per block)",
    )
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU/TPU, float32 on CPU")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ref-max-seq", type=int, default=8192, help="skip dense reference above")
    p.add_argument("--no-grad", dest="grad", action="store_false", help="forward only")
    p.add_argument("--pallas-interpret", action="store_true", help="time Pallas on CPU too")
    a = p.parse_args(argv)
    a.query_block = a.query_block or a.block_size
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    bench = Bench(a)
    if a.dtype == "auto":
        dtype = jnp.float32 if bench.backend == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(a.dtype)
    ops = a.ops.split(",")
    if "sliding_window" in ops:
        bench_sliding_window(bench, a, dtype)
    if "block_sparse" in ops:
        bench_block_sparse(bench, a, dtype)
    if "paged_decode" in ops:
        bench_paged_decode(bench, a, dtype, int8=False)
    if "paged_decode_int8" in ops:
        bench_paged_decode(bench, a, dtype, int8=True)


if __name__ == "__main__":
    main()
