#!/usr/bin/env bash
# A waiting change as a whole patch against HEAD, for `next-session.sh 7` and `15`, which apply
# each carried patch to main alone:
# - a stacked patch (bench/gpu/patches/stacked/NAME.diff, a variant of the waiting patches): the
#   waiting patches (bench/gpu/patches/*.diff) applied to a copy of HEAD, the stacked patch
#   reversed from it (as scripts/test.sh checks), the difference printed;
# - a waiting patch that sits on the ones before it in name order (bench/gpu/patches/NAME.diff,
#   whose README entry says so): those patches and it applied to a copy of HEAD, the difference
#   printed.
#   bash bench/gpu/stacked-variant.sh bench/gpu/patches/[stacked/]NAME.diff > .carry/patches/NAME.diff
set -euo pipefail
cd "$(dirname "$0")/../.."
chosen=$(realpath "${1:?usage: stacked-variant.sh bench/gpu/patches/[stacked/]NAME.diff}")
patches=("$PWD"/bench/gpu/patches/*.diff)
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"' EXIT
git worktree add --detach --quiet "$tree" HEAD
cd "$tree"
for patch in "${patches[@]}"; do
  [[ -e $patch ]] && git apply "$patch"
  [[ $(realpath "$patch") == "$chosen" ]] && { git diff; exit 0; }
done
git apply -R "$chosen"
git diff
