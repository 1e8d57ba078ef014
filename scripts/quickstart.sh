#!/usr/bin/env bash
# README command 1: set up (idempotent), then run the whole pipeline on the embedded
# SmolLM2-135M-Instruct target: prompts -> regenerate (vLLM) -> cache -> train EAGLE-3.1 ->
# eval -> export -> serve in vLLM. A second run reuses every finished stage.
#   bash scripts/quickstart.sh [--opts key=value ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS=0
bash "$ROOT/scripts/setup.sh"
echo "[quickstart] set-up took ${SECONDS}s"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# EAGLE-3.1 by default. For the three-algorithm comparison on the same data (about twice as long):
#   DEEPSPEC_QUICKSTART_CONFIGS="config/quickstart/eagle3.yaml config/quickstart/dflash.yaml config/quickstart/dspark.yaml"
exec "$ROOT/.venv/bin/deepspec" run ${DEEPSPEC_QUICKSTART_CONFIGS:-config/quickstart/eagle3.yaml} "$@"
