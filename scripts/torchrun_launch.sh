# Sourced by scripts/train/train.sh and scripts/data/cache.sh: start `python -m MODULE ARGS...` as torchrun
# workers. Reads NPROC (empty = one worker per visible GPU, else 1) and TORCHRUN_ARGS (extra torchrun
# arguments; any rendezvous/node argument turns off --standalone, for multi-node runs) and TORCHRUN_MODULE (the
# launcher module, default torch.distributed.run).
torchrun_launch() {
  local module="$1"; shift
  local root python="${PYTHON:-}"
  if [[ -z "$python" ]]; then
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python; fi
  fi
  if [[ -z "$NPROC" ]]; then
    local ngpu
    ngpu=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
    if [[ "$ngpu" -gt 0 ]]; then NPROC="$ngpu"; else NPROC=1; fi
  fi
  # CPU workers share the usable cores (torchrun alone would give each worker one thread); yours wins.
  if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    export OMP_NUM_THREADS=$("$python" -c "from deepspec.train.launcher import cpu_threads_per_worker as f; print(f($NPROC))" 2>/dev/null || echo 1)
  fi
  local standalone=(--standalone) a
  for a in "${TORCHRUN_ARGS[@]+"${TORCHRUN_ARGS[@]}"}"; do
    case "$a" in --nnodes*|--rdzv*|--master*|--node*) standalone=() ;; esac
  done
  exec "$python" -m "${TORCHRUN_MODULE:-torch.distributed.run}" "${standalone[@]+"${standalone[@]}"}" --nproc-per-node="$NPROC" \
    "${TORCHRUN_ARGS[@]+"${TORCHRUN_ARGS[@]}"}" -m "$module" "$@"
}
