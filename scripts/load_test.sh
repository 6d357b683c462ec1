#!/usr/bin/env bash
# Load test of `nextlm serve` on loopback: starts a server on a free port with the bundled tiny model, runs
# nextlm_load_test (N concurrent clients x M requests each), and stops the server with SIGTERM.
#   scripts/load_test.sh [CLIENTS [REQUESTS [MAX_TOKENS [MAX_BATCH]]]]      (defaults: 8 8 32 8)
# Environment: NEXTLM_MODEL (model directory), NEXTLM_THREADS (server CPU threads, default 1), BUILD_DIR (where
# nextlm and nextlm_load_test are, default build), NEXTLM_DEVICE (cpu or cuda, default cpu), NEXTLM_SERVE_ARGS
# (more serve flags, e.g. "--batch-invariant --max-len 4096" on the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
clients=${1:-8} requests=${2:-8} max_tokens=${3:-32} max_batch=${4:-8}
model=${NEXTLM_MODEL:-examples/tiny-glm5-next}
build=${BUILD_DIR:-build}
device=${NEXTLM_DEVICE:-cpu}
for bin in "$build/nextlm" "$build/nextlm_load_test"; do
  [ -x "$bin" ] || { echo "load_test: $bin is missing; build first (scripts/build.sh)" >&2; exit 1; }
done
# shellcheck disable=SC2206  # NEXTLM_SERVE_ARGS is a list of words
extra=(${NEXTLM_SERVE_ARGS:-})
[ "$device" = cpu ] || extra=(--device "$device" "${extra[@]}")
out=$(mktemp)
"$build/nextlm" serve --model "$model" --port 0 --max-batch "$max_batch" --threads "${NEXTLM_THREADS:-1}" \
  "${extra[@]}" >"$out" &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$out"' EXIT
# Up to 10 s for the CPU server, 120 s for a GPU one (CUDA start-up and the weights' upload); stop early if it died.
tries=100
[ "$device" = cpu ] || tries=1200
for _ in $(seq "$tries"); do
  grep -q listening "$out" && break
  kill -0 "$server" 2>/dev/null || break
  sleep 0.1
done
port=$(sed -n 's/^listening on http:\/\/127.0.0.1:\([0-9]*\)$/\1/p' "$out")
[ -n "$port" ] || { echo "load_test: the server did not start" >&2; exit 1; }
if [ "$device" = cpu ] && [ ${#extra[@]} -eq 0 ]; then
  echo "server: $model, --max-batch $max_batch, port $port"
else
  echo "server: $model, --max-batch $max_batch ${extra[*]}, port $port"
fi
status=0
"$build/nextlm_load_test" --port "$port" --clients "$clients" --requests "$requests" --max-tokens "$max_tokens" ||
  status=$?
kill -TERM "$server"
wait "$server" || { echo "load_test: the server exited with status $?" >&2; status=1; }
trap 'rm -f "$out"' EXIT
exit $status
