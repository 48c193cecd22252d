#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels the lent GPU machine lacks for
# benchmarks/peers/gpu_check.sh: dattri-llm (the headline peer) and dattri, whose parts it imports
# need only torch and numpy (installed without their declared dependencies: dattri's scipy and
# pretty_midi are not imported on this path); Kronfluence and its einconv (the rest of its needs,
# accelerate, einops, opt-einsum, safetensors, are in the image; its declared torchvision is never
# imported); TRAK; LogIX. All pure Python. The GPU image already holds torch (its CUDA build: what is
# measured), numpy, h5py, pyyaml, tqdm and pytest (/work/.library/device/KINDS.md); gpu_check.sh says
# which module is missing if that changes.
#
#   bash benchmarks/peers/gpu_bundle.sh          # -> .gpu_wheels/ (git-ignored, ~0.9 MB)
#
# Carry it to the device run: carry=[".gpu_wheels"].
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu_wheels && mkdir .gpu_wheels
pip download --quiet --disable-pip-version-check --dest .gpu_wheels --only-binary=:all: --no-deps \
  "dattri-llm==0.1.0" "dattri==0.3.0" "kronfluence==1.0.1" "einconv==0.1.0"
# logix-ai 0.1.1 declares Python < 3.11 (it runs on 3.11 here; the GPU machine's is 3.12)
pip download --quiet --disable-pip-version-check --dest .gpu_wheels --only-binary=:all: --no-deps \
  --ignore-requires-python "logix-ai==0.1.1"
# traker 0.3.2 is an sdist only: built here into a pure-Python wheel (its fast_jl CUDA extension is a
# separate package, not used: the benchmark gives TRAK its BasicProjector)
pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir .gpu_wheels "traker==0.3.2"
ls -1 .gpu_wheels
du -sh .gpu_wheels
