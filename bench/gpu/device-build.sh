#!/usr/bin/env bash
# On the GPU machine: unpacks the carried Debian dependencies (.carry/deps.tar.xz, and
# .carry/deps-server.tar.xz where carried: scripts/device-deps.sh) and builds TARGETS in
# build-gpu-full with the CUDA runner. Logs to $OUT (or gpu-results); exits non-zero on failure.
#   bash bench/gpu/device-build.sh TARGET...
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-results}
mkdir -p "$out" /tmp/deps
# Without them CMake would configure against whatever the machine has, and that tree, kept on a
# warm machine, once linked objects built against two nlohmann-json versions in the next call.
[[ -f .carry/deps.tar.xz ]] || {
  echo "device-build.sh: .carry/deps.tar.xz is not here: carry it (scripts/device-carry.sh makes it)"
  exit 1
}
for tarball in .carry/deps.tar.xz .carry/deps-server.tar.xz; do
  [[ -f $tarball ]] && tar -xJf $tarball -C /tmp/deps
done
bash bench/gpu/touch-changed-sources.sh build-gpu-full
cmake -S . -B build-gpu-full -G Ninja -DCMAKE_BUILD_TYPE=Release -DQUANTMLA_CUDA=ON \
  -DQUANTMLA_DEPS_ROOT=/tmp/deps -DQUANTMLA_BUILD_TESTS=OFF -DQUANTMLA_BUILD_BENCH=OFF \
  >"$out/configure.txt" 2>&1 || { tail -20 "$out/configure.txt"; exit 1; }
ninja -C build-gpu-full "$@" >"$out/build.txt" 2>&1 ||
  { grep -E "error|Error" -A3 "$out/build.txt" | head -40; exit 1; }
bash bench/gpu/touch-changed-sources.sh build-gpu-full --record
