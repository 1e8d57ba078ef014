# Sourced by the *_side.sh scripts: install packages without their dependencies into a side folder, once.
# py_tag PYTHON: "py311" for a Python 3.11. The default side folders carry it: some packages in them are compiled for
# one Python (orjson, tokenizers), so two interpreters sharing ~/.cache must not share a folder.
py_tag() {
  "$1" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")'
}
# side_install DIR PYTHON PIP_ARGS...: parallel callers (test workers) take a lock beside DIR; the first installs, the
# others wait and reuse the folder; a folder is only reused once an install into it completed (DIR/.complete).
side_install() {
  local dir="$1" py="$2"
  shift 2
  mkdir -p "$(dirname "$dir")"
  exec 9>"$dir.lock"
  flock 9
  if [ ! -f "$dir/.complete" ]; then
    mkdir -p "$dir"
    "$py" -m pip install -q --no-deps --target "$dir" "$@" >&2
    touch "$dir/.complete"
  fi
  exec 9>&-
}
