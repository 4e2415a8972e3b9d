#!/usr/bin/env bash
# Builds the CPU tree with AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer in
# build-asan/ and runs the whole test suite on it: memory errors, leaks and undefined behaviour
# anywhere the tests reach, the CLI and the server included (their tests run the sanitized
# binaries). Not part of CI (about 10 minutes to build and 11 of tests on 2 cores); run it
# after changes to parsers, the server or anything that owns memory.
#   bash scripts/sanitize.sh [CTEST_ARGS...]      e.g. -R 'ChatTemplate|Server'
set -euo pipefail
cd "$(dirname "$0")/.."
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
generator=()
command -v ninja >/dev/null && [ ! -f build-asan/CMakeCache.txt ] && generator=(-G Ninja)
cmake -S . -B build-asan "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS="-O1 -g $flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
  -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
cmake --build build-asan -j "$(nproc)"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
ctest --test-dir build-asan --output-on-failure -j "$(nproc)" --timeout 1800 "$@"
