#!/usr/bin/env bash
# Single-node OLMo training with gradient capture.
#
#   launch/local.sh CONFIG [NPROC] [--key=value ...]
#
# NPROC = 1 (the default) runs plain `python -m olmo_tda.cli train CONFIG ...`: no rendezvous, and
# breakpoint()/pdb work (the trainer forms a process group of one by itself). NPROC > 1 runs
# `torchrun --standalone --nproc_per_node=NPROC -m olmo_tda.cli train CONFIG ...` (standalone picks a
# free port, so several runs can share a machine). The trainer picks gloo on CPU and nccl on GPU.
#
# Environment:
#   OMP_NUM_THREADS  default: this machine's CPUs (nproc) / NPROC, at least 1
#   WANDB_MODE       offline unless you set it
#   PYTHON, TORCHRUN the executables (default: python and torchrun on PATH)
#   MAX_RESTARTS     torchrun --max_restarts with NPROC > 1 (default 0); with it torchrun's store is not
#                    shared with the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see docs/LAUNCH.md)
#   DRY_RUN          1 = print the exact environment and command and exit 0; 0 or unset = run
# See docs/LAUNCH.md.

set -euo pipefail

readonly prog=local.sh

# shellcheck source=_local_args.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/_local_args.sh"
shift

# A second argument that is all digits is NPROC; anything else (an override) leaves NPROC at 1.
num_procs=1
if [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]]; then
    [[ "$1" =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive number, got '$1'"
    num_procs="$1"
    shift
fi

# torchrun would force 1 thread per worker (starving a CPU run); share the machine's CPUs instead.
cpus="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cpus / num_procs > 0 ? cpus / num_procs : 1))}"
# No network account is assumed; sync later with `wandb sync`.
export WANDB_MODE="${WANDB_MODE:-offline}"
managed_env=(OMP_NUM_THREADS WANDB_MODE)
max_restarts="${MAX_RESTARTS:-0}"
[[ "$max_restarts" =~ ^(0|[1-9][0-9]*)$ ]] || die "MAX_RESTARTS=$max_restarts is not a number of restarts (0 or more)"
((max_restarts == 0 || num_procs > 1)) \
    || die "MAX_RESTARTS=$max_restarts needs NPROC > 1 (one process runs without torchrun)"

if ((num_procs == 1)); then
    cmd=("${PYTHON:-python}" -m olmo_tda.cli train "$config" "$@")
else
    if ((max_restarts > 0)); then
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        managed_env+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE)
    fi
    cmd=("${TORCHRUN:-torchrun}" --standalone --nnodes=1 --nproc_per_node="$num_procs"
        --max_restarts="$max_restarts" -m olmo_tda.cli train "$config" "$@")
fi

print_and_run "${cmd[@]}"
