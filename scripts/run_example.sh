#!/usr/bin/env bash
# Sets up, builds and runs the main job: train a tiny glm5_next model from scratch on Debian's fortunes (byte-level,
# vocab 256) on the CPU until its loss clearly falls, then score held-out fortunes before and after training.
# Then the second example: score the bundled example text with the bundled tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
source scripts/blas_env.sh
run=build/fortunes
rm -rf "$run"
scripts/prepare_fortunes.sh "$run/data"

# Perplexity of a `score --output` JSONL: exp(−Σ log p / number of predicted tokens).
perplexity() {
  awk '{ n += gsub(/,/, ",", $0) - 0; match($0, /"sum": [-0-9.e+]+/); s += substr($0, RSTART + 7, RLENGTH - 7) }
       END { printf "%.3f", exp(-s / n) }' "$1"
}

# Step 0: the freshly initialised model (saved without training), then ~2 minutes of training on 2 cores.
build/nextlm train --config examples/fortunes/config.json --data "$run/data/train.jsonl" --out "$run/init" --steps 0
start=$(date +%s)
build/nextlm train --config examples/fortunes/config.json --data "$run/data/train.jsonl" --out "$run/trained" \
  --steps 120 --warmup 10 --lr 1e-2 --batch-tokens 512 --seed 0
echo "training took $(($(date +%s) - start)) s; loss log $run/trained/train_log.csv, curve $run/trained/train_log.svg"
for m in init trained; do
  build/nextlm score --model "$run/$m/checkpoint" --input "$run/data/heldout.jsonl" --output "$run/$m/heldout.jsonl"
done
echo "held-out perplexity per byte: before training $(perplexity "$run/init/heldout.jsonl"), after $(perplexity \
  "$run/trained/heldout.jsonl") (a uniform guess over 256 bytes: 256)"
echo
build/nextlm generate --model "$run/trained/checkpoint" --prompt "The " --max-new-tokens 80 --temperature 0.7 --seed 1
echo

# The second example: the bundled tiny model (random weights; it is a golden test case) on three sentences.
build/nextlm info --model examples/tiny-glm5-next
echo
build/nextlm score --model examples/tiny-glm5-next --input examples/tiny-glm5-next/input.jsonl --format text
