#!/usr/bin/env bash
# README command 2: set up (idempotent) and run the whole test suite.
#   bash scripts/test.sh [pytest args...]
#   bash scripts/test.sh --fast [pytest args...]   # the fast tier: every test not marked slow or vllm (minutes)
# Tests run in DEEPSPEC_TEST_WORKERS processes (default 2; 1 = in this process), a whole module per process so its
# module-scoped set-up (a trained draft, a vLLM server) is made once; much of the suite is one-threaded work (process
# start-up, imports, Python) that a second process runs on the other core. Each process keeps to its own share of the
# cores (tests/conftest.py `pin_worker_cores`; DEEPSPEC_TEST_PIN=0 to let them share every core).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A new venv is not byte-compiled up front (~25k modules, 23 s of both cores): the suite's processes compile what they
# import (~a quarter of them) and write each .pyc once, for every later process, PYTHONDONTWRITEBYTECODE or not.
DEEPSPEC_SETUP_COMPILE=0 bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DEEPSPEC_NO_PROGRESS=1
TIER=()
if [ "${1:-}" = "--fast" ]; then
  shift
  TIER=(-m "not slow and not vllm" --timeout=300)
fi
WORKERS="${DEEPSPEC_TEST_WORKERS:-2}"
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)  # our module order (tests/conftest.py), not by size
fi
exec "$ROOT/.venv/bin/python" -m pytest -q -ra --timeout=1800 --durations=40 "${PARALLEL[@]}" "${TIER[@]}" "$@"
