#!/usr/bin/env bash
# Build the target cache on every visible GPU (or N CPU workers) with torchrun: each rank captures its
# share of the shards; the result is byte for byte the cache one worker writes.
#
#   bash scripts/data/cache.sh CONFIG [--nproc N] [torchrun args] [--split S] [--overwrite] [--opts key=value ...]
#
# Workers: one per GPU in CUDA_VISIBLE_DEVICES (or all GPUs); without a GPU, --nproc N CPU workers (default 1).
# Multi-node: add torchrun's rendezvous arguments, the same on every node, with cache.dir on a shared filesystem:
#   --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id mycache
# Rerunning the same command resumes: finished shards are kept.
# A target spread over the node's GPUs (target.device_map: auto) needs ONE process: --nproc 1.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
CONFIG="$1"; shift
NPROC=""
TORCHRUN_ARGS=()
CACHE_ARGS=()
OPTS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc|--nproc-per-node|--nproc_per_node) NPROC="$2"; shift 2 ;;
    --nproc=*|--nproc-per-node=*) NPROC="${1#*=}"; shift ;;
    --split) CACHE_ARGS+=("$1" "$2"); shift 2 ;;
    --split=*|--overwrite) CACHE_ARGS+=("$1"); shift ;;
    --opts) shift; while [[ $# -gt 0 && "$1" != --* ]]; do OPTS+=("$1"); shift; done ;;
    --*=*) TORCHRUN_ARGS+=("$1"); shift ;;
    --*) TORCHRUN_ARGS+=("$1" "$2"); shift 2 ;;
    *) echo "cache.sh: unexpected argument '$1' (config must come first; overrides go after --opts)" >&2; exit 2 ;;
  esac
done

source "$(dirname "${BASH_SOURCE[0]}")/../torchrun_launch.sh"
torchrun_launch deepspec.data.cache.worker "$CONFIG" ${CACHE_ARGS[@]+"${CACHE_ARGS[@]}"} ${OPTS[@]+--opts "${OPTS[@]}"}
