#!/usr/bin/env bash
# On the GPU machine, before building in BUILD_DIR: touches every source file whose content
# differs from the one BUILD_DIR was last built from. ninja decides by modification times, and the
# device tool's copy of the tree keeps this machine's: a file patched on the device in one call
# (git apply) and put back by the next call's copy is then older than its object, and ninja would
# link the patched object into the next call's build (it did once: a serving run on 2026-12-05
# ran the previous call's patched kernels). After a successful build, `--record` keeps the
# hashes it was built from.
#   bash bench/gpu/touch-changed-sources.sh BUILD_DIR [--record]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=$1
recorded=$build/source-hashes.txt
current=$(mktemp)
find CMakeLists.txt include src tests bench tools -type f \
  \( -name '*.c*' -o -name '*.h*' -o -name 'CMakeLists.txt' \) -print0 | sort -z |
  xargs -0 sha1sum >"$current"
if [[ ${2:-} == --record ]]; then
  mkdir -p "$build" && mv "$current" "$recorded"
  exit 0
fi
if [[ -f $recorded ]]; then
  # Lines (hash, path) that the last build did not have: new or changed files.
  comm -13 <(sort "$recorded") <(sort "$current") | cut -c43- | xargs -r touch
fi
rm -f "$current"
