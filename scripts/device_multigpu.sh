#!/usr/bin/env bash
# One device call on a machine of several GPUs (nvidia-h100-x2 and up): what one GPU cannot show.
#  1. The multi-GPU tests: tp 2 against tp 1 on the fixture and on an m3-shaped model, mpirun
#     against a thread per GPU, the fused all-reduce kernels under rank-dependent delays.
#  2. `tpmoe bench-op allreduce --tp N` at N = 2, 4, 8 up to the GPU count: each all-reduce path's
#     time per size, where docs/PERF.md's thresholds are still modelled from the bytes moved.
#  3. The m3 preset decoded across every GPU (--tp N, a thread per GPU) with all four fusion
#     settings, then rank 0 of the same deployment emulated on one GPU (--emulate-tp N): the
#     all-reduce fusion's real gain, and what the real collectives cost over the local stand-in.
#     4 layers a GPU: 58-59 GiB a rank in bf16 at tp 2, 4 and 8 (`tpmoe inspect`).
# Each command has a time limit (scripts/device_call.sh). The tests' and the all-reduce runs' limits
# (240 + 120 + 3 x 60 s) leave a minute of the call's 600 s for the build; the two m3 runs start only
# where they end before the 600 s.
#   scripts/device_multigpu.sh OUT_DIR    (carry .devdeps and .fixtures)
set -uo pipefail
# shellcheck source=scripts/device_call.sh
source "$(dirname "$0")/device_call.sh" "$@"
nvidia-smi topo -m >"$out/topology.txt" 2>&1
gpus=$(nvidia-smi --list-gpus | wc -l)
[ "$gpus" -ge 2 ] || { echo "$gpus GPU(s): this script needs 2 or more"; exit 1; }
scripts/device_build.sh build-gpu tpmoe_cli test_cuda_multigpu test_cuda_allreduce >"$out/build.log" 2>&1 ||
  { echo "build failed: $out/build.log"; tail -n 30 "$out/build.log"; exit 1; }
export TPMOE_FIXTURES=$PWD/.fixtures TPMOE_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0

TAIL=8 run test_cuda_multigpu 240 build-gpu/test_cuda_multigpu --gtest_brief=1
TAIL=4 run test_cuda_allreduce 120 build-gpu/test_cuda_allreduce --gtest_brief=1
for n in 2 4 8; do
  [ "$n" -le "$gpus" ] && TAIL=30 run "allreduce_tp$n" 60 build-gpu/tpmoe bench-op allreduce --tp "$n"
done
layers=$((gpus * 4))
[ "$(elapsed)" -lt 340 ] && run "m3_tp$gpus" 240 build-gpu/tpmoe bench --device cuda --preset m3 --tp "$gpus" --layers "$layers" \
  --batch 1,16,64 --compare-fusions
[ "$(elapsed)" -lt 480 ] && run "m3_emulate_tp$gpus" 100 build-gpu/tpmoe bench --device cuda --preset m3 \
  --emulate-tp "$gpus" --layers "$layers" --batch 1,16,64
echo "[$(elapsed) s] done"
