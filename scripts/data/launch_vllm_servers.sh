#!/usr/bin/env bash
# Start one vLLM OpenAI-compatible server per visible GPU (or one on CPU), bound to 127.0.0.1,
# wait until every server is healthy, and write their URLs (one per line) for
# `deepspec data regenerate CONFIG --urls-file FILE`.
#
#   bash scripts/data/launch_vllm_servers.sh MODEL [--urls-file F] [--port P] [--gpus-per-server N]
#                                                  [--log-dir D] [--timeout S] [-- EXTRA_VLLM_ARGS...]
#
# MODEL is an HF id, a local folder, or an embedded name (smollm2-135m-instruct).
# Stop the servers with:  while read -r p; do kill -- -$p; done < <log-dir>/pids
# Many nodes: run this on each node with --host-ip set to an address the driver can reach
# (default 127.0.0.1, i.e. local only), concatenate the URL files, and pass the result to
# `deepspec data regenerate --urls-file`; requests are spread over all servers.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
[[ $# -ge 1 ]] || usage 2
[[ "$1" == "-h" || "$1" == "--help" ]] && usage 0
MODEL="$1"; shift
URLS_FILE="vllm_urls.txt"; PORT=8000; GPUS_PER_SERVER=1; LOG_DIR="logs/vllm_servers"; TIMEOUT=900; HOST_IP=127.0.0.1
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --urls-file) URLS_FILE="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --gpus-per-server) GPUS_PER_SERVER="$2"; shift 2 ;;
    --log-dir) LOG_DIR="$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    --host-ip) HOST_IP="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "unknown option $1" >&2; usage 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python; fi
fi
MODEL_PATH="$("$PY" -c 'import sys; from deepspec.targets import resolve_target_path; print(resolve_target_path(sys.argv[1]))' "$MODEL")"

# Visible GPUs: CUDA_VISIBLE_DEVICES if set, else nvidia-smi; none -> one CPU server.
GPUS=()
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  IFS=',' read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi >/dev/null 2>&1; then
  mapfile -t GPUS < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true)
fi
mkdir -p "$LOG_DIR"
: > "$LOG_DIR/pids"
URLS=()
start_server() {  # $1 = CUDA_VISIBLE_DEVICES value ("" = CPU), $2 = port
  local devices="$1" port="$2" log="$LOG_DIR/server_$2.log" args=()
  args=(-m vllm.entrypoints.openai.api_server --model "$MODEL_PATH" --host "$HOST_IP" --port "$port")
  if [[ -z "$devices" ]]; then
    args+=(--enforce-eager)
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" setsid "$PY" "${args[@]}" "${EXTRA[@]}" > "$log" 2>&1 &
  else
    local n; n=$(awk -F, '{print NF}' <<< "$devices")
    CUDA_VISIBLE_DEVICES="$devices" setsid "$PY" "${args[@]}" --tensor-parallel-size "$n" "${EXTRA[@]}" > "$log" 2>&1 &
  fi
  echo $! >> "$LOG_DIR/pids"
  URLS+=("http://$HOST_IP:$port")
  echo "started server on ${devices:-CPU} -> http://$HOST_IP:$port (log $log)"
}

if [[ ${#GPUS[@]} -eq 0 ]]; then
  start_server "" "$PORT"
else
  for ((i = 0; i + GPUS_PER_SERVER <= ${#GPUS[@]}; i += GPUS_PER_SERVER)); do
    group=$(IFS=,; echo "${GPUS[*]:i:GPUS_PER_SERVER}")
    start_server "$group" $((PORT + i / GPUS_PER_SERVER))
  done
fi

# Wait for every /health; a server that dies or times out stops them all.
deadline=$((SECONDS + TIMEOUT))
mapfile -t PIDS < "$LOG_DIR/pids"
for idx in "${!URLS[@]}"; do
  url="${URLS[$idx]}"; pid="${PIDS[$idx]}"
  until curl -sf "$url/health" > /dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || (( SECONDS > deadline )); then
      echo "server $url failed to become healthy; see $LOG_DIR/server_${url##*:}.log" >&2
      while read -r p; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done < "$LOG_DIR/pids"
      exit 1
    fi
    sleep 2
  done
  echo "healthy: $url"
done
# one URL per line, each with its server's log (deepspec names the log when a server stops answering)
LOG_ABS="$(cd "$LOG_DIR" && pwd)"
for url in "${URLS[@]}"; do printf '%s  # log: %s\n' "$url" "$LOG_ABS/server_${url##*:}.log"; done > "$URLS_FILE"
echo "wrote ${#URLS[@]} URL(s) to $URLS_FILE; stop with: while read -r p; do kill -- -\$p; done < $LOG_DIR/pids"
