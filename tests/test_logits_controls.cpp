// The sampling controls beyond temperature and top-p (logits_controls.h) on fresh random rows:
// each control's arithmetic against its definition, the tokens it removes never drawn, and a row
// without controls drawn exactly as sample_token draws it. The seed is printed
// (QUANTMLA_TEST_SEED=S repeats a run).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "error_matchers.h"
#include "quantmla/error.h"
#include "quantmla/logits_controls.h"
#include "test_seed.h"

namespace quantmla {
namespace {

using testing::error_message;
using testing::expect_contains;

constexpr float kInf = std::numeric_limits<float>::infinity();

std::mt19937_64 seeded_rng() { return std::mt19937_64(testing::test_seed("LogitsControls")); }

std::vector<float> random_row(std::mt19937_64& rng, size_t vocab) {
  std::normal_distribution<float> logit(0.0f, 3.0f);
  std::vector<float> row(vocab);
  for (float& v : row) v = logit(rng);
  return row;
}

double uniform(std::mt19937_64& rng) { return std::uniform_real_distribution<double>(0, 1)(rng); }

TEST(LogitsControls, NeutralControlsDrawAsTheRunnersDo) {
  std::mt19937_64 rng = seeded_rng();
  const LogitsControls neutral;
  EXPECT_FALSE(neutral.active());
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<float> row = random_row(rng, 257);
    const SamplerOptions options{trial % 4 == 0 ? 0.0f : 0.7f, trial % 3 == 0 ? 0.9f : 1.0f, 0};
    const double u = uniform(rng);
    std::vector<float> changed = row;
    apply_logits_controls(changed, neutral, std::vector<int32_t>{1, 2, 3}, std::vector<int32_t>{4},
                          {});
    ASSERT_EQ(changed, row);
    ASSERT_EQ(sample_controlled(changed, options, neutral, u), sample_token(row, options, u))
        << "trial " << trial;
  }
}

TEST(LogitsControls, BiasBansAndPenaltiesFollowTheirDefinitions) {
  std::mt19937_64 rng = seeded_rng();
  const std::vector<float> row = random_row(rng, 64);
  const std::vector<int32_t> prompt = {5, 6, 6, 7};
  const std::vector<int32_t> generated = {7, 8, 8, 8, 9};
  LogitsControls c;
  c.logit_bias = {{5, 2.5f}, {20, -100.0f}};
  c.repetition_penalty = 1.3f;
  c.frequency_penalty = 0.4f;
  c.presence_penalty = -0.25f;
  ASSERT_TRUE(c.active());
  std::vector<float> got = row;
  apply_logits_controls(got, c, prompt, generated, std::vector<int32_t>{30, 31});
  // vLLM's order: biases and bans, then the repetition penalty on every token of the prompt and
  // the output (once each), then frequency and presence on the output's counts.
  const auto repeat = [&](float l) { return l > 0 ? l / 1.3f : l * 1.3f; };
  std::vector<float> want = row;
  want[5] += 2.5f;
  want[20] -= 100.0f;
  want[30] = want[31] = -kInf;
  for (const int32_t t : {5, 6, 7, 8, 9}) want[static_cast<size_t>(t)] = repeat(want[t]);
  const std::pair<int32_t, int> counts[] = {{7, 1}, {8, 3}, {9, 1}};
  for (const auto& [t, n] : counts) want[static_cast<size_t>(t)] -= 0.4f * n - 0.25f;
  for (size_t i = 0; i < row.size(); ++i) EXPECT_EQ(got[i], want[i]) << "token " << i;
}

// top_k and min_p remove tokens; over many draws only the kept ones come, each of them does, and
// at temperature 0 neither changes the greedy choice.
TEST(LogitsControls, TopKAndMinPDrawOnlyTheKeptTokens) {
  std::mt19937_64 rng = seeded_rng();
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> row = random_row(rng, 97);
    const float temperature = 0.5f + static_cast<float>(trial % 4) * 0.4f;
    LogitsControls c;
    c.top_k = 1 + trial % 7;
    c.min_p = trial % 2 == 0 ? 0.0f : 0.05f;
    std::vector<float> sorted = row;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<size_t>(c.top_k - 1)];
    const float floor = sorted[0] + temperature * std::log(c.min_p);  // -inf for min_p 0
    std::set<int32_t> kept;
    for (size_t i = 0; i < row.size(); ++i) {
      if (row[i] >= kth && row[i] >= floor) kept.insert(static_cast<int32_t>(i));
    }
    // Kept tokens of probability above 1% (renormalized over the kept ones) must come in 3000
    // draws (a miss has a chance of e^-30); the others may.
    double mass = 0;
    for (const int32_t t : kept) mass += std::exp((row[t] - sorted[0]) / temperature);
    std::set<int32_t> drawn;
    for (int draw = 0; draw < 3000; ++draw) {
      std::vector<float> work = row;
      drawn.insert(sample_controlled(work, {temperature, 1.0f, 0}, c, uniform(rng)));
    }
    for (const int32_t t : drawn) {
      EXPECT_TRUE(kept.count(t)) << "trial " << trial << ": token " << t << " was removed";
    }
    for (const int32_t t : kept) {
      if (std::exp((row[t] - sorted[0]) / temperature) / mass > 0.01) {
        EXPECT_TRUE(drawn.count(t)) << "trial " << trial << ": kept token " << t << " never drawn";
      }
    }
    std::vector<float> work = row;
    EXPECT_EQ(sample_controlled(work, {0.0f, 1.0f, 0}, c, 0.5),
              std::max_element(row.begin(), row.end()) - row.begin());
  }
}

TEST(LogitsControls, BannedTokensAreNeverDrawnAndTiesAtTheKthAreKept) {
  std::vector<float> row(16, 0.0f);
  row[3] = 5.0f;  // the most likely, banned
  std::vector<float> banned = row;
  apply_logits_controls(banned, {}, {}, {}, std::vector<int32_t>{3});
  LogitsControls top2;
  top2.top_k = 2;
  std::set<int32_t> drawn;
  for (int i = 0; i < 4000; ++i) {
    std::vector<float> work = banned;
    drawn.insert(sample_controlled(work, {1.0f, 1.0f, 0}, top2, (i + 0.5) / 4000));
  }
  // With token 3 gone, the 15 others tie at the second place: all kept, none removed by top_k.
  EXPECT_EQ(drawn.size(), 15u);
  EXPECT_EQ(drawn.count(3), 0u);
  std::vector<float> all_banned(4, 0.0f);
  apply_logits_controls(all_banned, {}, {}, {}, std::vector<int32_t>{0, 1, 2, 3});
  expect_contains(error_message<InvalidArgument>([&] {
                    sample_controlled(all_banned, {1.0f, 1.0f, 0}, {}, 0.5);
                  }),
                  {"every token"});
}

TEST(LogitsControls, OutOfRangeControlsAreRefusedWithTheirValues) {
  const auto refused = [](LogitsControls c, std::initializer_list<std::string> parts) {
    expect_contains(error_message<InvalidArgument>([&] { check_logits_controls(c, 100); }), parts);
  };
  LogitsControls c;
  check_logits_controls(c, 100);
  c.top_k = -1;
  refused(c, {"top_k", "-1"});
  c = {};
  c.min_p = 1.5f;
  refused(c, {"min_p", "1.5"});
  c = {};
  c.presence_penalty = -3.0f;
  refused(c, {"presence_penalty", "-3"});
  c = {};
  c.frequency_penalty = std::nanf("");
  refused(c, {"frequency_penalty"});
  c = {};
  c.repetition_penalty = 0.0f;
  refused(c, {"repetition_penalty", "(0, 100]"});
  c = {};
  c.logit_bias = {{100, 1.0f}};
  refused(c, {"logit_bias", "token 100", "[0, 100)"});
  c = {};
  c.logit_bias = {{4, 150.0f}};
  refused(c, {"logit_bias", "150"});
}

}  // namespace
}  // namespace quantmla
