#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (the GPU machine has nvcc and the CUDA libraries but not the Debian
# ones) and packs them, with every shared library they need that is not part of the base system or CUDA, into
# .devbuild/bundle.tar.xz (git-ignored), to be carried there, unpacked with `tar xJf bundle.tar.xz -C .devbuild`
# and run as `scripts/test_gpu.sh .devbuild` (the GPU server's load test: BUILD_DIR=.devbuild NEXTLM_DEVICE=cuda
# scripts/load_test.sh). fla's source for the peer timing goes in peers/fla (also ignored).
# BUILD_DIR picks the build directory (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNEXTLM_CUDA=ON >/dev/null
cmake --build "$build" --target test_cuda nextlm_bench nextlm nextlm_load_test
bins=("$build/tests/test_cuda" "$build/bench/nextlm_bench" "$build/nextlm" "$build/nextlm_load_test")
# The timeline recorder (tools/kernel_trace.cpp) where CUPTI was found, run there as
# CUDA_INJECTION64_PATH=$PWD/.devbuild/lib/libnextlm_trace.so NEXTLM_TRACE_OUT=trace.csv <binary>.
# (grep reads the whole list: with -q it could exit first and fail the pipeline through SIGPIPE under pipefail.)
if cmake --build "$build" --target help | grep '^nextlm_trace:' >/dev/null; then
  cmake --build "$build" --target nextlm_trace
  trace="$build/libnextlm_trace.so"
fi
stage=$(mktemp -d)
mkdir -p "$stage/lib"
cp "${bins[@]}" "$stage/"
strip "$stage/test_cuda" "$stage/nextlm_bench" "$stage/nextlm" "$stage/nextlm_load_test"
# Libraries from Debian packages (OpenBLAS, ICU, Open MPI, ...); the C/C++ runtime and CUDA are on the GPU machine.
if [ -n "${trace:-}" ]; then cp "$trace" "$stage/lib/"; fi
ldd "${bins[@]}" ${trace:+"$trace"} | awk '/=> \// {print $3}' | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libstdc++.so*|libgcc_s.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libcudart.so*|libcublas*|libnccl*|libz.so*) ;;
    *) cp -L "$lib" "$stage/lib/" ;;
  esac
done
rm -rf .devbuild
mkdir -p .devbuild
tar cJf .devbuild/bundle.tar.xz -C "$stage" .
rm -rf "$stage"
git_dir=$(git rev-parse --git-common-dir)
grep -qx '/.devbuild/' "$git_dir/info/exclude" 2>/dev/null || echo '/.devbuild/' >> "$git_dir/info/exclude"
du -sh .devbuild
