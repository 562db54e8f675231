#!/usr/bin/env bash
# Builds tpmoe on a GPU machine from a copy of the tree (the device tool's machine): CMake finds
# the header-only dependencies in .devdeps/ (scripts/device_deps.sh) and NCCL where NCCL_ROOT says
# (else the NCCL of the device's torch); the binary records that NCCL (RPATH) and refuses another at
# start.
#   scripts/device_build.sh [BUILD_DIR [TARGET...]]   (every target unless some are named)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
shift || true
targets=("$@")
prefix=$PWD/.devdeps/root/usr
if [ -z "${NCCL_ROOT:-}" ]; then
  # The NCCL the device's torch ships (2.28.9), the one nccl_device.h code must run with.
  for py in python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3; do
    d=$("$py" -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null) &&
      [ -f "$d/include/nccl.h" ] && NCCL_ROOT=$d && break
  done
fi
echo "NCCL_ROOT=${NCCL_ROOT:-<system>}"
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$prefix" \
  ${NCCL_ROOT:+-DTPMOE_NCCL_ROOT=$NCCL_ROOT} >/dev/null
cmake --build "$build" -j "$(nproc)" ${targets[@]:+--target "${targets[@]}"} -- -k 0
