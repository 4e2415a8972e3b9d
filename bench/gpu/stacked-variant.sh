#!/usr/bin/env bash
# A stacked patch's variant as a whole patch against HEAD, for `next-session.sh 7`, which applies
# each carried patch to main alone: the waiting patches (bench/gpu/patches/*.diff) applied to a
# copy of HEAD, the stacked patch reversed from it (as scripts/test.sh checks), the difference
# printed.
#   bash bench/gpu/stacked-variant.sh bench/gpu/patches/stacked/NAME.diff > .carry/patches/NAME.diff
set -euo pipefail
cd "$(dirname "$0")/../.."
stacked=$(realpath "${1:?usage: stacked-variant.sh bench/gpu/patches/stacked/NAME.diff}")
patches=("$PWD"/bench/gpu/patches/*.diff)
tree=$(mktemp -d)
trap 'git worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"' EXIT
git worktree add --detach --quiet "$tree" HEAD
cd "$tree"
for patch in "${patches[@]}"; do
  [[ -e $patch ]] && git apply "$patch"
done
git apply -R "$stacked"
git diff
