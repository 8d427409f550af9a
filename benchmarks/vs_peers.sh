#!/usr/bin/env bash
# The project's rollout and update rows beside the peers' (Tunix, Hugging Face transformers +
# PyTorch) in one window on this machine, then the ratios against the goals.
#
# Usage: bash benchmarks/vs_peers.sh PEERS_DIR [RAW.jsonl] [--summarize]
#   --summarize: measure nothing, print the ratios of the lines already in RAW.jsonl.
#   PEERS_DIR holds the peer scripts and their venvs (tunix-venv, hf-venv): see the peers'
#   README for the set-up. Every raw line (peers' and the project's, each with load_avg_1m) is
#   appended to RAW.jsonl (default: a temporary file); stdout gets one JSON line per ratio:
#     bench=vs_peers, variant rollout/<model>/b<batch>: new_tokens_per_s of rollout.py and of
#       every peer, best_peer, ratio_vs_best_peer (goal >= 1.5);
#     variant update/<model>/fp32: step_ms of update.py (DDDD, batch 8 x 192) and PyTorch's
#       forward + backward + AdamW on the same shapes, ratio_vs_torch (goal <= 0.67);
#     variant update/<model>/bf16: update.py --policy bf16 against update_baseline.py --dtype
#       bf16 (PyTorch + transformers under CPU autocast, run with the peers' torch venv);
#     both update rows use UPDATE_MICRO sequences per gradient-accumulation micro-batch
#       (update.py / update_baseline.py --micro-batch; default 2 for the dense model, 4 for the
#       MoE, the faster sizes in update.py --micro-batch 8,4,2, docs/results.md); PyTorch also
#       runs the whole batch (the peers' script for fp32) and the ratio takes its fastest line;
#     update lines also carry goal_ms (0.67 x PyTorch's step), matmul_floor_ms (the step's
#       matmul FLOPs at the best rate matmul_peak.py measured, JAX or PyTorch, at the step's
#       shapes: no step can be faster) and goal_over_floor (below 1: the goal cannot be met);
#       dense lines also chain_ms, the fastest matmul_peak.py chain line (the step's weight
#       matmuls alone, JAX or PyTorch, at 1536 or 384 rows), chain_source and goal_over_chain
#       (at most 1: the goal leaves nothing for the rest of the step).
#   Each shape runs its peers and the project back to back (Tunix, HF, project) so drift in
#   the machine's load hits every row of a shape alike; the lines carry the load anyway.
#   ROUNDS (default 1) repeats that sequence per shape; every system's (and the project's)
#   fastest line of the shape is compared, and the ratio lines carry rounds. On a shared
#   2-core machine whose speed drifts by up to 2x within minutes, one round can put a single
#   row in a slow phase; with ROUNDS=2 or 3 each side gets the same number of tries.
#   TORCH_THREADS (default 1) sets the PyTorch peer's threads (OMP_NUM_THREADS), or a comma
#   list (e.g. 1,2) to run each PyTorch row at each count, the ratios then taken against the
#   faster: on a loaded 2-core machine torch's two OpenMP workers wait on each other at every
#   op and its rows collapse (docs/results.md), on an idle one two threads can win. Peer lines
#   carry torch_threads. RAW.jsonl should hold one run: the ratios take the best line of each
#   system and of the project per shape in it.
# Takes 7-15 minutes per round on 2 cores (7 on an idle one; ROUNDS=2: 18-20 minutes); run it
# on an otherwise idle machine.
set -euo pipefail
PEERS_DIR=$(cd "${1:?usage: vs_peers.sh PEERS_DIR [RAW.jsonl]}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
RAW=${2:-$(mktemp -t vs_peers.XXXXXX.jsonl)}
TUNIX=$PEERS_DIR/tunix-venv/bin/python
HF=$PEERS_DIR/hf-venv/bin/python
TORCH_THREADS=${TORCH_THREADS:-1}
ROUNDS=${ROUNDS:-1}
MICRO_dense=${UPDATE_MICRO:-2}
MICRO_moe=${UPDATE_MICRO:-4}
if ! [[ $ROUNDS =~ ^[0-9]+$ ]] || ((10#$ROUNDS == 0)); then
  echo "vs_peers.sh: ROUNDS=$ROUNDS must be a positive integer" >&2; exit 2
fi
MEASURE=1
if [ "${3:-}" = --summarize ]; then
  MEASURE=0
  [ -s "$RAW" ] || { echo "vs_peers.sh: --summarize needs the raw lines of a run ($RAW)" >&2; exit 2; }
elif [ -n "${3:-}" ]; then
  echo "vs_peers.sh: unknown argument ${3}; allowed: --summarize" >&2; exit 2
fi
needs=("$PY"); [ "$MEASURE" = 1 ] && needs+=("$TUNIX" "$HF")  # --summarize: the project's only
for f in "${needs[@]}"; do
  [ -x "$f" ] || { echo "vs_peers.sh: $f missing (see the peers' README)" >&2; exit 2; }
done
echo "vs_peers.sh: raw lines -> $RAW" >&2

stamp() {  # last N (default 1; 0: every) JSON lines of stdin, with the load and the row's role
  "$PY" -c '
import json, os, sys
lines = [l for l in sys.stdin.read().splitlines() if l.strip().startswith("{")]
for line in lines[-int(sys.argv[2]):]:
    row = json.loads(line)
    row.update(vs_peers_role=sys.argv[1], load_avg_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(row))
' "$1" "${2:-1}"
}
peer() { (cd "$PEERS_DIR" && "$@" 2>>"$RAW.stderr") | stamp peer >>"$RAW"; }
torch_peer() {  # torch_peer N_LINES CMD...: CMD at each thread count of TORCH_THREADS (0: all)
  local n=$1 t
  shift
  for t in ${TORCH_THREADS//,/ }; do
    (cd "$PEERS_DIR" && OMP_NUM_THREADS=$t "$@" 2>>"$RAW.stderr") | stamp peer "$n" \
      | "$PY" -c 'import json, sys
for line in sys.stdin:
    print(json.dumps({**json.loads(line), "torch_threads": int(sys.argv[1])}))' "$t" >>"$RAW"
  done
}
ours() { (cd "$ROOT/benchmarks" && "$PY" "$@" 2>>"$RAW.stderr") | stamp project 9 >>"$RAW"; }

measure() {
for B in 8 32; do
  for M in dense moe; do
    flag=(); [ "$M" = moe ] && flag=(--moe)
    for R in $(seq "$ROUNDS"); do
      echo ">> rollout $M b$B (round $R of $ROUNDS)" >&2
      peer "$TUNIX" tunix_sampler_bench.py --batch "$B" --prompt 64 --new 128 "${flag[@]}"
      torch_peer 1 "$HF" hf_generate_bench.py --batch "$B" --prompt 64 --new 128 --no_train \
        "${flag[@]}"
      ours rollout.py --models "$M" --patterns D --batches "$B" --no-nocache --reps 5
    done
  done
done
for M in dense moe; do
  flag=(); [ "$M" = moe ] && flag=(--moe)
  MICRO=MICRO_$M; MICRO=${!MICRO}
  for R in $(seq "$ROUNDS"); do
    echo ">> update $M (round $R of $ROUNDS)" >&2
    # the generate part is short here; the line's fwd_bwd_adamw_ms is the train step
    torch_peer 1 "$HF" hf_generate_bench.py --batch 8 --prompt 64 --new 8 "${flag[@]}"
    # PyTorch at our micro-batch too (the project's baseline script, peers' torch venv; its
    # --threads: the count torch_peer sets, read back from OMP_NUM_THREADS)
    torch_peer 1 sh -c 'exec "$0" "$@" --threads "$OMP_NUM_THREADS"' "$HF" \
      "$ROOT/benchmarks/update_baseline.py" --models "$M" --reps 5 --micro-batch "$MICRO"
    ours update.py --only "$M-DDDD" --iteration none --reps 5 --micro-batch "$MICRO"
    echo ">> update $M bf16 (round $R of $ROUNDS)" >&2
    # bf16: ours under the bf16 policy against the project's PyTorch baseline under CPU autocast
    # (the peers' script has no bf16 train step), whole batch and micro-batched
    for mb in $(printf '%s\n' 8 "$MICRO" | sort -u); do
      torch_peer 1 sh -c 'exec "$0" "$@" --threads "$OMP_NUM_THREADS"' "$HF" \
        "$ROOT/benchmarks/update_baseline.py" --models "$M" --dtype bf16 --reps 5 --micro-batch "$mb"
    done
    ours update.py --only "$M-DDDD" --iteration none --reps 5 --policy bf16 --micro-batch "$MICRO"
  done
done
echo ">> matmul peak (the floor under any update step)" >&2
torch_peer 0 sh -c 'exec "$0" "$@" --threads "$OMP_NUM_THREADS"' "$HF" \
  "$ROOT/benchmarks/matmul_peak.py" --framework torch
(cd "$ROOT/benchmarks" && "$PY" matmul_peak.py 2>>"$RAW.stderr") | stamp project 0 >>"$RAW"
}
[ "$MEASURE" = 1 ] && measure

"$PY" - "$RAW" <<'EOF'
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
env = {}
for r in rows:
    if r.get("vs_peers_role") == "project" and r.get("bench") in ("rollout", "update"):
        env = {k: r[k] for k in ("backend", "devices", "jax_version")}


def peer_model(r):
    return "moe" if "moe" in r.get("model", "") else "dense"


for m in ("dense", "moe"):
    for b in (8, 32):
        ours = [r for r in rows if r.get("bench") == "rollout" and r["model"] == m
                and r["batch"] == b]
        peers = {}  # each system's fastest line (over TORCH_THREADS)
        for r in rows:
            if ("system" in r and peer_model(r) == m and r["batch"] == b
                    and r.get("config", {}).get("new", 128) == 128):
                s = r["system"]
                if s not in peers or r["tokens_per_s"] > peers[s]["tokens_per_s"]:
                    peers[s] = r
        if not ours or not peers:
            continue
        best = max(peers, key=lambda s: peers[s]["tokens_per_s"])
        top = max(ours, key=lambda r: r["new_tokens_per_s"])  # the fastest round, as for peers
        line = dict(bench="vs_peers", variant=f"rollout/{m}/b{b}",
                    new_tokens_per_s=round(top["new_tokens_per_s"], 1),
                    best_peer=best, ratio_vs_best_peer=round(
                        top["new_tokens_per_s"] / peers[best]["tokens_per_s"], 3),
                    goal_ratio=1.5, rounds=len(ours),
                    load_avg_1m_max=max(r["load_avg_1m"] for r in [top, *peers.values()]))
        for s, r in peers.items():
            line[f"{s}_new_tokens_per_s"] = r["tokens_per_s"]
            if "torch_threads" in r:
                line[f"{s}_torch_threads"] = r["torch_threads"]
        print(json.dumps({**line, **env}))
    for policy in ("fp32", "bf16"):
        ours = [r for r in rows if r.get("bench") == "update" and r["model"] == m
                and r.get("policy", "fp32") == policy]
        # PyTorch: update_baseline.py (bf16 under CPU autocast; fp32 and bf16 whole batch and
        # micro-batched) and, fp32, the peers' own script (forward + backward + AdamW)
        torch = [(r, r["step_ms"]) for r in rows if r.get("bench") == "update_baseline"
                 and r.get("model") == m and r.get("policy") == policy and "step_ms" in r]
        if policy == "fp32":
            torch += [(r, r["fwd_bwd_adamw_ms"]) for r in rows
                      if "fwd_bwd_adamw_ms" in r and peer_model(r) == m]
        if ours and torch:
            t_row, t_ms = min(torch, key=lambda x: x[1])  # the fastest thread count and form
            top = min(ours, key=lambda r: r["step_ms"])  # the fastest round
            line = dict(bench="vs_peers", variant=f"update/{m}/{policy}",
                        step_ms=top["step_ms"], micro_batch=top.get("micro_batch", 8),
                        torch_step_ms=t_ms, torch_micro_batch=t_row.get("micro_batch", 8),
                        torch_source=t_row.get("system", t_row.get("bench")),
                        ratio_vs_torch=round(top["step_ms"] / t_ms, 3), goal_ratio=0.67,
                        goal_ms=round(0.67 * t_ms, 1), rounds=len(ours),
                        load_avg_1m_max=max(top["load_avg_1m"], t_row["load_avg_1m"]))
            if "torch_threads" in t_row:
                line["torch_threads"] = t_row["torch_threads"]
            # the step's matmul FLOPs at the fastest rate either framework reached at its shapes
            floors = [r[f"update_matmul_floor_ms_{m}"] for r in rows
                      if r.get("bench") == "matmul_peak" and r.get("dtype") == policy
                      and f"update_matmul_floor_ms_{m}" in r]
            if floors:
                line["matmul_floor_ms"] = min(floors)
                line["goal_over_floor"] = round(line["goal_ms"] / min(floors), 3)
            # the dense step's weight matmuls alone, as either framework runs them (best call)
            chains = [r for r in rows if r.get("bench") == "matmul_peak"
                      and r.get("dtype") == policy and "chain_rows" in r] if m == "dense" else []
            if chains:
                best = min(chains, key=lambda r: r["ms"])
                line["chain_ms"] = best["ms"]
                line["chain_source"] = f"{best['framework']}/m{best['chain_rows']}"
                line["goal_over_chain"] = round(line["goal_ms"] / best["ms"], 3)
            print(json.dumps({**line, **env}))
EOF
