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

Usage: python benchmarks/matmul_peak.py [--framework jax|torch] [--threads 2] [--reps 30]
       [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import NEW, PROMPT, env_fields, load_avg, update_matmul_flops

ROWS = 8 * (PROMPT + NEW)  # update.py's batch 8 x 192 tokens
SHAPES = ((ROWS, 256, 768), (ROWS, 768, 256), (ROWS, 256, 1024), (2048, 2048, 2048))
UPDATE_SHAPES = SHAPES[:3]


def _jax_matmul(dtype: str, m: int, k: int, n: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    dt = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(m, k)), dt)
    b = jnp.asarray(rng.normal(size=(k, n)), dt)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return lambda: f(a, b).block_until_ready()


def _torch_matmul(dtype: str, m: int, k: int, n: int):
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
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
    args = ap.parse_args(argv)
    dtypes = [x for x in args.dtypes.split(",") if x]
    bad = sorted(set(dtypes) - {"fp32", "bf16"})
    if bad or args.reps < 1:
        ap.error(f"--dtypes {bad} unknown (allowed: fp32, bf16)" if bad else "--reps must be >= 1")
    if args.framework == "torch":
        import torch

        torch.set_num_threads(args.threads)
        make, env = _torch_matmul, {"torch_version": torch.__version__, "threads": args.threads}
    else:
        make, env = _jax_matmul, env_fields()
    for dtype in dtypes:
        for m, k, n in SHAPES:
            call = make(dtype, m, k, n)
            call()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            flops = 2 * m * k * n
            line = {
                "bench": "matmul_peak",
                "variant": f"{args.framework}/{dtype}/{m}x{k}x{n}",
                "framework": args.framework,
                "dtype": dtype,
                "shape": f"{m}x{k}x{n}",
                "gflops": round(flops / min(times) / 1e9, 1),
                "gflops_median": round(flops / statistics.median(times) / 1e9, 1),
                "ms": round(1e3 * min(times), 3),
            }
            if (m, k, n) in UPDATE_SHAPES:
                for kind in ("dense", "moe"):
                    floor = update_matmul_flops(kind) / (flops / min(times))
                    line[f"update_matmul_floor_ms_{kind}"] = round(1e3 * floor, 1)
            line["load_avg_1m"] = load_avg()
            print(json.dumps({**line, **env}), flush=True)


if __name__ == "__main__":
    main()
