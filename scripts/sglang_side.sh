#!/usr/bin/env bash
# Install SGLang's Python sources (no dependencies) into a side folder so tests can build SGLang's own
# draft model classes on CPU and load our exports into them, without touching the main environment.
# Usage: bash scripts/sglang_side.sh [DIR]   (default: $DEEPSPEC_SGLANG_SIDE or ~/.cache/deepspec/sglang-<version>-py<3X>)
# Prints the folder; exits non-zero when the package cannot be installed.
set -euo pipefail
VERSION="${DEEPSPEC_SGLANG_VERSION:-0.5.23}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PY" ] || PY=python
source "$(dirname "$0")/_side_install.sh"
DIR="${1:-${DEEPSPEC_SGLANG_SIDE:-$HOME/.cache/deepspec/sglang-$VERSION-$(py_tag "$PY")}}"
# sglang itself plus the few pure-Python modules its model files import that the main venv lacks
side_install "$DIR" "$PY" "sglang==$VERSION" orjson ipython traitlets
echo "$DIR"
