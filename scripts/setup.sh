#!/usr/bin/env bash
# Installs what tpmoe builds with, from Debian's packages; skips what is already there.
# The CUDA toolkit (nvcc, cuBLASLt, NCCL) is optional: without it the CPU build is made.
set -euo pipefail
packages=(cmake ninja-build g++ libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev clang libclang-rt-14-dev
          clang-format libopenmpi-dev openmpi-bin libpcre2-dev libcpp-httplib-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
