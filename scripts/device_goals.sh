#!/usr/bin/env bash
# One device call that measures the open issues' goal rows (docs/PERF.md, "Where the open issues'
# goals stand") at this tree: bench_moe at I 3072 in MXFP8 and bf16, the tiny preset at 60 layers,
# the tp-8 rank with every fusion setting and, time left, the MXFP8 tp-4 rank and bench_moe bf16 at
# I 384 (with I 3072, the widths of issue 11's table of a peer's fused MoE). The ranks run 60
# layers on a GPU of more than 110000 MiB (an H200), 30 elsewhere (a bf16 tp-8 rank of 60 layers is
# 101.5 GiB). Each command has a time limit (scripts/device_call.sh).
#   scripts/device_goals.sh OUT_DIR
set -uo pipefail
# shellcheck source=scripts/device_call.sh
source "$(dirname "$0")/device_call.sh" "$@"
scripts/device_build.sh build-gpu tpmoe_cli bench_moe >"$out/build.log" 2>&1 ||
  { echo "build failed: $out/build.log"; tail -n 30 "$out/build.log"; exit 1; }
export NCCL_NVLS_ENABLE=0
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
layers=30
[ "${memory_mib:-0}" -gt 110000 ] && layers=60

run bench_moe_mxfp8 120 build-gpu/bench_moe --dtype mxfp8 --inter 3072
run bench_moe_bf16 120 build-gpu/bench_moe --inter 3072
TAIL=5 run tiny 90 build-gpu/tpmoe bench --device cuda --preset tiny --layers 60 --batch 1,16,64
run tp8 280 build-gpu/tpmoe bench --device cuda --preset m3 --emulate-tp 8 --layers "$layers" --batch 1,16,64 \
  --compare-fusions
if [ "$(elapsed)" -lt 420 ]; then
  run tp4_mxfp8 150 build-gpu/tpmoe bench --device cuda --preset m3 --dtype mxfp8 --emulate-tp 4 --layers "$layers" \
    --batch 1,16,64 --compare-fusions
fi
# The call's limit is 600 s; this script's clock starts before the build: this one ends by 580 s on it.
[ "$(elapsed)" -lt 500 ] && run bench_moe_bf16_384 80 build-gpu/bench_moe --inter 384
echo "[$(elapsed) s] done"
