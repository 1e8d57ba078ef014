#!/usr/bin/env bash
# The data stages of a recipe, in order: prompts -> regenerate -> cache.
#
#   bash scripts/data/prepare_data.sh CONFIG [--opts key=value ...]
#
# Each stage skips work whose artifact is already complete, so rerunning after a crash resumes.
# Set URLS_FILE=path (written by scripts/data/launch_vllm_servers.sh) to regenerate through
# OpenAI-compatible servers instead of the recipe's engine.
set -euo pipefail
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit $(( $# < 1 ? 2 : 0 ))
fi
CONFIG="$1"; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python; fi
fi
REGEN_EXTRA=()
[[ -n "${URLS_FILE:-}" ]] && REGEN_EXTRA=(--urls-file "$URLS_FILE")

set -x
"$PY" -m deepspec.cli data prompts "$CONFIG" "$@"
"$PY" -m deepspec.cli data regenerate "$CONFIG" "${REGEN_EXTRA[@]}" "$@"
"$PY" -m deepspec.cli data cache "$CONFIG" "$@"
