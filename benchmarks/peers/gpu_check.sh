#!/usr/bin/env bash
# The one prepared device check (a lent GPU machine: no package index, its own CUDA torch as
# python3, no ai2-olmo or DeepSpeed). From the checkout root, with .gpu_wheels/ from gpu_bundle.sh:
#
#   bash benchmarks/peers/gpu_check.sh [OUT_DIR]      # OUT_DIR defaults to $OUT, else ./gpu_out
#
# 1. what this Python lacks of olmo_tda's and the peers' imports is installed from .gpu_wheels into
#    .gpu_lib/ (never over the machine's own packages); a module with no wheel is named;
# 2. the GPU tests that need no ai2-olmo (`-m gpu` in tests/test_store.py: CUDA and mixed-device
#    records stored bit for bit as their CPU copies, fp32 and bf16; in tests/test_capture.py: CUDA
#    capture, dense, projected and under bf16 autocast, against torch.func's exact per-example
#    gradients, errors printed);
# 3. olmo_tda (its random row, and its capture.budget and head-weighted eigenbasis rows) vs dattri-llm,
#    Kronfluence, dattri, TRAK and LogIX side by side on the GPU (benchmarks/peers/run.py --here
#    --device cuda, one repeat; SYSTEMS and PEERS_ARGS override): per-example gradient throughput,
#    in-loop step overhead, bytes, queries, agreement with exact. A peer that fails there is a row
#    with its reason. Its JSON (--out) is rewritten after every worker, so a run cut short keeps what
#    it measured.
# Each step writes to OUT_DIR; a failing step is reported and the next one still runs. About 9.5 min
# at most (timeouts 100 s + 470 s): give the device call timeout_s=590.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DEVICE="${DEVICE:-cuda}"
SYSTEMS="${SYSTEMS:-olmo_tda,olmo_tda_budget,olmo_tda_head,dattri_llm,kronfluence,dattri,traker,logix}"
PEERS_ARGS="${PEERS_ARGS:---repeats 1 --d-model 256 --n-layers 4 --seq-len 256 --n-train 2048 --batch 32}"
status=0
{
  date -u; nvidia-smi -L || true
  "$PY" -c "import sys, torch; print(sys.executable, sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"

mkdir -p .gpu_lib
for pair in dattri_llm:dattri_llm dattri:dattri kronfluence:kronfluence einconv:einconv traker:trak logix_ai:logix \
    numpy:numpy h5py:h5py pyyaml:yaml tqdm:tqdm pytest:pytest accelerate:accelerate opt_einsum:opt_einsum; do
  dist="${pair%%:*}" mod="${pair##*:}"
  "$PY" -c "import $mod" 2>/dev/null && continue
  found=0
  for whl in .gpu_wheels/"$dist"-*.whl; do
    [ -e "$whl" ] || continue
    echo "installing $whl into .gpu_lib (this Python has no $mod)"
    "$PY" -m zipfile -e "$whl" .gpu_lib && found=1
  done
  [ "$found" = 1 ] || echo "MISSING: this Python has no $mod and .gpu_wheels has no $dist wheel"
done 2>&1 | tee "$out/install.txt"
export PYTHONPATH="$PWD:$PWD/.gpu_lib${PYTHONPATH:+:$PYTHONPATH}"
export OLMO_TDA_TESTS_COLD=1

timeout 100 "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/test_store.py tests/test_capture.py 2>&1 \
  | tee "$out/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# shellcheck disable=SC2086  # PEERS_ARGS is a list of flags
timeout 470 "$PY" benchmarks/peers/run.py --here --device "$DEVICE" --systems "$SYSTEMS" \
  $PEERS_ARGS --timeout 200 --out "$out/peers_cuda.json" 2>&1 | tee "$out/peers_cuda.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
date -u | tee -a "$out/machine.txt"
exit $status
