#!/usr/bin/env bash
# The one prepared device check (a lent GPU machine: no package index, its own CUDA torch, no
# ai2-olmo or DeepSpeed). Run from the checkout root with .gpu_wheels/ from gpu_bundle.sh beside it:
#
#   bash benchmarks/peers/gpu_check.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else ./gpu_out
#
# 1. installs the wheels whose module this Python lacks into .gpu_lib/ (never over the machine's own);
# 2. the GPU tests that need no ai2-olmo (`-m gpu` in tests/test_store.py: CUDA and mixed-device
#    records stored bit for bit as their CPU copies, fp32 and bf16);
# 3. olmo_tda vs dattri-llm side by side on the GPU (benchmarks/peers/run.py --here --device cuda):
#    per-example gradient throughput, in-loop step overhead, bytes, queries, agreement with exact.
# Each step's output goes to OUT_DIR; a failing step is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
DEVICE="${DEVICE:-cuda}"
PEERS_ARGS="${PEERS_ARGS:---repeats 2 --d-model 256 --n-layers 4 --seq-len 256 --n-train 2048 --batch 32}"
status=0
{
  date -u; nvidia-smi -L || true
  python -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"

mkdir -p .gpu_lib
for pair in numpy:numpy h5py:h5py PyYAML:yaml pyyaml:yaml tqdm:tqdm dattri_llm:dattri_llm dattri:dattri pytest:pytest \
            pluggy:pluggy iniconfig:iniconfig packaging:packaging; do
  dist="${pair%%:*}" mod="${pair##*:}"
  python -c "import $mod" 2>/dev/null && continue
  for whl in .gpu_wheels/"$dist"-*.whl; do
    [ -e "$whl" ] || continue
    echo "installing $whl into .gpu_lib (this Python has no $mod)"
    python -m zipfile -e "$whl" .gpu_lib
  done
done 2>&1 | tee "$out/install.txt"
export PYTHONPATH="$PWD:$PWD/.gpu_lib${PYTHONPATH:+:$PYTHONPATH}"
export OLMO_TDA_TESTS_COLD=1

timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_store.py 2>&1 | tee "$out/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# shellcheck disable=SC2086  # PEERS_ARGS is a list of flags
timeout 420 python benchmarks/peers/run.py --here --device "$DEVICE" --systems olmo_tda,dattri_llm $PEERS_ARGS \
  --timeout 200 --out "$out/peers_cuda.json" 2>&1 | tee "$out/peers_cuda.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
date -u | tee -a "$out/machine.txt"
exit $status
