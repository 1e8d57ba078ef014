#!/usr/bin/env bash
# Run every benchmark and write benchmarks/results/<date>.json + .md.
#   bash benchmarks/run_all.sh [--checkpoint CKPT] [--only cache train ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" benchmarks/run_all.py "$@"
