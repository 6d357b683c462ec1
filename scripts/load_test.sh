#!/usr/bin/env bash
# Load test of `nextlm serve` on loopback: starts a server on a free port with the bundled tiny model, runs
# build/nextlm_load_test (N concurrent clients x M requests each), and stops the server with SIGTERM.
#   scripts/load_test.sh [CLIENTS [REQUESTS [MAX_TOKENS [MAX_BATCH]]]]      (defaults: 8 8 32 8)
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-8} requests=${2:-8} max_tokens=${3:-32} max_batch=${4:-8}
model=${NEXTLM_MODEL:-examples/tiny-glm5-next}
for bin in build/nextlm build/nextlm_load_test; do
  [ -x "$bin" ] || { echo "load_test: $bin is missing; build first (scripts/build.sh)" >&2; exit 1; }
done
out=$(mktemp)
build/nextlm serve --model "$model" --port 0 --max-batch "$max_batch" --threads "${NEXTLM_THREADS:-1}" >"$out" &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$out"' EXIT
for _ in $(seq 100); do grep -q listening "$out" && break; sleep 0.1; done
port=$(sed -n 's/^listening on http:\/\/127.0.0.1:\([0-9]*\)$/\1/p' "$out")
[ -n "$port" ] || { echo "load_test: the server did not start" >&2; exit 1; }
echo "server: $model, --max-batch $max_batch, port $port"
status=0
build/nextlm_load_test --port "$port" --clients "$clients" --requests "$requests" --max-tokens "$max_tokens" || status=$?
kill -TERM "$server"
wait "$server" || { echo "load_test: the server exited with status $?" >&2; status=1; }
trap 'rm -f "$out"' EXIT
exit $status
