#!/usr/bin/env bash
# Install SGLang's Python sources (no dependencies) into a side folder so tests can build SGLang's own
# draft model classes on CPU and load our exports into them, without touching the main environment.
# Usage: bash scripts/sglang_side.sh [DIR]   (default: $DEEPSPEC_SGLANG_SIDE or ~/.cache/deepspec/sglang-<version>)
# Prints the folder; exits non-zero when the package cannot be installed.
set -euo pipefail
VERSION="${DEEPSPEC_SGLANG_VERSION:-0.5.23}"
DIR="${1:-${DEEPSPEC_SGLANG_SIDE:-$HOME/.cache/deepspec/sglang-$VERSION}}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY=python
mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"  # parallel test workers: one installs, the others wait and reuse it
flock 9
if [ ! -f "$DIR/.complete" ]; then
  mkdir -p "$DIR"
  # sglang itself plus the few pure-Python modules its model files import that the main venv lacks
  "$PY" -m pip install -q --no-deps --target "$DIR" "sglang==$VERSION" orjson ipython traitlets >&2
  touch "$DIR/.complete"
fi
echo "$DIR"
