#!/usr/bin/env bash
# Sets up, builds and runs every test: the unit and golden suite (Release), the same suite under AddressSanitizer
# and UndefinedBehaviorSanitizer, and the libFuzzer targets for a bounded time. `--quick` runs the first part only.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1
jobs=$(nproc)

scripts/setup.sh
source scripts/blas_env.sh
echo "== build (Release)"
scripts/build.sh
echo "== tests (Release)"
# GPU tests (label gpu) are compiled here and run on a GPU machine by scripts/test_gpu.sh.
ctest --test-dir build --output-on-failure -j "$jobs" -LE gpu
[ "$quick" = 1 ] && exit 0

echo "== tests under AddressSanitizer + UndefinedBehaviorSanitizer"
# -O1 with line tables only: what AddressSanitizer's stack traces need, at half the compile time of -O2 -g.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DNEXTLM_SANITIZE=ON -DNEXTLM_CUDA=OFF >/dev/null
cmake --build build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -LE gpu

echo "== fuzzing (libFuzzer, ${NEXTLM_FUZZ_SECONDS:-60} s per target)"
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++-14 \
  -DNEXTLM_FUZZ=ON -DNEXTLM_TESTS=OFF >/dev/null
cmake --build build-fuzz --target fuzz_safetensors fuzz_config fuzz_tokenizer
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for target in safetensors config tokenizer; do
  cp -r "fuzz/corpus/$target" "$work/$target"
  dict=()
  [ -f "fuzz/$target.dict" ] && dict=(-dict="fuzz/$target.dict")
  build-fuzz/fuzz/fuzz_$target "${dict[@]}" -max_total_time="${NEXTLM_FUZZ_SECONDS:-60}" -print_final_stats=1 \
    -artifact_prefix="$work/" "$work/$target" 2>&1 | grep -E "^(stat::number_of_executed_units|Done|==)" || true
  if ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* >/dev/null 2>&1; then
    echo "fuzz_$target found a failing input:"; ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-* 2>/dev/null
    exit 1
  fi
done
echo "== all tests passed"
