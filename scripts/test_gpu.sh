#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks on a CUDA machine. With no argument it builds first (scripts/build.sh, which
# needs the Debian packages of scripts/setup.sh) and uses build/; with a directory argument it runs binaries built
# elsewhere by scripts/gpu_bundle.sh (its bundle.tar.xz: test_cuda, nextlm_bench, nextlm and a lib/ of shared
# libraries the machine lacks).
# Writes results under ${OUT:-/tmp/nextlm_gpu}.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
if [ -z "$bin" ]; then
  scripts/build.sh && bin=build
  tests=build/tests/test_cuda
  bench=build/bench/nextlm_bench
else
  # scripts/gpu_bundle.sh packs the binaries and libraries; unpack them on first use.
  [ -f "$bin/test_cuda" ] || tar xJf "$bin/bundle.tar.xz" -C "$bin"
  tests=$bin/test_cuda
  bench=$bin/nextlm_bench
  export LD_LIBRARY_PATH="$PWD/$bin/lib:${LD_LIBRARY_PATH:-}"
fi
# The serve tests start the CLI binary.
export NEXTLM_BINARY="$PWD/$bin/nextlm"
out=${OUT:-/tmp/nextlm_gpu}
mkdir -p "$out"
export NEXTLM_TEST_DATA="$PWD/tests" NEXTLM_SOURCE_DIR="$PWD"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
status=0
echo "== GPU tests"
"$tests" 2>&1 | tee "$out/test_cuda.log" | grep -E "^\[(cuda|  FAILED|  PASSED)|Failure|error" || true
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ -z "${NEXTLM_SKIP_MEMCHECK:-}" ]; then
  echo "== compute-sanitizer memcheck on the kernel tests"
  compute-sanitizer --tool memcheck --error-exitcode 7 "$tests" --gtest_filter='CudaKda*:CudaGroupedGemm*:CudaDecode*:CudaMhc*:*CudaIndexerPrefill*:CudaModelBatchInvariance*:*tiny*' >"$out/memcheck.log" 2>&1
  rc=$?
  echo "memcheck exit $rc (7 = memory errors; 1 = a test assertion failed)"; tail -3 "$out/memcheck.log"
  [ "$rc" = 7 ] && status=1
fi
echo "== load test of the GPU server (tiny model)"
BUILD_DIR=$bin NEXTLM_DEVICE=cuda scripts/load_test.sh 16 8 64 16 2>&1 | tee "$out/load_test.txt" || status=1
BUILD_DIR=$bin NEXTLM_DEVICE=cuda NEXTLM_SERVE_ARGS=--batch-invariant scripts/load_test.sh 16 8 64 16 2>&1 |
  tee "$out/load_test_batch_invariant.txt" || status=1
echo "== benchmarks"
"$bench" | tee "$out/ours.jsonl"
if [ -d peers/fla ]; then
  PYTHONPATH="$PWD/peers/fla:${PYTHONPATH:-}" python3 bench/peers/fla_kda.py 2>"$out/fla.err" | tee "$out/peers.jsonl"
  tail -3 "$out/fla.err"
fi
exit $status
