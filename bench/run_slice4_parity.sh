#!/usr/bin/env bash
# The whole GPU-side slice4 sequence on the H200, in one call (~5-7 minutes; run it with the 600 s limit):
#   1. transformers builds the 4-layer full-width slice with random weights, saves it (bf16, sharded hub layout,
#      ~44 GB) to $SLICE4_WORK/model, times its bf16 prefill (the peer of slice4_prefill_T4096) and writes the fp32
#      reference log-softmax of the parity sequences (bench/peers/hf_slice4.py prepare);
#   2. nextlm loads that checkpoint straight to the GPU in bf16 and scores it against the reference
#      (nextlm_bench parity);
#   3. nextlm's own slice4_prefill_T4096 and mhc cases (random device weights);
#   4. the four parity numbers of issue 3 and PASS/FAIL, and the h200.json entry of slice4_prefill_T4096 with the
#      peer (hf_slice4.py report).
# Usage: bench/run_slice4_parity.sh BUNDLE_DIR   (binaries from scripts/gpu_bundle.sh, e.g. .devbuild)
# Results (small files) go to ${OUT:-/tmp/nextlm_gpu}; the ~49 GB of checkpoint and reference go to $SLICE4_WORK,
# by default /dev/shm/nextlm_slice4 when /dev/shm has room (a disk may write 44 GB slowly), else
# /tmp/nextlm_slice4; removed at the end unless SLICE4_KEEP=1. SLICE4_NO_BENCH=1 skips step 3.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:?usage: bench/run_slice4_parity.sh BUNDLE_DIR}
if [ -z "${SLICE4_WORK:-}" ]; then
  shm_gb=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')
  SLICE4_WORK=/tmp/nextlm_slice4
  [ "${shm_gb:-0}" -ge 56 ] 2>/dev/null && SLICE4_WORK=/dev/shm/nextlm_slice4
fi
work=$SLICE4_WORK
out=${OUT:-/tmp/nextlm_gpu}
rm -rf "$work"
mkdir -p "$work" "$out"
cleanup() { [ "${SLICE4_KEEP:-0}" = 1 ] || rm -rf "$work"; }  # 49 GB, in RAM when under /dev/shm
trap cleanup EXIT
# Only nextlm's binaries see the bundled libraries (python keeps its own OpenSSL, libgomp, ...).
nx() { LD_LIBRARY_PATH="$PWD/$bin/lib:${LD_LIBRARY_PATH:-}" "$@"; }
export NEXTLM_SOURCE_DIR="$PWD"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -d peers/fla ] && export PYTHONPATH="$PWD/peers/fla:${PYTHONPATH:-}"
start=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - start )) s: $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
echo "work dir $work"; df -h "$work" | tail -1; free -g | head -2
status=0

stamp "1/4 transformers: build and save the slice, peer timing, bf16 and fp32 log-softmax"
python3 bench/peers/hf_slice4.py prepare "$work" 2>&1 | tee "$out/hf_slice4.log"
prep=${PIPESTATUS[0]}
cp "$work/hf_results.json" "$out/" 2>/dev/null
parity=1
if [ "$prep" = 0 ]; then
  stamp "2/4 nextlm: load the checkpoint to the GPU (bf16) and compare with HF fp32"
  nx "$bin/nextlm_bench" parity "$work/model" "$work/ref_logp.safetensors" "$out/nextlm_parity.json" 2>&1 |
    tee "$out/nextlm_parity.log"
  parity=${PIPESTATUS[0]}
else
  echo "hf_slice4.py prepare failed (exit $prep)"
fi
[ "${SLICE4_KEEP:-0}" = 1 ] || rm -rf "$work/model" "$work/ref_logp.safetensors"

if [ "${SLICE4_NO_BENCH:-0}" != 1 ]; then
  stamp "3/4 nextlm slice4 benchmark (random device weights)"
  nx "$bin/nextlm_bench" slice4_prefill_T4096,mhc 2>"$out/slice4_bench.err" | tee "$out/slice4_bench.jsonl"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  cat "$out/slice4_bench.err"
fi

if [ "$parity" = 0 ]; then
  stamp "4/4 parity report"
  python3 bench/peers/hf_slice4.py report "$work" "$out/nextlm_parity.json" "$out/slice4_bench.jsonl" |
    tee "$out/slice4_parity.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
else
  status=1
fi
stamp "done (status $status)"
exit $status
