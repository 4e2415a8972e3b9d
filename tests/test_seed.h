// Random test inputs: a fresh seed every run, printed beside the test's name so that a failure
// can be replayed with QUANTMLA_TEST_SEED=S.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace quantmla::testing {

inline uint64_t test_seed(const char* test) {
  const char* fixed = std::getenv("QUANTMLA_TEST_SEED");
  const uint64_t seed =
      fixed != nullptr ? std::strtoull(fixed, nullptr, 10) : uint64_t{std::random_device{}()};
  std::printf("%s: seed %llu (replay with QUANTMLA_TEST_SEED=%llu)\n", test,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

}  // namespace quantmla::testing
