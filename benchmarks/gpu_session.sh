#!/bin/bash
# One accelerator session's measurements in one command (a lent GPU is held for minutes, so
# everything runs in one call, each step under its own `timeout` so that a hang or a failure
# costs that step only). Results: every JSON line, tagged with its step, in
# $OUT/results.jsonl; stderr in $OUT/log.txt; a short table at the end of stdout.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh          # on the GPU machine
#   DRY=1 OUT=/tmp/gpu bash benchmarks/gpu_session.sh    # here: tiny shapes, checks the plumbing
#
# Needs jax (with CUDA), flax, optax, orbax, chex; torch + transformers for the baseline steps.
# grain / ml_collections / tensorboardX are not imported by these scripts.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
# The package without installing it: agentrl_jax/* plus kernels/ as agentrl_jax.kernels (the
# mapping pyproject.toml's package_dir makes), as links under $PKG.
PKG=${PKG:-/tmp/agentrl_pkg}
rm -rf "$PKG" && mkdir -p "$PKG/agentrl_jax"
for f in "$PWD"/agentrl_jax/*; do ln -s "$f" "$PKG/agentrl_jax/"; done
ln -s "$PWD/kernels" "$PKG/agentrl_jax/kernels"
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
PY=${PY:-python3}
TPY=${TPY:-$PY}  # python with torch + transformers
# transformers probes a `kernels` package: keep the project off its path.
TORCH=(env -u PYTHONPATH "$TPY")
DRY=${DRY:-0}
RES=$OUT/results.jsonl
LOG=$OUT/log.txt
: >"$RES"
: >"$LOG"
T0=$(date +%s)

DEADLINE=${DEADLINE:-450}  # seconds for all steps together; each is cut to what is left
# STEPS="update_bf16 kernels_check ...": run only these (default: all, in the order below).

step() {  # step NAME LIMIT_S CMD...
  local name=$1 lim=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    return
  fi
  local t=$(date +%s)
  local left=$((DEADLINE - (t - T0)))
  if [ "$left" -lt 15 ]; then
    echo "== $name skipped: deadline" | tee -a "$LOG"
    return
  fi
  [ "$lim" -gt "$left" ] && lim=$left
  echo "== $name (limit ${lim}s, at $((t - T0))s)" | tee -a "$LOG"
  timeout "$lim" "$@" 2>>"$LOG" | while IFS= read -r line; do
    case $line in
      \{*) echo "{\"step\": \"$name\", ${line#\{}" >>"$RES" ;;
      *) echo "$line" >>"$LOG" ;;
    esac
  done
  local rc=${PIPESTATUS[0]}
  echo "   rc=$rc in $(($(date +%s) - t))s" | tee -a "$LOG"
}

if [ "$DRY" = 1 ]; then
  REPS=1
  KSMALL=(--seq 256 --decode-context 256 --reps 1 --pallas-interpret)
  KBIG=(--seq 512 --decode-context 512 --reps 1)
  DEV=cpu
else
  REPS=20
  KSMALL=(--seq 2048 --batch 2 --heads-q 16 --heads-kv 4 --head-dim 128 --window 512
    --decode-batch 16 --decode-context 4096 --reps 3)
  KBIG=(--seq 32768 --batch 1 --heads-q 32 --heads-kv 8 --head-dim 128 --window 4096
    --decode-batch 64 --decode-context 32768 --reps 5)
  DEV=cuda
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
fi
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" >>"$LOG" 2>&1

# Issue 6: update step, ours vs PyTorch + transformers, bf16 (the default policy) first.
step update_bf16 120 $PY benchmarks/update.py --policy bf16 --reps $REPS --iter-reps 3 \
  --iteration moe-SSSF
step baseline_bf16 150 "${TORCH[@]}" benchmarks/update_baseline.py --device $DEV --dtype bf16 \
  --threads 1 --reps $REPS --compile
step baseline_cudagraphs 70 "${TORCH[@]}" benchmarks/update_baseline.py --device $DEV \
  --dtype bf16 --threads 1 --reps $REPS --models dense --compile --compile-mode reduce-overhead
step update_fp32 50 $PY benchmarks/update.py --policy fp32 --reps $REPS --only dense-DDDD,moe-DDDD \
  --iteration none
step baseline_fp32 40 "${TORCH[@]}" benchmarks/update_baseline.py --device $DEV --dtype fp32 \
  --threads 1 --reps $REPS
# Kernels: compiled Pallas (Triton) vs the fp32 reference at a modest shape, then timing at
# the GPU shapes of the kernels issue, one op per step (a slow op costs its own step only).
step kernels_check 70 $PY benchmarks/kernels.py "${KSMALL[@]}"
step kernels_big_swa 100 $PY benchmarks/kernels.py "${KBIG[@]}" --ops sliding_window
step kernels_big_decode 40 $PY benchmarks/kernels.py "${KBIG[@]}" \
  --ops paged_decode,paged_decode_int8
step kernels_big_sparse 80 $PY benchmarks/kernels.py "${KBIG[@]}" --ops block_sparse
echo "total $(($(date +%s) - T0))s" | tee -a "$LOG"

# Short table (the reply carries the end of stdout).
$PY - "$RES" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    keys = ("step_ms", "rl_iteration_ms", "time_ms", "tflops_per_s", "gb_per_s",
            "speedup_vs_dpa", "rel_err_vs_reference", "compile_s", "skipped", "error")
    vals = " ".join(f"{k}={d[k]}" for k in keys if d.get(k) is not None)
    print(f"{d['step'][:14]:14s} {str(d.get('variant'))[:40]:40s} {vals[:150]}")
PY
