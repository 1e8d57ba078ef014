#!/usr/bin/env bash
# Create (or reuse) the separate virtual environment that runs the peer trainer
# (`speculators` 0.9.0) for benchmarks/bench_train.py and bench_gpu.py. It must not share
# deepspec's venv: speculators caps transformers and pulls its own torch extras.
# Idempotent: a second run with the venv complete returns at once.
#   bash benchmarks/peer_setup.sh                 # -> .peer-venv
#   PEER_VENV=/path bash benchmarks/peer_setup.sh
#   bash benchmarks/peer_setup.sh --gpu-wheels [DIR]   # -> .peer-wheels: the peer's wheels (and Liger's) for an offline GPU
#       machine whose python 3.12 already has torch / transformers / numpy / pyarrow / pandas (install them there with
#       `pip install --no-index --no-deps --target /tmp/peer-site DIR/*.whl` and put /tmp/peer-site on the peer's
#       PYTHONPATH; benchmarks/bench_gpu.py --peer-wheels DIR does that)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# The peer's own packages and those its imports need beyond a CUDA PyTorch image (pinned: the versions checked on CPU).
GPU_WHEELS=(speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4
  pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0 idna==3.20 h11==0.16.0)
# And ours: Liger-Kernel (requirements-gpu.txt, pinned in constraints.txt), which EAGLE-3's loss uses on CUDA and which a
# CUDA PyTorch image lacks; gpu_check.sh installs it for our rows (not the peer's) from the same folder.
OUR_GPU_WHEELS=(liger-kernel==0.8.5)
if [ "${1:-}" = --gpu-wheels ]; then
  DEST="${2:-$ROOT/.peer-wheels}"
  mkdir -p "$DEST"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "${GPU_WHEELS[@]}" "${OUR_GPU_WHEELS[@]}"
  echo "[peer_setup] $(ls "$DEST" | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
  exit 0
fi
VENV="${PEER_VENV:-$ROOT/.peer-venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TORCH="${PEER_TORCH:-torch==2.13.0}"
PKG="speculators==0.9.0"
STAMP="$VENV/.peer-setup"
WANT="$TORCH $PKG"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[peer_setup] reusing $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# Pin torch first and keep it pinned: speculators' extras would otherwise swap the build.
$PIP install -q "$TORCH"
echo "$TORCH" > "$VENV/constraints.txt"
$PIP install -q -c "$VENV/constraints.txt" "$PKG"
# With torch pinned, pip settles on torchvision/torchaudio wheels built for another torch; they fail to
# import (transformers then cannot load) and the trainer does not need them.
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import importlib.metadata as m, torch, speculators.train.trainer; print('[peer_setup] speculators', m.version('speculators'), 'torch', torch.__version__)"
echo "$WANT" > "$STAMP"
