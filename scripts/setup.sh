#!/usr/bin/env bash
# Installs the Debian packages nextlm needs to build, test and fuzz (skips apt when all are present).
set -euo pipefail
packages=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libopenblas-dev libgtest-dev libbenchmark-dev
          clang-14 libclang-rt-14-dev libcpp-httplib-dev openmpi-bin libopenmpi-dev
          libicu-dev  # libicu-dev: Unicode categories for the tokenizer's pre-tokenizer regex
          fortunes-min)  # fortunes-min: the text the README's training example learns
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
