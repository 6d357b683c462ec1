#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries here (the GPU machine has nvcc but not the Debian libraries) and stages
# them, with the shared libraries the GPU machine lacks, in .devbuild/ (git-ignored) to be carried there and run as
# `scripts/test_gpu.sh .devbuild`. fla's source for the peer timing goes in peers/fla (also ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DNEXTLM_CUDA=ON >/dev/null
cmake --build build --target test_cuda nextlm_bench nextlm
mkdir -p .devbuild/lib
cp build/tests/test_cuda build/bench/nextlm_bench build/nextlm .devbuild/
for lib in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0; do
  cp -L "/usr/lib/x86_64-linux-gnu/$lib" .devbuild/lib/
done
grep -qx '/.devbuild/' .git/info/exclude 2>/dev/null || echo '/.devbuild/' >> .git/info/exclude
du -sh .devbuild
