#!/usr/bin/env bash
# Install the published DFlash reference code (the `dflash` package: DFlashDraftModel, what the public DFlash
# checkpoints load with trust_remote_code) into a side folder, without its dependencies, so tests can load our DFlash
# exports with it under the main environment's torch and transformers without touching that environment.
# Usage: bash scripts/dflash_side.sh [DIR] [--transformers VERSION]
#   DIR default: $DEEPSPEC_DFLASH_SIDE or ~/.cache/deepspec/dflash-<version>-py<3X> (per Python: compiled packages)
#   --transformers VERSION: also install that transformers release (the one the package pins: 5.15.0 for 0.1.0) into
#   DIR/transformers-VERSION (with tokenizers / huggingface-hub releases 5.15 accepts), for a separate interpreter to
#   put first on PYTHONPATH.
# Prints the folder (and the transformers folder on a second line); exits non-zero when an install fails.
set -euo pipefail
VERSION="${DEEPSPEC_DFLASH_VERSION:-0.1.0}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY=python
source "$(dirname "$0")/_side_install.sh"
DIR="${DEEPSPEC_DFLASH_SIDE:-$HOME/.cache/deepspec/dflash-$VERSION-$(py_tag "$PY")}"
TF=""
while [ $# -gt 0 ]; do
  case "$1" in
    --transformers) TF="$2"; shift 2 ;;
    *) DIR="$1"; shift ;;
  esac
done
side_install "$DIR" "$PY" "dflash==$VERSION"
echo "$DIR"
if [ -n "$TF" ]; then
  # with the tokenizers and huggingface-hub ranges that release accepts (both older than the main environment's)
  side_install "$DIR/transformers-$TF" "$PY" "transformers==$TF" "tokenizers>=0.22,<0.23" "huggingface-hub>=1.5,<2"
  echo "$DIR/transformers-$TF"
fi
