"""Times the attention ops per impl against cuDNN / XLA baselines; one JSON line per row.

Rows (``kernel``):
  sliding_window  causal sliding-window attention (band FLOPs); impls xla, pallas (Triton on
                  GPU), cudnn (``jax.nn.dot_product_attention`` with its window mask: the
                  same result). Each line's ``ratio_vs_cudnn`` is cudnn time / impl time on
                  the same pass; ``frac_of_cudnn_causal_tflops`` its FLOP rate over the rate
                  cuDNN reaches on full causal attention at the same T (row ``dense_causal``).
  dense_causal    cuDNN / XLA full causal attention on the same shapes (the comparator).
  block_sparse    top-k block-sparse attention (selected FLOPs); ``ratio_vs_cudnn`` is dense
                  causal cuDNN time / impl time (the speedup of attending to the selection).
  paged_decode    one-token decode over a paged cache, bf16 or int8 pages (``kv_dtype``; impl
                  ``cpu``: the C++ kernel, on the CPU backend where it builds):
                  ``hbm_fraction`` = K/V bytes read / time / the card's HBM bandwidth;
                  ``ratio_vs_cudnn`` against cuDNN on the same tokens laid out contiguously.
Every impl line carries ``rel_err_vs_reference`` = ||out - ref|| / ||ref|| (fp32 reference;
for ``ms_fwd_bwd`` rows the largest over dq, dk, dv of a random cotangent): at long T on a
slice the reference can afford (sliding-window: the last ``--check-rows`` queries against the
reference on the sub-sequence that holds their windows; block-sparse: the reference on those
rows' absolute positions; decode: the first 4 sequences).

Timing: compile + one warm call, then the median of ``--reps`` calls, fewer when one call
takes long (``--budget-s`` per impl and pass). Imports only jax/numpy and the kernels package.

  python benchmarks/kernels.py                                  # CPU shapes, Pallas interpreted
  python benchmarks/kernels.py --kernels sliding_window --seq 32768 --heads-q 32 --heads-kv 8 \
      --head-dim 128 --window 4096                              # a GPU row of issue 36
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
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
# HBM bandwidth by device kind (vendor datasheets, bytes/s) for hbm_fraction.
HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
BWD_FACTOR = 2.5  # backward matmul FLOPs over forward (5 matmuls vs 2)


def device_name() -> str:
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()}"
        except OSError:
            pass
    return kind


def _rel_err(out, ref) -> float:
    """max over leaves of ||out - ref|| / ||ref|| in float32; NaN if out is not finite."""
    errs = []
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
        if not np.all(np.isfinite(o)):
            return float("nan")
        errs.append(float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)))
    return max(errs)


def _time(fn, args, reps, budget_s):
    """-> dict(ms, ms_min, ms_max, compile_s, reps, out) or None if it fails."""
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        first = time.perf_counter() - t0
        n = max(1, min(reps, int(budget_s / max(first, 1e-6))))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - t0) * 1e3)
    except Exception as e:  # an impl that fails here is reported, not fatal
        log.warning("failed: %s", str(e).splitlines()[0][:300])
        return None
    ms = statistics.median(times)
    return dict(ms=ms, ms_min=min(times), ms_max=max(times), compile_s=compile_s, reps=n, out=out)


def _fwd_bwd(op, cot):
    """(q, k, v) -> (dq, dk, dv) of sum(op(q, k, v) * cot)."""
    loss = lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32) * cot)
    return jax.grad(loss, argnums=(0, 1, 2))


class Bench:
    def __init__(self, a):
        self.a = a
        self.common = dict(
            bench="kernels",
            backend=jax.default_backend(),
            devices=f"{jax.device_count()}x{jax.devices()[0].device_kind}",
            device=device_name(),
            host_cpus=os.cpu_count(),
            jax_version=jax.__version__,
        )
        self.gpu = jax.default_backend() == "gpu"

    def emit(self, **row):
        print(json.dumps({**self.common, **row}), flush=True)

    def impls(self, available):
        wanted = self.a.impls.split(",")
        return [i for i in available if i in wanted]

    def measure(self, fns, args, flops=None, passes=("fwd", "fwd_bwd")):
        """fns: pass -> fn(*args). Returns pass -> timing dict (or None)."""
        out = {}
        for p in passes:
            if p in fns and (p == "fwd" or self.a.grad):
                out[p] = _time(fns[p], args, self.a.reps, self.a.budget_s)
        return out

    def row(self, kernel, impl, shape, t, flops, base=None, causal=None, err=None, **extra):
        """One line: times per pass, rates, ratio to the comparator's times ``base``."""
        line = dict(variant=f"{kernel}/{impl}", kernel=kernel, impl=impl, **shape)
        for p, name in (("fwd", "ms_fwd"), ("fwd_bwd", "ms_fwd_bwd")):
            r = t.get(p)
            line[name] = None if r is None else round(r["ms"], 4)
            if r is not None:
                line[f"{name}_min"], line[f"{name}_max"] = (
                    round(r["ms_min"], 4),
                    round(r["ms_max"], 4),
                )
                line[f"compile_s_{p}"], line[f"reps_{p}"] = round(r["compile_s"], 2), r["reps"]
                if flops is not None:
                    mult = 1.0 if p == "fwd" else 1.0 + BWD_FACTOR
                    line[f"tflops_{p}"] = float(f"{flops * mult / (r['ms'] * 1e-3) / 1e12:.4g}")
                b = (base or {}).get(p)
                if b is not None:
                    line[f"ratio_vs_cudnn_{p}" if self.gpu else f"ratio_vs_dpa_xla_{p}"] = round(
                        b["ms"] / r["ms"], 3
                    )
                c = (causal or {}).get(p)
                if c is not None and flops is not None:
                    line[f"frac_of_cudnn_causal_tflops_{p}"] = round(line[f"tflops_{p}"] / c, 3)
        best = "fwd_bwd" if line["ms_fwd_bwd"] is not None else "fwd"
        line["tflops"] = line.get(f"tflops_{best}")
        line["ratio_vs_cudnn"] = line.get(f"ratio_vs_cudnn_{best}")
        line["rel_err_vs_reference"] = err
        if impl == "pallas" and not self.gpu and jax.default_backend() != "tpu":
            line["interpret"] = True  # Pallas interpret mode: the interpreter's time
        line.update(extra)
        self.emit(**line)


def _qkv(seed, b, t, hq, hkv, d, dtype):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (
        jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype)
        for kk, h in zip(ks[:3], (hq, hkv, hkv))
    )
    return q, k, v, jax.random.normal(ks[3], (b, t, hq, d), jnp.float32)


def _dpa(causal=True, window=None, impl="xla"):
    local = None if window is None else (window - 1, 0)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=local, implementation=impl
    )


def _baseline(bench, fn_of_impl, args, cot):
    """cuDNN on GPU (XLA if cuDNN refuses), XLA elsewhere -> (times, impl)."""
    if not bench.a.baselines:
        return {}, None
    for impl in ("cudnn", "xla") if bench.gpu else ("xla",):
        fn = fn_of_impl(impl)
        t = bench.measure({"fwd": fn, "fwd_bwd": _fwd_bwd(fn, cot)}, args)
        if t.get("fwd") is not None:
            return t, impl
    return {}, None


def _pairs_swa(t, w):
    return sum(min(i + 1, w) for i in range(t))


def _checker(ref_rows, pick, cot):
    """rel_err of an impl on the checked rows: ``ref_rows(q, k, v)`` is the fp32 reference of
    the rows ``pick`` selects. Returns err(op, timed) -> (fwd error, gradient error)."""
    jref = jax.jit(ref_rows)
    grads_of = lambda f: jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * pick(cot)), (0, 1, 2))
    )

    def err(op, timed, args):
        r = timed.get("fwd")
        if r is None:
            return None, None
        fwd = _rel_err(pick(r["out"]), jref(*args))
        if timed.get("fwd_bwd") is None:
            return fwd, None
        try:  # an untimed call with the cotangent on the checked rows only
            got = grads_of(lambda q, k, v: pick(op(q, k, v)))(*args)
            want = grads_of(ref_rows)(*args)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            log.warning("gradient check failed: %s", str(e).splitlines()[0][:300])
            return fwd, float("nan")
        return fwd, _rel_err(got, want)

    return err


def bench_sliding_window(bench, a, dtype):
    q, k, v, cot = _qkv(0, a.batch, a.seq, a.heads_q, a.heads_kv, a.head_dim, dtype)
    w, t = a.window, a.seq
    flops = 4.0 * a.batch * a.heads_q * a.head_dim * _pairs_swa(t, w)
    shape = dict(T=t, window=w, batch=a.batch, heads_q=a.heads_q, heads_kv=a.heads_kv)
    shape.update(head_dim=a.head_dim, dtype=jnp.dtype(dtype).name)
    causal_flops = 4.0 * a.batch * a.heads_q * a.head_dim * t * (t + 1) / 2
    causal, causal_impl = _baseline(bench, lambda i: _dpa(True, None, i), (q, k, v), cot)
    if causal_impl:
        bench.row("dense_causal", causal_impl, {**shape, "window": t}, causal, causal_flops)
    rates = {
        p: causal_flops * (1 + BWD_FACTOR * (p == "fwd_bwd")) / (r["ms"] * 1e-3) / 1e12
        for p, r in causal.items()
        if r is not None and bench.gpu
    }
    base, base_impl = _baseline(bench, lambda i: _dpa(True, w, i), (q, k, v), cot)
    # The last rows against the reference on the sub-sequence that holds their windows.
    rows = min(a.check_rows, t)
    s0 = max(0, t - rows - w)
    ref = lambda q_, k_, v_: K.sliding_window_attention_reference(
        q_[:, s0:], k_[:, s0:], v_[:, s0:], window=w
    )[:, -rows:]
    err = _checker(ref, lambda x: x[:, -rows:], cot)
    for impl in bench.impls(["xla", "pallas", "cudnn"] if bench.gpu else ["xla", "pallas"]):
        op = functools.partial(
            K.sliding_window_attention, window=w, impl=impl, interpret=not bench.gpu
        )
        t_ = bench.measure({"fwd": op, "fwd_bwd": _fwd_bwd(op, cot)}, (q, k, v))
        e_fwd, e_bwd = err(op, t_, (q, k, v))
        bench.row(
            "sliding_window",
            impl,
            shape,
            t_,
            flops,
            base,
            rates,
            e_fwd,
            rel_err_grads_vs_reference=e_bwd,
            baseline_impl=base_impl,
        )


def _topk_blocks(key, b, t, hkv, bs, n_sel, qb):
    """Per query group of ``qb`` tokens: its own block plus random earlier blocks, shared by
    the group's tokens; drawn on the device in chunks of <= 2^26 scores."""
    nblk, groups = -(-t // bs), -(-t // qb)
    chunk = max(1, min(groups, (1 << 26) // (b * hkv * nblk)))
    n_chunks = -(-groups // chunk)
    kb = jnp.arange(nblk)

    def one(c):
        first = (c * chunk + jnp.arange(chunk)) * qb  # first token of each group
        own = (jnp.minimum(first + qb - 1, t - 1) // bs)[None, :, None, None]
        s = jax.random.uniform(jax.random.fold_in(key, c), (b, chunk, hkv, nblk))
        s = jnp.where(kb == own, 2.0, jnp.where(kb * bs <= first[None, :, None, None], s, -1.0))
        top, idx = jax.lax.top_k(s, n_sel)
        return jnp.where(top >= 0, idx, -1).astype(jnp.int32)

    idx = jax.lax.map(one, jnp.arange(n_chunks))  # [chunks, B, chunk, K, L]
    idx = idx.transpose(1, 0, 2, 3, 4).reshape(b, n_chunks * chunk, hkv, n_sel)[:, :groups]
    return jnp.repeat(idx, qb, axis=1)[:, :t]


def _visible_pairs(idx, bs):
    """(query token, key) pairs the selection lets through, causal, summed over kv heads."""
    t = jnp.arange(idx.shape[1])[None, :, None, None]
    pairs = jnp.where(idx >= 0, jnp.clip(t - idx * bs + 1, 0, bs), 0)
    return jnp.sum(pairs, dtype=jnp.float32)


def bench_block_sparse(bench, a, dtype):
    q, k, v, cot = _qkv(1, a.batch, a.seq, a.heads_q, a.heads_kv, a.head_dim, dtype)
    bs, qb, t = a.block_size, a.query_block, a.seq
    n_sel = a.topk_tokens // bs
    topk = jax.jit(_topk_blocks, static_argnums=range(1, 7))
    idx = topk(jax.random.key(2), a.batch, t, a.heads_kv, bs, n_sel, qb)
    g = a.heads_q // a.heads_kv
    flops = 4.0 * a.head_dim * g * float(jax.jit(_visible_pairs, static_argnums=1)(idx, bs))
    shape = dict(T=t, topk_tokens=a.topk_tokens, block_size=bs, query_block=qb, batch=a.batch)
    shape.update(heads_q=a.heads_q, heads_kv=a.heads_kv, head_dim=a.head_dim)
    shape.update(dtype=jnp.dtype(dtype).name, selected_flops=flops)
    base, base_impl = _baseline(bench, lambda i: _dpa(True, None, i), (q, k, v), cot)
    rows = np.arange(max(0, t - a.check_rows), t)  # the last rows, against every key
    ref = lambda q_, k_, v_: K.block_sparse_attention_reference(
        q_[:, rows], k_, v_, idx[:, rows], block_size=bs, q_positions=jnp.asarray(rows)
    )
    err = _checker(ref, lambda x: x[:, rows], cot)
    for impl in bench.impls(["xla", "pallas", "pallas_tpu"]):
        if impl == "pallas_tpu" and jax.default_backend() != "tpu":
            continue
        op = functools.partial(
            K.block_sparse_attention,
            block_indices=idx,
            block_size=bs,
            query_block=qb,
            impl=impl,
            interpret=not bench.gpu and impl == "pallas",
        )
        t_ = bench.measure({"fwd": op, "fwd_bwd": _fwd_bwd(op, cot)}, (q, k, v))
        e_fwd, e_bwd = err(op, t_, (q, k, v))
        bench.row(
            "block_sparse",
            impl,
            shape,
            t_,
            flops,
            base,
            None,
            e_fwd,
            rel_err_grads_vs_reference=e_bwd,
            baseline_impl=base_impl,
            dense_causal_ms_fwd=_ms(base, "fwd"),
            dense_causal_ms_fwd_bwd=_ms(base, "fwd_bwd"),
        )


def _ms(t, p):
    r = (t or {}).get(p)
    return None if r is None else round(r["ms"], 4)


def _pages(a, dtype, int8):
    b, ctx, ps = a.decode_batch, a.decode_context, a.page_size
    hq, hkv, d = a.heads_q, a.heads_kv, a.head_dim
    max_pages = -(-ctx // ps)
    rng = np.random.default_rng(3)
    lengths = rng.integers(ctx // 2, ctx + 1, b).astype(np.int32)
    num_pages = b * max_pages
    tables = rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32)
    kk, kv, kq, ks = jax.random.split(jax.random.key(4), 4)
    shape5 = (num_pages, ps, hkv, d)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dtype)
    if int8:
        pages = [
            jax.random.randint(x, shape5, -127, 128, jnp.int32).astype(jnp.int8) for x in (kk, kv)
        ]
        sc = jax.random.uniform(ks, (2, num_pages, hkv), jnp.float32, 0.005, 0.02)
        scales = dict(k_scales=sc[0], v_scales=sc[1])
    else:
        pages = [jax.random.normal(x, shape5, jnp.float32).astype(dtype) for x in (kk, kv)]
        scales = {}
    return q, pages, jnp.asarray(tables), jnp.asarray(lengths), scales


def bench_paged_decode(bench, a, dtype, int8):
    q, (kp, vp), tables, lengths, scales = _pages(a, dtype, int8)
    b, ps, hkv, d = a.decode_batch, a.page_size, a.heads_kv, a.head_dim
    owned = float((-(-np.asarray(lengths) // ps) * ps).sum())
    item = jnp.dtype(kp.dtype).itemsize
    nbytes = 2 * owned * hkv * d * item + (2 * owned / ps * hkv * 4 if int8 else 0)
    kind = "paged_decode_int8" if int8 else "paged_decode"
    shape = dict(T=a.decode_context, batch=b, heads_q=a.heads_q, heads_kv=hkv, head_dim=d)
    shape.update(page_size=ps, kv_dtype=jnp.dtype(kp.dtype).name, dtype=jnp.dtype(dtype).name)
    shape.update(kv_bytes=nbytes)
    peak = next((bw for name, bw in HBM.items() if name in jax.devices()[0].device_kind), None)
    # cuDNN / XLA on the same tokens laid out contiguously (dequantised for int8).
    max_pages = tables.shape[1]
    deq = lambda p, s: (
        p[tables].astype(jnp.float32) * (1.0 if s is None else s[tables][:, :, None, :, None])
    )
    kc = deq(kp, scales.get("k_scales")).reshape(b, max_pages * ps, hkv, d).astype(dtype)
    vc = deq(vp, scales.get("v_scales")).reshape(b, max_pages * ps, hkv, d).astype(dtype)
    base = {}
    for impl in (("cudnn", "xla") if bench.gpu else ("xla",)) if a.baselines else ():
        fn = lambda q_, k_, v_, impl=impl: jax.nn.dot_product_attention(
            q_[:, None], k_, v_, key_value_seq_lengths=lengths, implementation=impl
        )[:, 0]
        base = bench.measure({"fwd": fn}, (q, kc, vc))
        if base.get("fwd") is not None:
            bench.row(f"{kind}_contiguous", impl, shape, base, None)
            break
    del kc, vc
    n_ref = min(4, b)
    ref_out = jax.jit(
        lambda q_, k_, v_: K.paged_decode_attention_reference(
            q_[:n_ref], k_, v_, tables[:n_ref], lengths[:n_ref], **scales
        )
    )(q, kp, vp)
    for impl in bench.impls(["xla", "pallas", "pallas_tpu", "cpu"]):
        if impl == "pallas_tpu" and jax.default_backend() != "tpu":
            continue
        if impl == "cpu" and (jax.default_backend() != "cpu" or not K.paged_decode_cpu.available()):
            continue  # the C++ kernel: CPU backend, where it builds
        op = lambda q_, k_, v_, impl=impl: K.paged_decode_attention(
            q_,
            k_,
            v_,
            tables,
            lengths,
            impl=impl,
            interpret=impl == "pallas" and not bench.gpu,
            **scales,
        )
        t_ = bench.measure({"fwd": op}, (q, kp, vp), passes=("fwd",))
        r = t_.get("fwd")
        err = None if r is None else _rel_err(r["out"][:n_ref], ref_out)
        gbs = None if r is None else nbytes / (r["ms"] * 1e-3) / 1e9
        bench.row(
            kind,
            impl,
            shape,
            t_,
            None,
            base,
            None,
            err,
            gb_per_s=None if gbs is None else round(gbs, 2),
            hbm_fraction=None if gbs is None or peak is None else round(gbs * 1e9 / peak, 3),
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--kernels", default="sliding_window,block_sparse,paged_decode,paged_decode_int8"
    )
    p.add_argument("--impls", default="xla,pallas,cudnn,pallas_tpu,cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--topk-tokens", type=int, default=128, help="selected tokens per query")
    p.add_argument("--query-block", type=int, default=1, help="tokens sharing one selection")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU/TPU, float32 on CPU")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=20.0, help="timed seconds per impl/pass")
    p.add_argument("--check-rows", type=int, default=256, help="query rows checked vs the ref")
    p.add_argument("--no-grad", dest="grad", action="store_false", help="forward only")
    p.add_argument(
        "--no-baselines",
        dest="baselines",
        action="store_false",
        help="skip the cuDNN / XLA comparators (another step measured them)",
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    bench = Bench(a)
    if a.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(a.dtype)
    for kernel in a.kernels.split(","):
        if kernel == "sliding_window":
            bench_sliding_window(bench, a, dtype)
        elif kernel == "block_sparse":
            bench_block_sparse(bench, a, dtype)
        elif kernel in ("paged_decode", "paged_decode_int8"):
            bench_paged_decode(bench, a, dtype, int8=kernel.endswith("int8"))
        else:
            raise ValueError(f"--kernels: unknown {kernel!r}")


if __name__ == "__main__":
    main()
