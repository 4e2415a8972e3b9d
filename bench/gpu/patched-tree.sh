#!/usr/bin/env bash
# A copy of this tree with a diff applied (with -R: reversed) in DEST, so that a kernel change is
# built and timed beside its base in one device call: bench/gpu/run.sh (BASELINE_DIFF, the tree
# without the change) and next-session.sh 7 (the tree with it). Build outputs (build*) are left out.
#   bash bench/gpu/patched-tree.sh [-R] DIFF DEST
set -euo pipefail
reverse=()
[[ ${1:-} == -R ]] && { reverse=(-R); shift; }
(($# == 2)) || { echo "usage: bash bench/gpu/patched-tree.sh [-R] DIFF DEST" >&2; exit 2; }
[[ -f $1 ]] || { echo "patched-tree.sh: $1: no such file" >&2; exit 2; }
diff_file=$(realpath "$1")
mkdir -p "$2"
dest=$(realpath "$2")
cd "$(dirname "$0")/../.."
tar -c --exclude='./build*' . | tar -x -C "$dest"
patch "${reverse[@]}" -p1 -d "$dest" <"$diff_file" >/dev/null ||
  { echo "patched-tree.sh: $diff_file does not apply${reverse:+ reversed} to this tree" >&2; exit 1; }
