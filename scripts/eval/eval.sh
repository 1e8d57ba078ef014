#!/usr/bin/env bash
# Speculative decoding of a draft checkpoint on the benchmarks in eval_datasets/.
#
#   bash scripts/eval/eval.sh CKPT [--tasks gsm8k mt-bench ...] [--max-samples N] [--temperature T]
#        [--nproc N] [--target NAME_OR_DIR] [--engine vllm] [--run-dir RUN] [--opts key=value ...]
#
# The target is the one in the checkpoint's provenance unless --target / --opts target.name=... says
# otherwise. Workers: one per visible GPU, or --nproc N CPU workers (default 1); samples are strided
# over workers and their counters merged. Writes <CKPT>/eval/{results.json,results.md,acceptance.png}
# (or --output-dir). --engine vllm also serves the exported draft in vLLM and reports its tau beside ours.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
exec "$PYTHON" -m deepspec.cli eval "$@"
