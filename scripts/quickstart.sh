#!/usr/bin/env bash
# README command 1: set up (idempotent), then run the whole pipeline on the embedded
# SmolLM2-135M-Instruct target: blended prompts -> regenerate (vLLM) -> cache -> train EAGLE-3.1 ->
# eval on held-out splits unlike the training data -> export -> serve in vLLM. A second run reuses
# every finished stage.
#   bash scripts/quickstart.sh [--opts key=value ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS=0
bash "$ROOT/scripts/setup.sh"
echo "[quickstart] set-up took ${SECONDS}s"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# EAGLE-3.1 on a blend (config/quickstart/eagle3_blend.yaml) by default. The earlier single-pool recipes, and the
# three-algorithm comparison on their data (about twice as long):
#   DEEPSPEC_QUICKSTART_CONFIGS="config/quickstart/eagle3.yaml config/quickstart/dflash.yaml config/quickstart/dspark.yaml"
SIZE=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } \
   && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
  # Without native bf16 every stage runs in fp32 (bf16_if_native), ~2-2.5x slower: half the prompts keep
  # the run within the 30-minute budget (docs/benchmarks.md, "Which CPU"). Your own --opts come after and win.
  echo "[quickstart] no AVX512-BF16/AMX on this CPU: fp32 throughout, 212 prompts instead of 424"
  SIZE=(--opts data.prompts.max_samples=212)
fi
exec "$ROOT/.venv/bin/deepspec" run ${DEEPSPEC_QUICKSTART_CONFIGS:-config/quickstart/eagle3_blend.yaml} "${SIZE[@]}" "$@"
