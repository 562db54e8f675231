#!/usr/bin/env bash
# Prints which tree a device call ran: HEAD's commit line and the files that differ from it,
# untracked ones too. A device call carries the working tree, whose git metadata may lag it (a HEAD
# before the edits that ran), so HEAD alone does not name the code. The device scripts write it
# beside their results, for the record in docs/PERF.md.
#   scripts/tree_state.sh [DIR]   (default: this checkout)
root=${1:-$(dirname "$0")/..}
git -C "$root" log --oneline -1 2>/dev/null || echo "HEAD: unknown (no git metadata)"
git -C "$root" status --short 2>/dev/null
