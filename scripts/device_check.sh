#!/usr/bin/env bash
# One device call: build on the GPU machine, run every test there (CPU and GPU; a missing GPU
# fails), then the benchmarks named in BENCHES (a ;-separated list of tpmoe command lines).
#   scripts/device_check.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$1
mkdir -p "$out"
if scripts/device_build.sh build-gpu >"$out/build.log" 2>&1; then
  echo "build: ok"
else  # report what failed, then test what did build
  echo "build: FAILED"; grep -E "error|FAILED" "$out/build.log" | grep -v Warray | head -20
fi
export TPMOE_FIXTURES=$PWD/.fixtures TPMOE_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
scripts/tree_state.sh | tee "$out/tree.txt"
# shellcheck disable=SC2086  # CTEST_ARGS is an argument list
ctest --test-dir build-gpu -j 8 --timeout 600 ${CTEST_ARGS:-} >"$out/ctest.log" 2>&1
grep -E "tests passed|tests failed|\*\*\*Failed|Not Run|Timeout" "$out/ctest.log" | head -30
for t in build-gpu/test_cuda_*; do
  "$t" --gtest_brief=1 2>&1 | grep -E "relative L2|worst|exempt|FAILED|Failure|rank" | head -20
done > "$out/gpu_numbers.txt"
head -n 60 "$out/gpu_numbers.txt"
IFS=';' read -ra benches <<<"${BENCHES:-}"
i=0
for b in "${benches[@]}"; do
  i=$((i + 1))
  echo "== tpmoe $b"
  # shellcheck disable=SC2086  # a line is an argument list
  timeout 400 ./build-gpu/tpmoe $b >"$out/bench$i.txt" 2>"$out/bench$i.err"
  echo "rc=$?"; tail -n 25 "$out/bench$i.txt"; tail -n 3 "$out/bench$i.err"
done
