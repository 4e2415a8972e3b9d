#!/usr/bin/env bash
# Packs the Debian build dependencies' headers, CMake files and libraries into .carry/ (ignored
# paths the device tool can carry) for a machine that has compilers and CMake but none of the
# packages (the GPU machine): deps.tar.xz for the engine, deps-server.tar.xz for `quantmla serve`
# (cpp-httplib). There bench/gpu/device-build.sh unpacks them and builds.
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
copy "usr/include/$arch/openblas-openmp"
copy "usr/lib/$arch/libpcre2-8.a"
copy "usr/lib/$arch/openblas-openmp/libopenblas.a"
# OpenBLAS's LAPACK half is Fortran: its runtime, statically.
mkdir -p "$stage/usr/lib/$arch"
cp "/usr/lib/gcc/$arch/12/libgfortran.a" "/usr/lib/gcc/$arch/12/libquadmath.a" "$stage/usr/lib/$arch/"
mkdir -p .carry
tar -C "$stage" -cJf .carry/deps.tar.xz .
# The server's part in a tarball of its own, so that a call that needs no server leaves its room
# to data (the device tool takes 64 MiB of tree and carry together).
rm -rf "$stage" && mkdir -p "$stage"
copy usr/include/httplib.h
# cpp-httplib is a shared library in Debian: it, the headers its header includes, and the
# libraries it loads that a CUDA machine may lack (Brotli, zlib), found there through the
# executable's RPATH. OpenSSL 3 (libssl.so.3, libcrypto.so.3) comes from that machine: the device
# tool's 64 MiB limit leaves no room for it.
copy usr/include/openssl
copy "usr/include/$arch/openssl"
copy usr/include/brotli
copy usr/include/zlib.h
copy usr/include/zconf.h
for lib in libcpp-httplib.so libcpp-httplib.so.0.11 libz.so.1 libbrotlidec.so.1 \
  libbrotlienc.so.1 libbrotlicommon.so.1; do
  copy "usr/lib/$arch/$lib"
done
tar -C "$stage" -cJf .carry/deps-server.tar.xz .
ls -la .carry/deps.tar.xz .carry/deps-server.tar.xz
