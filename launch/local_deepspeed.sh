#!/usr/bin/env bash
# Single-node DeepSpeed pretraining with gradient capture.
#
#   launch/local_deepspeed.sh CONFIG [NPROC] [--key=value ...]     (CONFIG e.g. configs/deepspeed_tiny.yaml)
#
# Runs the example trainer `examples/deepspeed_pretrain.py CONFIG ...` (of this checkout) in NPROC
# processes, which read RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment. With GPUs
# (nvidia-smi on PATH and torch sees CUDA): `deepspeed --num_gpus=NPROC --no_local_rank SCRIPT ...`, NPROC
# defaulting to every visible GPU. Without: `python -m torch.distributed.run --standalone
# --nproc_per_node=NPROC SCRIPT ...`, NPROC defaulting to 1 (DeepSpeed's launcher counts NUMA nodes as CPU "devices" and always uses
# port 29500; torchrun's standalone mode picks a free port). The script picks gloo on CPU, nccl on GPU.
#
# Environment:
#   LAUNCHER         deepspeed or torchrun (default: deepspeed with GPUs, torchrun without)
#   MASTER_PORT      the deepspeed launcher's port (default: its own, 29500; set it to run two at once)
#   OMP_NUM_THREADS  default: this machine's CPUs (nproc) / NPROC, at least 1
#   WANDB_MODE       offline unless you set it
#   PYTHON, DEEPSPEED  the executables (default: python and deepspeed on PATH)
#   DRY_RUN          1 = print the exact environment and command and exit 0; 0 or unset = run
# See docs/LAUNCH.md.

set -euo pipefail

readonly prog=local_deepspeed.sh
example="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/examples/deepspeed_pretrain.py"
readonly example

# shellcheck source=_local_args.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/_local_args.sh"
shift

# A second argument that is all digits is NPROC; anything else (an override) leaves the default.
num_procs=
if [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]]; then
    [[ "$1" =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive number, got '$1'"
    num_procs="$1"
    shift
fi

python="${PYTHON:-python}"
# GPUs that torch can use (it honours CUDA_VISIBLE_DEVICES). Without nvidia-smi there is no NVIDIA
# driver, and asking torch would only cost its import time.
num_gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    num_gpus="$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)" || num_gpus=0
    [[ "$num_gpus" =~ ^[0-9]+$ ]] || num_gpus=0
fi

if ((num_gpus > 0)); then
    launcher="${LAUNCHER:-deepspeed}"
else
    launcher="${LAUNCHER:-torchrun}"
fi
case "$launcher" in
    deepspeed | torchrun) ;;
    *) die "LAUNCHER must be deepspeed or torchrun, got '$launcher'" ;;
esac

if ((num_gpus > 0)); then
    num_procs="${num_procs:-$num_gpus}"
    ((num_procs <= num_gpus)) || die "NPROC=$num_procs but torch sees $num_gpus GPU(s)"
else
    num_procs="${num_procs:-1}"
fi

# Neither launcher shares the CPUs out (deepspeed sets no thread count, torchrun forces 1 per
# worker, which starves a CPU run); give each process its share.
cpus="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cpus / num_procs > 0 ? cpus / num_procs : 1))}"
# No network account is assumed; sync later with `wandb sync`.
export WANDB_MODE="${WANDB_MODE:-offline}"
managed_env=(OMP_NUM_THREADS WANDB_MODE)

if [[ "$launcher" == deepspeed ]]; then
    cmd=("${DEEPSPEED:-deepspeed}")
    # With --num_gpus deepspeed ignores CUDA_VISIBLE_DEVICES and uses GPUs 0..N-1, so a restriction
    # the user set is passed on explicitly as --include (it takes indices only, not GPU UUIDs).
    if ((num_gpus > 0)) && [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        [[ "$CUDA_VISIBLE_DEVICES" =~ ^[0-9]+(,[0-9]+)*$ ]] \
            || die "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: the deepspeed launcher takes GPU indices (e.g. 2,3); use indices or unset it"
        IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
        devices="${visible[*]:0:num_procs}"
        cmd+=(--include="localhost:${devices// /,}")
    else
        cmd+=(--num_gpus="$num_procs")
    fi
    if [[ -n "${MASTER_PORT:-}" ]]; then
        cmd+=(--master_port="$MASTER_PORT")
    fi
    cmd+=(--no_local_rank "$example" "$config" "$@")
else
    cmd=("$python" -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node="$num_procs"
        "$example" "$config" "$@")
fi

print_and_run "${cmd[@]}"
