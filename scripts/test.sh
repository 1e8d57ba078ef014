#!/usr/bin/env bash
# README command 2: set up (idempotent) and run the whole test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DEEPSPEC_NO_PROGRESS=1
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --timeout=1800 --durations=25 "$@"
