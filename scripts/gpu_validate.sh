#!/usr/bin/env bash
# Runs every GPU test and the GPU benchmarks from a folder of built binaries, on a machine with an
# NVIDIA GPU. Used for the numbers in docs/PERF.md:
#   scripts/gpu_validate.sh BIN_DIR OUT_DIR
# BIN_DIR holds tpmoe, test_cuda_* (and optionally bench_moe) and fixtures/ (a copy of
# ../shared/fixtures). NCCL device-API code must run against the NCCL it was built with (2.28.9):
# the script puts a pip-installed nvidia-nccl of that version first on LD_LIBRARY_PATH when found.
set -uo pipefail
bin=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$bin"
nccl=""
for py in python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3; do
  d=$("$py" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) + '/lib')" 2>/dev/null) &&
    [ -f "$d/libnccl.so.2" ] && nccl=$d && break
done
[ -n "$nccl" ] || nccl=$(dirname "$(find / -path /proc -prune -o -name libnccl.so.2 -path '*nvidia/nccl/lib*' -print \
  2>/dev/null | head -n 1)")
[ "$nccl" = "." ] && nccl=""
if [ -n "$nccl" ]; then export LD_LIBRARY_PATH="$nccl:${LD_LIBRARY_PATH:-}"; echo "NCCL: $nccl"; else echo "NCCL: system"; fi
export TPMOE_FIXTURES="$bin/fixtures" NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
status=0
for t in ${TESTS:-test_cuda_*}; do
  timeout 300 "./$t" --gtest_brief=1 >"$out/$t.log" 2>&1
  rc=$?
  echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E "relative L2|worst" "$out/$t.log"
  [ $rc -eq 0 ] || status=1
done
[ -n "${TESTS:-}" ] && exit $status  # tests only
timeout 240 ./tpmoe bench --device cuda --preset m3 --layers 4 --batch 1,8,32,64 --json "$out/bench.json" \
  2>"$out/bench.err" | tee "$out/bench.txt"
# Where a batch-1 decode step goes, op by op (steps run eagerly for this).
TPMOE_PROFILE_OPS=1 timeout 120 ./tpmoe generate --device cuda --preset m3 --layers 4 --prompt-ids 1,2,3,4,5,6,7,8 \
  --max-new-tokens 8 >"$out/profile.txt" 2>&1
head -30 "$out/profile.txt"
exit $status
