#!/usr/bin/env bash
# A/B timing on the GPU machine: runs benchmark cases alternately under two settings of one environment switch, in
# one process a round each, so that both sides see the same card, clocks and neighbours.
#   scripts/gpu_ab.sh BUNDLE_DIR CASES VAR A B [ROUNDS]
# BUNDLE_DIR: binaries packed by scripts/gpu_bundle.sh (unpacked on first use); CASES: nextlm_bench cases,
# comma-separated; VAR=A and VAR=B the two settings (ROUNDS rounds, default 2, A first in each). Every result line
# goes to ${OUT:-/tmp/nextlm_gpu}/ab.jsonl with the setting added as "ab"; a summary of each case's ours_ms by side
# is printed at the end. Before timing, NEXTLM_AB_TESTS (a gtest filter) runs those GPU tests first and stops the
# script if they fail.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 5 ]; then
  echo "usage: scripts/gpu_ab.sh BUNDLE_DIR CASES VAR A B [ROUNDS]" >&2
  exit 2
fi
bin=$1 cases=$2 var=$3 a=$4 b=$5 rounds=${6:-2}
case "$rounds" in '' | *[!0-9]* | 0) echo "gpu_ab: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2 ;; esac
[ -f "$bin/nextlm_bench" ] || tar xJf "$bin/bundle.tar.xz" -C "$bin" || exit 1
export LD_LIBRARY_PATH="$PWD/$bin/lib:${LD_LIBRARY_PATH:-}"
export NEXTLM_TEST_DATA="$PWD/tests" NEXTLM_SOURCE_DIR="$PWD" NEXTLM_BINARY="$PWD/$bin/nextlm"
out=${OUT:-/tmp/nextlm_gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${NEXTLM_AB_TESTS:-}" ]; then
  echo "== tests: $NEXTLM_AB_TESTS"
  "$bin/test_cuda" --gtest_filter="$NEXTLM_AB_TESTS" >"$out/ab_tests.log" 2>&1
  rc=$?
  grep -E "^\[(cuda|  FAILED|  PASSED)|Failure" "$out/ab_tests.log"
  if [ "$rc" != 0 ]; then
    echo "gpu_ab: the tests failed (exit $rc); no timing"
    exit 1
  fi
fi
: >"$out/ab.jsonl"
for ((r = 1; r <= rounds; ++r)); do
  for side in "$a" "$b"; do
    echo "== round $r: $var=$side"
    env "$var=$side" "$bin/nextlm_bench" "$cases" 2>>"$out/ab_bench.err" |
      while IFS= read -r line; do
        case "$line" in
          \{*) echo "${line%\}}, \"ab\": \"$var=$side\"}" | tee -a "$out/ab.jsonl" | cut -c1-160 ;;
          *) echo "$line" ;;
        esac
      done
  done
done
echo "== ours_ms by case and side"
python3 - "$out/ab.jsonl" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    rows.setdefault((d.get("case", d.get("name")), d["ab"]), []).append(d.get("ours_ms"))
for (case, side), ms in sorted(rows.items()):
    print(f"{case:40s} {side:32s} " + " ".join(f"{m:.2f}" if isinstance(m, (int, float)) else str(m) for m in ms))
EOF
