#!/usr/bin/env bash
# The kernels-only configure (nvcc and CMake, none of the Debian packages) of the current
# directory into BUILD_DIR, with Ninja where the machine has it: one place for run.sh, its
# baseline trees and next-session.sh.
#   bash bench/gpu/configure-kernels.sh BUILD_DIR
set -euo pipefail
[[ $# -eq 1 ]] || { echo "usage: bash bench/gpu/configure-kernels.sh BUILD_DIR" >&2; exit 2; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
exec cmake -S . -B "$1" "${generator[@]}" -DQUANTMLA_CUDA=ON -DQUANTMLA_KERNELS_ONLY=ON \
  -DCMAKE_BUILD_TYPE=Release
