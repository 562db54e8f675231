#!/usr/bin/env bash
# Runs every GPU test and the GPU benchmarks from a build folder, on a machine with an NVIDIA GPU.
# Used for the numbers in docs/PERF.md:
#   scripts/gpu_validate.sh BUILD_DIR OUT_DIR
# BUILD_DIR holds tpmoe, test_cuda_* and bench_moe (scripts/device_build.sh makes it). The fixtures
# come from TPMOE_FIXTURES (default: ../shared/fixtures beside the checkout). A missing or broken GPU
# fails every GPU test here (TPMOE_REQUIRE_GPU=1) instead of skipping it. The binaries find the NCCL
# they were built with through their RPATH and refuse another one at start.
# TESTS="test_cuda_x ..." runs only those tests; BENCH=0 skips the benchmarks.
set -uo pipefail
bin=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
export TPMOE_FIXTURES=${TPMOE_FIXTURES:-$root/../shared/fixtures} TPMOE_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
cd "$bin" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$root/scripts/tree_state.sh" | tee "$out/tree.txt"
status=0
for t in ${TESTS:-test_cuda_*}; do
  timeout 300 "./$t" --gtest_brief=1 >"$out/$t.log" 2>&1
  rc=$?
  echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E "relative L2|worst|exempt" "$out/$t.log"
  [ $rc -eq 0 ] || status=1
done
[ "${BENCH:-1}" = 0 ] && exit $status
timeout 240 ./bench_moe --json "$out/bench_moe.json" >"$out/bench_moe.txt" 2>&1 || status=1
tail -n 30 "$out/bench_moe.txt"
timeout 240 ./tpmoe bench --device cuda --preset m3 --layers 4 --batch 1,8,32,64 --json "$out/bench.json" \
  2>"$out/bench.err" | tee "$out/bench.txt" || status=1
exit $status
