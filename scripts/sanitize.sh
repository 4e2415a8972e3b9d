#!/usr/bin/env bash
# The test suite under the sanitizers, for what CI's Release build cannot see:
#   bash scripts/sanitize.sh [CTEST_ARGS...]           AddressSanitizer (leaks included) and
#       UndefinedBehaviorSanitizer in build-asan/, the whole suite by default: memory errors,
#       leaks and undefined behaviour anywhere the tests reach, the CLI and the server included
#       (their tests run the sanitized binaries). ~10 minutes to build, 11 of tests on 2 cores.
#   SANITIZER=thread bash scripts/sanitize.sh [CTEST_ARGS...]   ThreadSanitizer in build-tsan/,
#       by default the tests of the threaded parts (the serving engine, the server, its online
#       benchmark client), with one OpenMP thread (libgomp is not instrumented) and
#       tests/tsan.supp (neither is Debian's cpp-httplib).
# Not part of CI (its time); run it after changes to parsers, the server, the engine's threads or
# anything that owns memory. E.g. -R 'ChatTemplate|Server' runs a part.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${SANITIZER:-address} == thread ]]; then
  build=build-tsan flags="-fsanitize=thread"
  (($# > 0)) || set -- -R 'Server|ServingEngine|Scheduler'
  export OMP_NUM_THREADS=1 TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp second_deadlock_stack=1"
else
  build=build-asan flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
  export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
fi
flags="$flags -fno-omit-frame-pointer"
generator=()
command -v ninja >/dev/null && [ ! -f $build/CMakeCache.txt ] && generator=(-G Ninja)
cmake -S . -B $build "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="-O1 -g $flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
cmake --build $build -j "$(nproc)"
ctest --test-dir $build --output-on-failure -j "$(nproc)" --timeout 1800 "$@"
