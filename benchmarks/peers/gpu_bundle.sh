#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the lent GPU machine lacks for
# benchmarks/peers/gpu_check.sh: dattri-llm (the headline peer) and dattri, whose parts it imports
# need only torch and numpy (installed without their declared dependencies: dattri's scipy and
# pretty_midi are not imported on this path). Both are pure Python. The GPU image already holds
# torch (its CUDA build: what is measured), numpy, h5py, pyyaml, tqdm and pytest
# (/work/.library/device/KINDS.md); gpu_check.sh says which module is missing if that changes.
#
#   bash benchmarks/peers/gpu_bundle.sh          # -> .gpu_wheels/ (git-ignored, ~0.6 MB)
#
# Carry it to the device run: carry=[".gpu_wheels"].
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu_wheels && mkdir .gpu_wheels
pip download --quiet --disable-pip-version-check --dest .gpu_wheels --only-binary=:all: --no-deps \
  "dattri-llm==0.1.0" "dattri==0.3.0"
ls -1 .gpu_wheels
du -sh .gpu_wheels
