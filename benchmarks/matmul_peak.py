"""Matmul throughput of this machine at the update step's shapes: the floor under any update.

Times one 2-D matmul (``[M, K] @ [K, N]``, fp32 accumulation) per shape and dtype, best of
``--reps`` calls after a warm-up, with JAX (this project's XLA) or PyTorch (``--framework torch``,
run it with the peers' torch venv; ``--threads`` sets ``torch.set_num_threads``). The shapes are
the update step's (8 x 192 = 1536 token rows against the benchmark model's 256 / 768 / 1024
widths) and one large square for the machine's peak.

Per line: bench=matmul_peak, variant <framework>/<dtype>/<M>x<K>x<N>, gflops (best call),
gflops_median, ms (best); the update-shape lines also carry update_matmul_floor_ms per model:
``common.update_matmul_flops`` (the forward + backward matmul FLOPs of ``update.py``'s step,
dropless) at this rate, the time no implementation of the step can beat on this machine with
matmuls this fast. ``benchmarks/vs_peers.sh`` runs it beside the update rows.

Chain lines (variant <framework>/<dtype>/chain-dense-m<M>): every weight matmul of one update
step of the dense benchmark model at once, as 2-D matmuls of ``M`` token rows (``M`` = 1536,
the whole batch, and 384, ``update.py``'s 2-sequence micro-batches, repeated 4 times): for each
weight W [K, N] (q, k, v, o, gate, up, down of each layer; the tied LM head) the forward
``x W``, the input gradient ``g W^T`` and the weight gradient ``x^T g`` (summed over the
micro-batches in fp32), on random activations and gradients, with no dependency between them
(JAX: one jitted program, XLA free to order them and run two at once). ``chain_gflop`` (all of
the dense step's matmul FLOPs but causal attention's), ``ms`` and ``gflops`` of the best call:
the time this framework needs for the step's weight matmuls alone at these shapes, nothing
else of the step done (attention, norms, softmax, the loss, AdamW, dtype casts).

Usage: python benchmarks/matmul_peak.py [--framework jax|torch] [--threads 2] [--reps 30]
       [--dtypes fp32,bf16] [--chain-reps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import NEW, PRESETS, PROMPT, env_fields, load_avg, update_matmul_flops

ROWS = 8 * (PROMPT + NEW)  # update.py's batch 8 x 192 tokens
SHAPES = ((ROWS, 256, 768), (ROWS, 768, 256), (ROWS, 256, 1024), (2048, 2048, 2048))
UPDATE_SHAPES = SHAPES[:3]
CHAIN_ROWS = (ROWS, ROWS // 4)  # the whole batch; update.py's micro-batches of 2 sequences
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # attribute names in jax.numpy and torch


def chain_shapes() -> list[tuple[int, int]]:
    """[K, N] of every weight matmul of the dense benchmark model, in forward order: per layer
    q, k, v, o and the SwiGLU's gate, up and down; then the tied LM head."""
    c = PRESETS["bench-dense"]
    d, h, f = c["d_model"], c["head_dim"], c["d_ff"]
    q, kv = c["n_heads"] * h, c["n_kv_heads"] * h
    layer = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
    return layer * c["n_layers"] + [(d, c["vocab_size"])]


def chain_flops() -> int:
    """Forward + input-gradient + weight-gradient FLOPs of ``chain_shapes`` over the batch."""
    return sum(3 * 2 * ROWS * k * n for k, n in chain_shapes())


def _operands(rng, dtype_of, rows: int):
    """Random weights [K, N], activations [U, M, K] and gradients [U, M, N] per chain matmul."""
    u = ROWS // rows
    shapes = chain_shapes()
    ws = [dtype_of(rng.normal(size=(k, n)) / k**0.5) for k, n in shapes]
    xs = [dtype_of(rng.normal(size=(u, rows, k))) for k, _ in shapes]
    gs = [dtype_of(rng.normal(size=(u, rows, n))) for _, n in shapes]
    return ws, xs, gs


def _jax_chain(dtype: str, rows: int):
    """A call running the chain once; it returns, per weight, the forward and input-gradient
    products of each micro-batch in turn, then the summed weight gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = getattr(jnp, DTYPES[dtype])
    ws, xs, gs = _operands(np.random.default_rng(0), lambda a: jnp.asarray(a, dt), rows)

    @jax.jit
    def chain(ws, xs, gs):
        f32 = jnp.float32
        outs = []
        for w, x, g in zip(ws, xs, gs):
            dw = 0.0
            for u in range(x.shape[0]):
                outs.append(jnp.einsum("mk,kn->mn", x[u], w, preferred_element_type=f32))
                outs.append(jnp.einsum("mn,kn->mk", g[u], w, preferred_element_type=f32))
                # the weight gradient in the form precision._matmul gives it (a unit batch axis)
                xu, gu = x[u][None], g[u][None]
                dw = dw + jnp.einsum("umk,umn->kn", xu, gu, preferred_element_type=f32)
            outs.append(dw)
        return outs

    return lambda: jax.block_until_ready(chain(ws, xs, gs))


def _torch_chain(dtype: str, rows: int):
    import numpy as np
    import torch

    dt = getattr(torch, DTYPES[dtype])
    ws, xs, gs = _operands(np.random.default_rng(0), lambda a: torch.from_numpy(a).to(dt), rows)

    def chain():  # eager CPU ops return when done
        for w, x, g in zip(ws, xs, gs):
            dw = torch.zeros(w.shape, dtype=torch.float32)
            for u in range(x.shape[0]):
                x[u] @ w
                g[u] @ w.T
                dw += (x[u].T @ g[u]).float()

    return chain


def _line(framework: str, dtype: str, name: str, shape: str, flops: int, times) -> dict:
    """The fields every line has: rates of the best and the median call, the best call's ms."""
    return {
        "bench": "matmul_peak",
        "variant": f"{framework}/{dtype}/{name}",
        "framework": framework,
        "dtype": dtype,
        "shape": shape,
        "gflops": round(flops / min(times) / 1e9, 1),
        "gflops_median": round(flops / statistics.median(times) / 1e9, 1),
        "ms": round(1e3 * min(times), 3),
    }


def _best_of(call, reps: int) -> list[float]:
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _jax_matmul(dtype: str, m: int, k: int, n: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = getattr(jnp, DTYPES[dtype])
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(m, k)), dt)
    b = jnp.asarray(rng.normal(size=(k, n)), dt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return lambda: f(a, b).block_until_ready()


def _torch_matmul(dtype: str, m: int, k: int, n: int):
    import torch

    dt = getattr(torch, DTYPES[dtype])
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dt)
    b = torch.randn(k, n, generator=gen).to(dt)
    return lambda: a @ b  # eager CPU ops return when done


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", default="jax", choices=("jax", "torch"))
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (torch only)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--chain-reps", type=int, default=10, help="0: no chain lines")
    args = ap.parse_args(argv)
    dtypes = [x for x in args.dtypes.split(",") if x]
    bad = sorted(set(dtypes) - set(DTYPES))
    if bad or args.reps < 1 or args.chain_reps < 0:
        ap.error(
            f"--dtypes {bad} unknown (allowed: fp32, bf16)"
            if bad
            else "--reps must be >= 1 and --chain-reps >= 0"
        )
    if args.framework == "torch":
        import torch

        torch.set_num_threads(args.threads)
        make, env = _torch_matmul, {"torch_version": torch.__version__, "threads": args.threads}
        make_chain = _torch_chain
    else:
        make, env, make_chain = _jax_matmul, env_fields(), _jax_chain
    for dtype in dtypes:
        for m, k, n in SHAPES:
            times = _best_of(make(dtype, m, k, n), args.reps)
            flops, shape = 2 * m * k * n, f"{m}x{k}x{n}"
            line = _line(args.framework, dtype, shape, shape, flops, times)
            if (m, k, n) in UPDATE_SHAPES:
                for kind in ("dense", "moe"):
                    floor = update_matmul_flops(kind) / (flops / min(times))
                    line[f"update_matmul_floor_ms_{kind}"] = round(1e3 * floor, 1)
            line["load_avg_1m"] = load_avg()
            print(json.dumps({**line, **env}), flush=True)
        for rows in CHAIN_ROWS if args.chain_reps else ():
            times = _best_of(make_chain(dtype, rows), args.chain_reps)
            flops, shape = chain_flops(), f"chain dense {ROWS // rows} x {rows} rows"
            line = _line(args.framework, dtype, f"chain-dense-m{rows}", shape, flops, times)
            line |= {"chain_rows": rows, "chain_gflop": round(flops / 1e9, 2)}
            line["load_avg_1m"] = load_avg()
            print(json.dumps({**line, **env}), flush=True)


if __name__ == "__main__":
    main()
