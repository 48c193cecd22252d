#!/usr/bin/env bash
# The capture-overhead GPU check (a GPU machine with its own CUDA torch as python3, no ai2-olmo):
# where capture's step overhead goes at compute-bound sizes. From the checkout root:
#
#   bash benchmarks/gpu_overhead.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else ./gpu_out
#
# 1. capture_overhead.py --breakdown on the plain nn.Linear LM in bf16 autocast, at each size of SIZES
#    (d_model:layers:seq:batch; default d_model 1024, T 1024, batch 16 and d_model 2048, T 2048, batch 8):
#    plain, k16, and k16 capturing without storing (k16-cap);
# 2. at the first size, --profile plain,k16-cap: one block of each under torch.profiler, the operators by
#    self device time (what the capture-only arm adds over the plain step).
# Each step writes to OUT_DIR and has its own timeout (120 s each: a fresh machine builds the d_model 2048
# model on its CPU first); 2.5-6 min in all: give the call timeout_s=420.
# DEVICE=cpu SIZES=64:1:16:2 is a dry run of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DEVICE="${DEVICE:-cuda}"
SIZES="${SIZES:-1024:8:1024:16 2048:8:2048:8}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
first=()
for size in $SIZES; do
  IFS=: read -r d layers seq batch <<< "$size"
  args=(benchmarks/capture_overhead.py --arch linear --device "$DEVICE" --autocast bf16 --vocab 32000 --ks 16
        --breakdown --d-model "$d" --n-layers "$layers" --seq "$seq" --batch "$batch")
  [ "${#first[@]}" -gt 0 ] || first=("${args[@]}")
  timeout 120 "$PY" "${args[@]}" --rounds 3 2>&1 | tee "$out/overhead_d$d.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
[ "${#first[@]}" -gt 0 ] || { echo "SIZES is empty: no size to measure"; exit 1; }
timeout 120 "$PY" "${first[@]}" --rounds 1 --profile plain,k16-cap 2>&1 | tee "$out/profile.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
