#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels a GPU machine without one needs to run
# benchmarks/peers/gpu_check.sh there: what olmo_tda's capture, store and methods import besides
# torch (numpy, h5py, pyyaml, tqdm), dattri-llm (the headline peer) and dattri, whose parts it imports
# need only torch and numpy (not its declared scipy and pretty_midi: installed without dependencies), and
# pytest for the GPU tests. Never torch: the GPU machine's own CUDA build is what is measured.
#
#   bash benchmarks/peers/gpu_bundle.sh [PYTHON_VERSION]     # default 3.12 (the lent GPU image's)
#
# Writes .gpu_wheels/ (git-ignored, ~25 MB); carry it to the device run: carry=[".gpu_wheels"].
set -euo pipefail
cd "$(dirname "$0")/../.."
py="${1:-3.12}"
rm -rf .gpu_wheels && mkdir .gpu_wheels
pip download --quiet --disable-pip-version-check --dest .gpu_wheels --only-binary=:all: --no-deps \
  --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 \
  "numpy>=1.26,<3" "h5py>=3.11" "pyyaml>=6" "tqdm>=4.66" "dattri-llm==0.1.0" "dattri==0.3.0" \
  "pytest>=8" "pluggy>=1.5" "iniconfig>=2" "packaging>=24"
ls -1 .gpu_wheels
du -sh .gpu_wheels
