# shellcheck shell=bash
# Sourced by the device scripts that run several commands in one device call (device_goals.sh,
# device_multigpu.sh) with their arguments: takes OUT_DIR, moves to the checkout's root, records the
# GPU (gpu.txt) and the tree that ran (tree.txt) in OUT_DIR, and defines
#   elapsed                      seconds since the script started
#   run NAME LIMIT_S COMMAND...  COMMAND under a time limit, its stdout to NAME.txt and stderr to
#                                NAME.err in OUT_DIR; prints its exit status, its last TAIL lines
#                                (default 20) and, where it failed, the end of its stderr
# Each command has its own limit, so a slow one costs its own rows, not the call's.
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
run() {
  local name=$1 limit=$2 status
  shift 2
  echo "[$(elapsed) s] $name: $*"
  timeout "$limit" "$@" >"$out/$name.txt" 2>"$out/$name.err"
  status=$?
  echo "  exit status $status"
  tail -n "${TAIL:-20}" "$out/$name.txt"
  [ "$status" -eq 0 ] || tail -n 3 "$out/$name.err"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
scripts/tree_state.sh | tee "$out/tree.txt"
