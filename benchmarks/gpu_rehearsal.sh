#!/usr/bin/env bash
# The GPU check rehearsed on this machine's CPU with the GPU machine's Python packages, before its time is spent:
#
#   bash benchmarks/gpu_rehearsal.sh OUT_DIR [gpu_check.sh options, e.g. --rows env,peer]
#
# The GPU machines this project borrows run Python 3.12 with torch 2.11 and transformers 5.17 preinstalled and nothing
# else of ours (docs/training.md, "On a GPU machine"); .venv has newer ones. Code that passes the tests here can still
# fail there on an API the older versions lack, and a GPU session is short and rare. This script makes
# .gpu-image-venv once (Python 3.12 and the image's versions of the packages our rows import; torch's CUDA wheel, which
# imports on a CPU: about 3.6 GB) and runs `gpu_check.sh OUT_DIR --smoke` with its interpreter and the carried wheels
# (.peer-wheels, made by `bash benchmarks/peer_setup.sh --gpu-wheels` when missing): every row's code path, the peer's
# included, under the versions the GPU machine has. It prints gpu_check's summary line and exits 1 when a row failed.
# PYTHON312 names the interpreter to build the venv from (default: python3.12 on PATH).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: bash benchmarks/gpu_rehearsal.sh OUT_DIR [gpu_check.sh options]" >&2; exit 2; }
OUT="$1"; shift
VENV="${GPU_IMAGE_VENV:-$ROOT/.gpu-image-venv}"
# The GPU image's versions (as its pip list read, 2026-11): the ones our rows and the peer import
PINS=(torch==2.11.0 transformers==5.17.0 numpy==2.5.2 safetensors==0.8.0 huggingface_hub==1.33.0)
# also in the image, at versions this script does not pin: what the tests, the loader and the peer's imports need
MORE=(pyarrow pandas pytest pytest-xdist pyyaml xxhash fsspec requests tqdm psutil rich typer jinja2 tensorboard)
STAMP="$VENV/.gpu-image"
WANT="${PINS[*]} ${MORE[*]}"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  PY="${PYTHON312:-python3.12}"
  if ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" >/dev/null 2>&1; then
    echo "gpu_rehearsal.sh: $PY is not a working Python 3.12 (the GPU machine's); set PYTHON312 to one" >&2
    exit 2
  fi
  echo "[gpu_rehearsal] making $VENV (torch 2.11, transformers 5.17; a few minutes, about 3.6 GB)"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "${PINS[@]}" "${MORE[@]}"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" -c "import torch, transformers, sys
print('[gpu_rehearsal] python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"

WHEELS="$ROOT/.peer-wheels"
ls "$WHEELS"/speculators-*.whl >/dev/null 2>&1 || bash "$ROOT/benchmarks/peer_setup.sh" --gpu-wheels "$WHEELS"

# .venv's packages must not leak in: the rows run from the source tree with the image's interpreter alone
env -u VIRTUAL_ENV PATH="$VENV/bin:$PATH" PYTHON="$VENV/bin/python" \
  bash "$ROOT/benchmarks/gpu_check.sh" "$OUT" --smoke --peer-wheels "$WHEELS" "$@"
# gpu_check's last line is this run's summary (an OUT_DIR reused keeps earlier runs' lines above it)
"$VENV/bin/python" - "$OUT/rows.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
status = rows[-1]["status"]
lines = {r["row"]: r for r in rows[:-1] if r.get("benchmark") == "gpu_check" and "status" in r}  # each row's latest
bad = [name for name, st in status.items() if st in ("error", "timeout")]
for name in bad:
    print(f"[gpu_rehearsal] row {name}: {status[name]}: {str(lines[name].get('error', ''))[:400]}")
if bad:
    print(f"[gpu_rehearsal] {len(bad)} row(s) failed under the GPU image's versions")
else:
    print("[gpu_rehearsal] every row ran under the GPU image's versions")
sys.exit(1 if bad else 0)
EOF
