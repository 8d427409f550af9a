#!/bin/bash
# The accelerator measurements of the kernels issue in one command, for a short device window:
# every step runs under its own `timeout` (a hang or failure costs that step only), all of them
# within DEADLINE seconds, most important first. Each JSON line a script prints is tagged with
# its step and the date and appended to $OUT/benchmarks/results/<device>-<date>.jsonl (copy it
# into benchmarks/results/); stderr goes to $OUT/log.txt; a short table ends stdout.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_bench.sh          # on the GPU machine (~8 minutes)
#   DRY=1 OUT=/tmp/gpu bash benchmarks/gpu_bench.sh    # on a CPU: tiny shapes, checks plumbing
#
# Needs python3 with jax (CUDA), flax, optax, chex; torch + transformers for the PyTorch step
# (the GPU image has them). grain / ml_collections are not imported. Wheels carried in .whl/
# (see the device README) are installed into /tmp/site first.
set -u
OUT=${OUT:-/tmp/gpu_bench}
DRY=${DRY:-0}
PY=${PY:-python3}
TPY=${TPY:-$PY}  # python with torch + transformers
DEADLINE=${DEADLINE:-480}  # seconds for all steps together; each is cut to what is left
SCALE=${SCALE:-1}  # multiplies each step's limit (DRY: 4, for interpret mode on a small CPU)
# STEPS="kernels_check swa_32k ...": run only these (default: all, in the order below).
mkdir -p "$OUT/benchmarks/results"
LOG=$OUT/log.txt
: >"$LOG"
T0=$(date +%s)

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package without installing it (pip would want grain): agentrl_jax/* plus kernels/ as
# agentrl_jax.kernels (the mapping pyproject.toml's package_dir makes), as links under $PKG.
PKG=${PKG:-/tmp/agentrl_pkg}
rm -rf "$PKG" && mkdir -p "$PKG/agentrl_jax"
for f in "$PWD"/agentrl_jax/*; do ln -s "$f" "$PKG/agentrl_jax/"; done
ln -s "$PWD/kernels" "$PKG/agentrl_jax/kernels"
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
missing=$($PY -c "
import importlib.util as u
print(' '.join(m for m in ('jax', 'flax', 'optax', 'chex', 'numpy') if u.find_spec(m) is None))")
echo "missing python modules: ${missing:-none}" | tee -a "$LOG"

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  SCALE=${SCALE_DRY:-4}
  DEADLINE=${DEADLINE_DRY:-2400}
  DEVICE=cpu
  K_CHECK=(--seq 128 --decode-context 128 --decode-batch 2 --reps 1 --check-rows 64)
  K_BIG=(--seq 256 --heads-q 8 --heads-kv 2 --head-dim 64 --window 64 --reps 1 --check-rows 32)
  K_DEC=(--decode-batch 2 --decode-context 256 --heads-q 8 --heads-kv 2 --head-dim 64 --reps 1)
  K_SPARSE=(--block-size 8 --topk-tokens 64)
  UPD=(--size tiny --reps 1 --patterns DDDD)
  TORCH_FLAGS=(--no-compile)  # inductor's CPU compile of even the tiny model takes minutes
else
  DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
  K_CHECK=(--seq 2048 --batch 2 --heads-q 16 --heads-kv 4 --head-dim 128 --window 512
    --block-size 8 --topk-tokens 512 --decode-batch 16 --decode-context 4096 --reps 3
    --check-rows 2048)
  K_BIG=(--seq 32768 --batch 1 --heads-q 32 --heads-kv 8 --head-dim 128 --window 4096 --reps 5
    --budget-s 4)
  K_DEC=(--decode-batch 64 --decode-context 32768 --heads-q 32 --heads-kv 8 --head-dim 128
    --reps 10 --budget-s 4)
  K_SPARSE=(--block-size 8 --topk-tokens 4096)
  UPD=(--size 1b --reps 5)
  TORCH_FLAGS=()
fi
SLUG=$(echo "${DEVICE:-unknown}" | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9.-')
RES=$OUT/benchmarks/results/$SLUG-$(date +%F).jsonl
: >"$RES"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" >>"$LOG" 2>&1

step() {  # step NAME LIMIT_S CMD...
  local name=$1 lim=$(($2 * SCALE))
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
    return
  fi
  local t=$(date +%s)
  local left=$((DEADLINE - (t - T0)))
  if [ "$left" -lt 20 ]; then
    echo "== $name skipped: deadline" | tee -a "$LOG"
    echo "{\"step\": \"$name\", \"skipped\": \"deadline\"}" >>"$RES"
    return
  fi
  [ "$lim" -gt "$left" ] && lim=$left
  echo "== $name (limit ${lim}s, at $((t - T0))s)" | tee -a "$LOG"
  timeout -k 5 "$lim" "$@" 2>>"$LOG" | while IFS= read -r line; do
    case $line in
      \{*) echo "{\"step\": \"$name\", \"date\": \"$(date +%F)\", ${line#\{}" >>"$RES" ;;
      *) echo "$line" >>"$LOG" ;;
    esac
  done
  local rc=${PIPESTATUS[0]}
  echo "   rc=$rc in $(($(date +%s) - t))s" | tee -a "$LOG"
  [ "$rc" = 0 ] || echo "{\"step\": \"$name\", \"error\": \"rc=$rc\"}" >>"$RES"
}

KB=benchmarks/kernels.py
# 1. Every kernel and impl at T=2048 against the full fp32 reference (compiled kernels' errors).
step kernels_check 75 $PY $KB "${K_CHECK[@]}"
# 2. The rows of the kernels issue at 32k, most important first.
step swa_32k 100 $PY $KB "${K_BIG[@]}" --kernels sliding_window --impls pallas,cudnn
step decode_32k 60 $PY $KB "${K_DEC[@]}" --kernels paged_decode,paged_decode_int8 \
  --impls pallas,xla
step sparse_32k_qb64 60 $PY $KB "${K_BIG[@]}" "${K_SPARSE[@]}" --kernels block_sparse \
  --query-block 64 --impls pallas
step sparse_32k_qb8 60 $PY $KB "${K_BIG[@]}" "${K_SPARSE[@]}" --kernels block_sparse \
  --query-block 8 --impls pallas --no-baselines
# 3. The ~1B update step, ours (MFU) and PyTorch compiled.
step update_1b 150 $PY benchmarks/update_1b.py "${UPD[@]}"
step update_1b_torch 150 env -u PYTHONPATH "$TPY" benchmarks/update_1b_torch.py \
  --size "${UPD[1]}" --reps 5 "${TORCH_FLAGS[@]}"
# 4. Slower variants, if time is left: per-token selection, the XLA paths at 32k.
step sparse_32k_qb1 60 $PY $KB "${K_BIG[@]}" "${K_SPARSE[@]}" --kernels block_sparse \
  --query-block 1 --impls pallas --no-baselines
step swa_32k_xla 50 $PY $KB "${K_BIG[@]}" --kernels sliding_window --impls xla --no-baselines
step sparse_32k_xla 50 $PY $KB "${K_BIG[@]}" "${K_SPARSE[@]}" --kernels block_sparse \
  --query-block 64 --impls xla --no-baselines
echo "total $(($(date +%s) - T0))s; results in $RES" | tee -a "$LOG"

# Short table (the reply carries the end of stdout).
$PY - "$RES" <<'PY'
import json, sys
keys = ("ms_fwd", "ms_fwd_bwd", "ratio_vs_cudnn", "tflops", "frac_of_cudnn_causal_tflops_fwd_bwd",
        "hbm_fraction", "rel_err_vs_reference", "rel_err_grads_vs_reference", "step_ms", "mfu",
        "skipped", "error")
for line in open(sys.argv[1]):
    d = json.loads(line)
    vals = " ".join(f"{k}={d[k]}" for k in keys if d.get(k) is not None)
    name = d.get("variant") or ""
    if d.get("query_block") is not None:
        name += f"/qb{d['query_block']}"
    print(f"{d['step'][:16]:16s} {name[:34]:34s} {vals[:170]}")
PY
