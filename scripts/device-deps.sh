#!/usr/bin/env bash
# Packs the Debian build dependencies' headers, CMake files and static libraries into
# .carry/deps.tar.xz (an ignored path the device tool can carry) for a machine that has compilers
# and CMake but none of the packages (the GPU machine). There:
#   mkdir -p /tmp/deps && tar -xJf .carry/deps.tar.xz -C /tmp/deps
#   cmake -S . -B build-gpu -DQUANTMLA_CUDA=ON -DQUANTMLA_DEPS_ROOT=/tmp/deps \
#     -DQUANTMLA_BUILD_TESTS=OFF -DQUANTMLA_BUILD_BENCH=OFF
# Needs the packages installed here (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
arch=$(gcc -dumpmachine)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
copy() { mkdir -p "$stage/$(dirname "$1")" && cp -rL "/$1" "$stage/$1"; }
copy usr/include/nlohmann
copy usr/share/cmake/nlohmann_json
copy usr/include/CLI
copy usr/share/cmake/CLI11
copy usr/include/pcre2.h
copy usr/include/httplib.h
copy "usr/include/$arch/openblas-openmp"
copy "usr/lib/$arch/libpcre2-8.a"
copy "usr/lib/$arch/openblas-openmp/libopenblas.a"
# OpenBLAS's LAPACK half is Fortran: its runtime, statically.
mkdir -p "$stage/usr/lib/$arch"
cp "/usr/lib/gcc/$arch/12/libgfortran.a" "/usr/lib/gcc/$arch/12/libquadmath.a" "$stage/usr/lib/$arch/"
mkdir -p .carry
tar -C "$stage" -cJf .carry/deps.tar.xz .
ls -la .carry/deps.tar.xz
