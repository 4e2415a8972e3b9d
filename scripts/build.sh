#!/usr/bin/env bash
# Configures (once) and builds the Release tree in build/.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && [ ! -f build/CMakeCache.txt ] && generator=(-G Ninja)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${generator[@]}" "$@"
cmake --build build -j "$(nproc)"
