#!/usr/bin/env bash
# Start a Mooncake master with its HTTP metadata service: the store a streamed run's producers and trainers share when
# their nodes have no common filesystem (cache.spool_transport: mooncake, docs/data.md). Prints the two settings the
# recipe needs, then runs in the foreground (Ctrl-C stops it; the spool's records live in the producers' memory).
#   bash scripts/data/mooncake_master.sh [--host 0.0.0.0] [--port 50051] [--metadata-port 8080] [--metrics-port 9003]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${DEEPSPEC_VENV:-$ROOT/.venv}"
HOST=0.0.0.0 PORT=50051 META=8080 METRICS=9003
while [ $# -gt 0 ]; do
  case "$1" in
    --host) HOST="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --metadata-port) META="$2"; shift 2 ;;
    --metrics-port) METRICS="$2"; shift 2 ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
PKG="$("$VENV/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))' 2>/dev/null)" || {
  echo "no Mooncake in $VENV: rerun scripts/setup.sh (or pip install mooncake-transfer-engine)" >&2; exit 2; }
# libibverbs unpacked by scripts/setup.sh where the system has none (the binary links it even for TCP)
SYS="$VENV/lib/deepspec-sys"
export LD_LIBRARY_PATH="$SYS/usr/lib/x86_64-linux-gnu:$SYS/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SHOWN="$HOST"
[ "$SHOWN" = 0.0.0.0 ] && SHOWN="$(hostname -I 2>/dev/null | awk '{print $1}')"
echo "[mooncake] recipe settings: cache.spool_transport=mooncake cache.mooncake_master=${SHOWN:-HOST}:$PORT" \
     "cache.mooncake_metadata=http://${SHOWN:-HOST}:$META/metadata"
exec "$PKG/mooncake_master" --rpc_address "$HOST" --rpc_port "$PORT" --enable_http_metadata_server=true \
  --http_metadata_server_host "$HOST" --http_metadata_server_port "$META" --metrics_port "$METRICS"
