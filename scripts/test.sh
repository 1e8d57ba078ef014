#!/usr/bin/env bash
# README command 2: set up (idempotent) and run the whole test suite.
#   bash scripts/test.sh [pytest args...]
#   bash scripts/test.sh --fast [pytest args...]   # the fast tier: every test not marked slow or vllm (minutes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DEEPSPEC_NO_PROGRESS=1
TIER=()
if [ "${1:-}" = "--fast" ]; then
  shift
  TIER=(-m "not slow and not vllm" --timeout=300)
fi
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --timeout=1800 --durations=25 "${TIER[@]}" "$@"
