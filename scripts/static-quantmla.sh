#!/usr/bin/env bash
# Links a fully static `quantmla` from a CMake build directory, for machines that lack the
# Debian libraries (the GPU machine of scripts/device-calibration.sh). Writes OUT (default
# .carry/quantmla.xz, an ignored path the device tool can carry), xz-compressed.
# Usage: scripts/static-quantmla.sh [BUILD_DIR] [OUT]
set -euo pipefail
build=${1:-build} out=${2:-.carry/quantmla.xz}
ninja -C "$build" quantmla >/dev/null
objects=$(find "$build/CMakeFiles/quantmla.dir" -name '*.o' | sort)
arch=$(gcc -dumpmachine)
g++ -O2 -static -o "$build/quantmla-static" $objects "$build/libquantmla.a" "$build/libquantmla_formats.a" \
  /usr/lib/gcc/"$arch"/12/libgomp.a /usr/lib/"$arch"/libpcre2-8.a \
  /usr/lib/"$arch"/openblas-openmp/libopenblas.a -lgfortran -lquadmath -lpthread -lm
strip "$build/quantmla-static"
mkdir -p "$(dirname "$out")"
xz -T2 -6 -c "$build/quantmla-static" >"$out"
ls -la "$out"
