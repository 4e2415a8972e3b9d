// The frame the GPU check programs share (no GoogleTest: they build on GPU machines without the
// Debian packages): the counts of checks and failures, expect and expect_throws, the run's random
// engine, and main's handling of --seed S, of a missing device (exit status 77, which ctest
// reports as skipped) and of the summary line.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "quantmla/gpu_mla.h"

namespace quantmla::gpu_checks {

inline int failures = 0;
inline int checks = 0;
inline std::mt19937_64 rng;  // seeded by run(): fresh inputs each run, the seed printed

inline void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// f() throws E; a pass prints the message, so that the log shows what a user would read.
template <class E, class F>
void expect_throws(const std::string& what, F&& f) {
  try {
    f();
  } catch (const E& e) {
    std::printf("refused as expected (%s): %s\n", what.c_str(), e.what());
    ++checks;
    return;
  } catch (const std::exception& e) {
    expect(false, what + ": threw the wrong error: " + e.what());
    return;
  }
  expect(false, what + ": did not throw");
}

// A check program's main: --seed S (else a random seed) and the program's own switches (each
// sets its bool), exit 77 without a device, the seed printed, `body` run (an exception is a
// failure), the summary printed. Returns the exit status: 0 all checks passed, 1 one failed, 2 a
// bad flag.
inline int run(int argc, char** argv, const std::function<void()>& body,
               const std::vector<std::pair<const char*, bool*>>& switches = {}) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash keeps every line printed before it
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    bool known = false;
    for (const auto& [name, value] : switches) {
      if (std::strcmp(argv[i], name) == 0) *value = known = true;
    }
    if (known) continue;
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = std::stoull(argv[++i]);
      continue;
    }
    std::string usage = std::string("usage: ") + argv[0];
    for (const auto& [name, value] : switches) usage += std::string(" [") + name + "]";
    std::fprintf(stderr, "%s [--seed S]\n", usage.c_str());
    return 2;
  }
  if (!gpu::device_available()) {
    std::printf("no CUDA device: GPU tests skipped\n");
    return 77;
  }
  rng.seed(seed);
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace quantmla::gpu_checks
