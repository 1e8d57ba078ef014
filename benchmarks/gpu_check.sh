#!/usr/bin/env bash
# Everything a GPU machine should measure, in one command, under 9 minutes:
#
#   bash benchmarks/gpu_check.sh OUT_DIR [--smoke] [--peer-wheels DIR] [--budget-s S] [--rows NAME,NAME...]
#
# It runs the project from this source tree (PYTHONPATH; nothing is installed but the wheels --peer-wheels gives: the
# peer's, for its row, and Liger-Kernel's, which our rows use as a GPU user's requirements-gpu.txt install does) with
# the machine's own python (PYTHON, default python3: torch and transformers must be there). In priority order, each row
# under its own time limit and all of them under the budget (515 s; a row that would start past it writes a "skipped"
# line):
#   env        the environment: torch, CUDA, device, NCCL, Liger-Kernel
#   tests      the CUDA-only tests (the TTT chain's flash merge, attention kernels, online cache, loader stager,
#              precision); --smoke collects them. Where the chain's merge through the CUDA flash kernel's log-sum-exp
#              fails its test, every later row runs with DEEPSPEC_CHAIN_SENTINEL=1 (a note line in rows.jsonl says so)
#   ours       Qwen3-8B-shaped EAGLE-3, DFlash and DSpark at 4,096 tokens, 8 micro-batches per optimizer step, from memory
#   liger-off  EAGLE-3 as in `ours` with DEEPSPEC_LIGER=0: what Liger's fused loss gains, by its rate (needs Liger-Kernel;
#              CUDA only: --smoke skips it; no profile table, so OUT_DIR keeps to 8 files)
#   sentinel   EAGLE-3 as in `ours` with DEEPSPEC_CHAIN_SENTINEL=1: what merging TTT steps 1-6 through the flash
#              kernel's log-sum-exp gains over the sentinel call (skipped where the rows take the sentinel call already)
#   cache      DFlash the same way, read from an on-disk cache through the trainer's reader and loader
#   peer       EAGLE-3, ours and speculators 0.9.0 on the same samples, one sample per step (needs --peer-wheels DIR, made
#              by `bash benchmarks/peer_setup.sh --gpu-wheels`, or a .peer-venv; else skipped)
#   v4-memory  one training step of config/dflash/deepseek-v4-flash.yaml at its real size: its measured peak memory
#   long       one 32,768-token EAGLE-3 sample per step with activation checkpointing
#   flex       DFlash and DSpark as in `ours` with train.attention=flex (one FlexAttention call per layer; CUDA only:
#              --smoke skips it)
#   eager      DFlash and DSpark as in `ours` with train.compile=false: what compiling the draft layers gains (CUDA only:
#              on a CPU `ours` is already eager, so --smoke skips it)
#   mixed-sdpa DFlash on samples of 512 to 4,096 tokens (16 distinct lengths: users' data, many attention shapes), SDPA
#   mixed-flex the same with train.attention=flex (one compiled kernel per context bucket; CUDA only: --smoke skips it)
#   recipe-batch DFlash, then DSpark, at the Qwen3-8B recipes' batch per GPU with the default attention (what a user's
#              run gets: train.attention=auto, FlexAttention on CUDA for these packed rows, SDPA on a CPU): 16
#              micro-batches of 4 samples packed into rows of 8,192 tokens, so Muon's update is spread over 64 samples
#              as in training; each algorithm at most 240 s, DFlash's line written first
#   recipe-sdpa DFlash the same way with train.attention=sdpa, the chunked calls (CUDA only: on a CPU recipe-batch
#              runs them already, so --smoke skips it)
# --rows runs only the rows named (comma-separated, e.g. --rows ours,flex to rerun two); the others write a "skipped"
# line, so rows.jsonl still lists every row in order.
# Every row runs in a process group of its own (benchmarks/_procs.py): past its limit its whole process tree is killed,
# and a row that fails or hangs writes an error line while the next row runs. OUT_DIR receives, as each row finishes:
#   rows.jsonl   the environment, every measured row, one status line per row (benchmark "gpu_check")
#   log.txt      every row's stdout and stderr
#   log.txt      also the tests' output
#   profile_<algorithm>_<reader>_<seq_len>[_flex].txt   torch.profiler's table of each row's profiled step (6 files)
# --smoke runs the same rows on the CPU on a tiny shape (tests/test_gpu_check.py runs it).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { echo "usage: bash benchmarks/gpu_check.sh OUT_DIR [--smoke] [--peer-wheels DIR] [--budget-s SECONDS] [--rows NAME,NAME...]" >&2; exit 2; }
ALL_ROWS="env tests ours liger-off sentinel cache peer v4-memory long flex eager mixed-sdpa mixed-flex recipe-batch recipe-sdpa"
[ $# -ge 1 ] || usage
OUT="$1"; shift
case "$OUT" in -*) usage ;; esac
SMOKE=0; WHEELS=""; BUDGET=""; ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --peer-wheels) [ $# -ge 2 ] || usage; WHEELS="$2"; shift ;;
    --budget-s) [ $# -ge 2 ] || usage; BUDGET="$2"; shift ;;
    --rows) [ $# -ge 2 ] || usage; ONLY="${2//,/ }"; shift ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
  esac
  shift
done
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "gpu_check.sh: --peer-wheels $WHEELS holds no .whl files (make them with: bash benchmarks/peer_setup.sh --gpu-wheels)" >&2
  exit 2
fi
for name in $ONLY; do
  case " $ALL_ROWS " in *" $name "*) ;; *) echo "gpu_check.sh: --rows names an unknown row '$name'; the rows are: $ALL_ROWS" >&2; exit 2 ;; esac
done
PY="${PYTHON:-python3}"
# found, not imported (importing both costs ~3.5 s): the env row imports them and reports a broken install
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('transformers')))" >/dev/null 2>&1; then
  echo "gpu_check.sh: $PY has no torch or no transformers; set PYTHON to an interpreter that has both" >&2
  exit 2
fi

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")"
[ "${GPU_CHECK_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
  DEEPSPEC_NO_PROGRESS=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ROWS="$OUT/rows.jsonl"; LOG="$OUT/log.txt"
BENCH="$ROOT/benchmarks"

if [ "$SMOKE" = 1 ]; then
  # generous limits: a busy 2-core CI machine takes minutes for what an idle GPU machine's CPUs do in one or two
  BUDGET="${BUDGET:-600}"
  # the tiny shape, 64-token samples (512 for the long row), 2 micro-batches per step
  TRAIN=(--smoke --accum 2); LONG=(--smoke --seq-len 512); ROW_S=150
  TESTS=(--collect-only -q)  # on a CPU the CUDA tests would only skip: collect them (the selection must exist)
  V4=(--smoke)
  L_ENV=60; L_TESTS=90; L_OURS=300; L_LIGER=0; L_SENT=150; L_CACHE=150; L_PEER=150; L_V4=120; L_LONG=150; L_FLEX=0; L_EAGER=0; L_MIXED=150
  MIXED=(--smoke --accum 2 --steps 3 --length-spread 24 --distinct-samples 6)
  RECIPE=(--smoke --accum 2 --micro-batch 2 --steps 3); L_RECIPE=150; R_RECIPE=150; L_RSDPA=0
else
  BUDGET="${BUDGET:-515}"  # + the last row's kill grace (10 s) and the summary: under 9 minutes
  TRAIN=(--shape qwen3-8b --seq-len 4096 --accum 8 --steps 5); LONG=(--shape qwen3-8b --seq-len 32768); ROW_S=150
  TESTS=(-q)
  V4=()
  L_ENV=60; L_TESTS=90; L_OURS=400; L_LIGER=120; L_SENT=120; L_CACHE=130; L_PEER=220; L_V4=120; L_LONG=120; L_FLEX=300; L_EAGER=150; L_MIXED=200
  MIXED=(--shape qwen3-8b --seq-len 4096 --accum 8 --steps 5 --length-spread 512 --distinct-samples 16)
  RECIPE=(--shape qwen3-8b --seq-len 4096 --accum 16 --micro-batch 4 --steps 4); L_RECIPE=400; R_RECIPE=240; L_RSDPA=300
fi
# The training rows' random target stub (Qwen3-8B's embedding and LM head: 2.5 GB, tens of seconds to make) is kept
# where the next gpu_check on this machine finds it (GPU_CHECK_STUBS); the tiny --smoke one goes with the work folder.
STUBS="$WORK/stubs"
[ "$SMOKE" = 1 ] || STUBS="${GPU_CHECK_STUBS:-${TMPDIR:-/tmp}/deepspec-gpu-check-stubs}"
TRAIN+=(--stub-dir "$STUBS"); LONG+=(--stub-dir "$STUBS"); MIXED+=(--stub-dir "$STUBS"); RECIPE+=(--stub-dir "$STUBS")
START=$SECONDS
ROWS_BEFORE=0  # an OUT_DIR reused (a rerun of some --rows) keeps its lines; the summary reads this run's
[ -f "$ROWS" ] && ROWS_BEFORE=$(wc -l < "$ROWS")

# row NAME LIMIT [--log FILE] -- COMMAND...: COMMAND under min(LIMIT, what is left of the budget)
row() {
  local name="$1" limit="$2"; shift 2
  if ! selected "${name%-install}"; then skip "$name" "not selected (--rows $ONLY)"; return; fi
  local log="$LOG"
  if [ "$1" = --log ]; then log="$2"; shift 2; fi
  local left=$(( BUDGET - (SECONDS - START) ))
  [ "$left" -lt "$limit" ] && limit="$left"
  "$PY" "$BENCH/_procs.py" --name "$name" --limit "$limit" --jsonl "$ROWS" --log "$log" "$@"
}
# cuda_row NAME WHY LIMIT -- COMMAND...: a row whose point exists only on CUDA; --smoke writes a skipped line saying WHY
cuda_row() {
  if [ "$SMOKE" = 1 ]; then skip "$1" "$2"; return; fi
  local name="$1"; shift 2
  row "$name" "$@"
}
NO_FLEX="FlexAttention trains only on CUDA (train.attention=flex is refused on a CPU)"
selected() { [ -z "$ONLY" ] || case " $ONLY " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
skip() {  # skip NAME WHY
  "$PY" - "$ROWS" "$1" "$2" <<'EOF'
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"benchmark": "gpu_check", "row": sys.argv[2], "status": "skipped", "why": sys.argv[3]}) + "\n")
EOF
  echo "[gpu_check] $1: skipped: $2"
}

echo "[gpu_check] $( [ "$SMOKE" = 1 ] && echo "smoke, " )budget ${BUDGET} s, results in $OUT"
# Liger-Kernel from --peer-wheels for our rows (after the machine's own packages: an installed one wins)
if [ -n "$WHEELS" ] && ls "$WHEELS"/liger_kernel-*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/ours-site" "$WHEELS"/liger_kernel-*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$WORK/ours-site"
  else
    echo "[gpu_check] Liger-Kernel's wheel did not install (see log.txt): our rows run without it"
  fi
fi
row env "$L_ENV" -- "$PY" "$BENCH/bench_gpu.py" --row env --out "$ROWS"

row tests "$L_TESTS" -- "$PY" -m pytest "${TESTS[@]}" -p no:cacheprovider --junitxml "$WORK/tests.xml" \
  "$ROOT/tests/test_attention.py" "$ROOT/tests/test_attention_kernels.py" "$ROOT/tests/test_cache_online.py" "$ROOT/tests/test_loader.py" \
  "$ROOT/tests/test_precision.py" "$ROOT/tests/test_staging.py" "$ROOT/tests/test_step_plan.py" \
  -k "cuda or fused or online or stager"
# a failed merge test (this call's, or an earlier call's note in rows.jsonl) sends the later rows to the sentinel call
if "$PY" "$BENCH/_sentinel_fallback.py" "$WORK/tests.xml" "$ROWS"; then
  export DEEPSPEC_CHAIN_SENTINEL=1
fi

row ours "$L_OURS" -- "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms eagle3 dflash dspark --no-peer \
  --row-timeout "$ROW_S" --workdir "$WORK/train" --profile-dir "$OUT" --jsonl "$ROWS"

if [ "$SMOKE" = 1 ]; then
  skip liger-off "Liger's kernels run only on CUDA: on a CPU the ours row's EAGLE-3 runs the eager loss already"
elif ! "$PY" -c "import liger_kernel" >/dev/null 2>&1; then
  skip liger-off "Liger-Kernel is not installed (pass --peer-wheels DIR from benchmarks/peer_setup.sh --gpu-wheels): the ours row's EAGLE-3 ran the eager loss"
else
  row liger-off "$L_LIGER" -- env DEEPSPEC_LIGER=0 "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms eagle3 --no-peer \
    --row-timeout "$ROW_S" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"
fi

if [ "${DEEPSPEC_CHAIN_SENTINEL:-0}" = 1 ]; then
  skip sentinel "EAGLE-3's rows take the sentinel call already (DEEPSPEC_CHAIN_SENTINEL=1)"
else
  row sentinel "$L_SENT" -- env DEEPSPEC_CHAIN_SENTINEL=1 "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms eagle3 \
    --no-peer --row-timeout "$ROW_S" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"
fi

row cache "$L_CACHE" -- "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms dflash --no-peer --from-cache \
  --cache-samples 8 --row-timeout "$ROW_S" --workdir "$WORK/train" --profile-dir "$OUT" --jsonl "$ROWS"

PEER=()
PEER_WHEELS=()  # the folder's wheels but Liger's (ours, installed above)
if [ -n "$WHEELS" ]; then
  for whl in "$WHEELS"/*.whl; do case "$(basename "$whl")" in liger_kernel-*) ;; *) PEER_WHEELS+=("$whl") ;; esac; done
fi
if [ ${#PEER_WHEELS[@]} -gt 0 ]; then
  row peer-install 60 -- "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/peer-site" "${PEER_WHEELS[@]}"
  PEER=(--peer-python "$PY" --peer-pythonpath "$WORK/peer-site")
elif [ -x "$ROOT/.peer-venv/bin/python" ]; then
  PEER=(--peer-venv "$ROOT/.peer-venv")
fi
if [ ${#PEER[@]} -gt 0 ]; then
  row peer "$L_PEER" -- "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --accum 1 --algorithms eagle3 "${PEER[@]}" \
    --require-peer --peer-timeout $(( L_PEER * 2 / 3 )) --row-timeout "$ROW_S" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"
else
  skip peer "no peer: pass --peer-wheels DIR (bash benchmarks/peer_setup.sh --gpu-wheels) or create .peer-venv (bash benchmarks/peer_setup.sh)"
fi

row v4-memory "$L_V4" -- "$PY" "$BENCH/bench_draft_memory.py" --recipe "$ROOT/config/dflash/deepseek-v4-flash.yaml" "${V4[@]}" \
  --jsonl "$ROWS"

row long "$L_LONG" -- "$PY" "$BENCH/bench_train.py" "${LONG[@]}" --accum 1 --steps 3 --algorithms eagle3 --no-peer \
  --extra-opts model.activation_checkpointing=true --row-timeout "$ROW_S" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"

cuda_row flex "$NO_FLEX" "$L_FLEX" -- "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms dflash dspark --no-peer \
  --extra-opts train.attention=flex --row-timeout "$ROW_S" --workdir "$WORK/train" --profile-dir "$OUT" \
  --profile-tag flex --jsonl "$ROWS"

cuda_row eager "on a CPU train.compile=auto is eager already: the ours rows are the eager rows" "$L_EAGER" -- \
  "$PY" "$BENCH/bench_train.py" "${TRAIN[@]}" --algorithms dflash dspark --no-peer \
  --extra-opts train.compile=false --row-timeout "$ROW_S" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"

row mixed-sdpa "$L_MIXED" -- "$PY" "$BENCH/bench_train.py" "${MIXED[@]}" --algorithms dflash --no-peer \
  --extra-opts train.attention=sdpa --row-timeout "$L_MIXED" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"
cuda_row mixed-flex "$NO_FLEX" "$L_MIXED" -- "$PY" "$BENCH/bench_train.py" "${MIXED[@]}" --algorithms dflash --no-peer \
  --extra-opts train.attention=flex --row-timeout "$L_MIXED" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"

row recipe-batch "$L_RECIPE" -- "$PY" "$BENCH/bench_train.py" "${RECIPE[@]}" --algorithms dflash dspark --no-peer \
  --row-timeout "$R_RECIPE" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"
cuda_row recipe-sdpa "on a CPU recipe-batch runs the chunked SDPA calls already (train.attention=auto)" "$L_RSDPA" -- \
  "$PY" "$BENCH/bench_train.py" "${RECIPE[@]}" --algorithms dflash --no-peer \
  --extra-opts train.attention=sdpa --row-timeout "$L_RSDPA" --workdir "$WORK/train" --no-profile --jsonl "$ROWS"

"$PY" - "$ROWS" "$(( SECONDS - START ))" "$ROWS_BEFORE" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]).readlines()[int(sys.argv[3]):] if line.strip()]
status = {r["row"]: r["status"] for r in rows if r.get("benchmark") == "gpu_check" and "status" in r}
errors = [r for r in rows if r.get("error")]
summary = {"benchmark": "gpu_check", "row": "summary", "wall_s": float(sys.argv[2]), "status": status,
           "lines_with_errors": len(errors)}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(summary) + "\n")
print("[gpu_check] " + ", ".join(f"{k} {v}" for k, v in status.items()) + f"; {sys.argv[2]} s")
EOF
exit 0
