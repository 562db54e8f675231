#!/usr/bin/env bash
# An A/B of a change inside one device call: builds this tree's tpmoe (side A), applies PATCH (a `git
# diff` against this tree) and builds again (side B), then runs every benchmark line of BENCHES on
# both sides, ROUNDS times, A then B each round. Timings of two machines, even of one kind, differ by
# a few percent (docs/PERF.md), more than most changes move a step: both sides run on one machine,
# interleaved, so that drift shows as a spread between rounds instead of a gain.
#   scripts/device_ab.sh PATCH OUT_DIR
# BENCHES  ;-separated argument lines of `tpmoe` (default: a 30-layer tp-8 rank at batch 1, 16, 64);
#          each run's fusions-on rows are printed: batch, TPOT mean and p99 ms, ratio, launches.
# ROUNDS   rounds (default 2).
# TESTS    test executables to build and run on side B first (e.g. "test_cuda_attention"), each
#          stopped after TEST_TIMEOUT seconds (default 300): a hang costs the call, not the session.
# BUILD    the build folder (default build-gpu; scripts/device_build.sh configures it).
# The patch is taken back out at the end, so the tree is left as it was found.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PATCH OUT_DIR" >&2; exit 2; }
patch_file=$(realpath "$1")
out=$(mkdir -p "$2" && cd "$2" && pwd)
cd "$(dirname "$0")/.." || exit 1
build=${BUILD:-build-gpu}
benches=${BENCHES:-bench --device cuda --preset m3 --emulate-tp 8 --layers 30 --batch 1,16,64}
export TPMOE_REQUIRE_GPU=1 NCCL_NVLS_ENABLE=0
# The fixtures a device call carries (scripts/device_check.sh's place); else the tests' default.
[ -d .fixtures ] && export TPMOE_FIXTURES=${TPMOE_FIXTURES:-$PWD/.fixtures}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "side A is this tree:"
scripts/tree_state.sh | tee "$out/tree.txt"
side_a=$(mktemp -d)
scripts/device_build.sh "$build" tpmoe_cli >"$out/build_a.log" 2>&1 || { echo "side A: build failed, $out/build_a.log"; exit 1; }
cp "$build/tpmoe" "$side_a/tpmoe"  # its RPATH (NCCL, cpp-httplib) is absolute: it runs from there
patch -p1 --forward --quiet <"$patch_file" || { echo "the patch does not apply to this tree"; exit 1; }
trap 'patch -p1 -R --quiet <"$patch_file"' EXIT
# shellcheck disable=SC2086  # TESTS is a list of target names
scripts/device_build.sh "$build" tpmoe_cli ${TESTS:-} >"$out/build_b.log" 2>&1 ||
  { echo "side B: build failed, $out/build_b.log"; exit 1; }
for t in ${TESTS:-}; do
  timeout "${TEST_TIMEOUT:-300}" "$build/$t" --gtest_brief=1 >"$out/$t.log" 2>&1
  echo "side B $t: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
done

rows() { awk '$1 == "on/on" {printf "    batch %s  TPOT %s  p99 %s  ratio %s  launches %s\n", $2, $5, $7, $11, $12}'; }
IFS=';' read -ra lines <<<"$benches"
for ((round = 1; round <= ${ROUNDS:-2}; ++round)); do
  for side in A B; do
    bin=$build/tpmoe
    [ $side = A ] && bin=$side_a/tpmoe
    for i in "${!lines[@]}"; do
      echo "round $round, side $side: tpmoe ${lines[$i]}"
      # shellcheck disable=SC2086  # a line is an argument list
      timeout 300 "$bin" ${lines[$i]} 2>>"$out/bench_$side.err" | tee -a "$out/bench_$side.txt" | rows
      rc=${PIPESTATUS[0]}
      [ "$rc" -eq 0 ] || echo "    exit status $rc: $(tail -n 1 "$out/bench_$side.err")"
    done
  done
done
