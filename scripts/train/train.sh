#!/usr/bin/env bash
# Train a draft on every visible GPU (or N CPU workers) with torchrun.
#
#   bash scripts/train/train.sh CONFIG [--nproc N] [torchrun args] [--opts key=value ...]
#
# Workers: one per GPU in CUDA_VISIBLE_DEVICES (or all GPUs); on a machine without GPU,
# --nproc N CPU workers (default 1). NCCL on GPU, gloo on CPU.
# Multi-node: add torchrun's rendezvous arguments, the same on every node, e.g.
#   --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id myrun
# Rerunning the same command resumes from <train.output_root>/<project>/<run.name>/step_latest.
# SIGTERM / SIGUSR1 (Slurm preemption or --signal, Kubernetes termination): the workers finish the current step,
# checkpoint it and exit with status 143 / 138; rerun to resume from that step. DEEPSPEC_PREEMPT_GRACE_S (default
# 120) is how long torchrun waits for them before killing them (docs/reliability.md).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
CONFIG="$1"; shift
NPROC=""
TORCHRUN_ARGS=()
OPTS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc|--nproc-per-node|--nproc_per_node) NPROC="$2"; shift 2 ;;
    --nproc=*|--nproc-per-node=*) NPROC="${1#*=}"; shift ;;
    --opts) shift; while [[ $# -gt 0 && "$1" != --* ]]; do OPTS+=("$1"); shift; done ;;
    --*=*) TORCHRUN_ARGS+=("$1"); shift ;;
    --*) TORCHRUN_ARGS+=("$1" "$2"); shift 2 ;;
    *) echo "train.sh: unexpected argument '$1' (config must come first; overrides go after --opts)" >&2; exit 2 ;;
  esac
done

source "$(dirname "${BASH_SOURCE[0]}")/../torchrun_launch.sh"
# torchrun through deepspec's wrapper: signals reach every worker, a grace period, one line instead of a traceback
TORCHRUN_MODULE=deepspec.train.launcher
torchrun_launch deepspec.train.worker "$CONFIG" ${OPTS[@]+--opts "${OPTS[@]}"}
