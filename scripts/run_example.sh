#!/usr/bin/env bash
# Sets up, builds and runs the main job: score the bundled example text with the bundled tiny glm5_next model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build/nextlm info --model examples/tiny-glm5-next
echo
build/nextlm score --model examples/tiny-glm5-next --input examples/tiny-glm5-next/input.jsonl --format text
