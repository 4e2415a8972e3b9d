// Expert routing rules, checked on hand-made scores where the right answer is known.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/moe_router.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

ModelConfig v3_config() {
  ModelConfig c;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_group = 4;
  c.topk_group = 2;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5;
  return c;
}

float logit_of(float probability) { return std::log(probability / (1.0f - probability)); }

TEST(MoeRouter, V3GroupLimitedChoiceUsesBiasButWeightsDoNot) {
  ModelConfig c = v3_config();
  // Sigmoid scores; groups are experts {0,1} {2,3} {4,5} {6,7}.
  const std::vector<float> scores = {0.9f, 0.1f, 0.45f, 0.45f, 0.2f, 0.2f, 0.8f, 0.3f};
  std::vector<float> logits;
  for (float s : scores) logits.push_back(logit_of(s));
  // Group sums of top two: 1.0, 0.9, 0.4, 1.1 -> groups 3 and 0.
  // Best experts inside groups {0,1,6,7}: 0 (0.9) and 6 (0.8).
  const ExpertChoice plain = route_token(c, logits.data(), {});
  ASSERT_EQ(plain.experts.size(), 2u);
  EXPECT_EQ(plain.experts[0], 0);
  EXPECT_EQ(plain.experts[1], 6);
  EXPECT_NEAR(plain.weights[0], 2.5f * 0.9f / 1.7f, 1e-5f);
  EXPECT_NEAR(plain.weights[1], 2.5f * 0.8f / 1.7f, 1e-5f);

  // A bias on expert 4 lifts its group (1.4) above group 0, and 4 above 6: the choice changes,
  // but the weights still come from the unbiased sigmoid scores (0.2 and 0.8).
  std::vector<float> bias(8, 0.0f);
  bias[4] = 1.0f;
  const ExpertChoice biased = route_token(c, logits.data(), bias);
  EXPECT_EQ(biased.experts, (std::vector<int32_t>{4, 6}));
  EXPECT_NEAR(biased.weights[0], 2.5f * 0.2f / 1.0f, 1e-5f);
  EXPECT_NEAR(biased.weights[1], 2.5f * 0.8f / 1.0f, 1e-5f);
}

TEST(MoeRouter, V2GreedySoftmaxScalesWithoutRenormalizing) {
  ModelConfig c;
  c.n_routed_experts = 4;
  c.num_experts_per_tok = 2;
  c.scoring_func = "softmax";
  c.topk_method = "greedy";
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 16.0;
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, -1.0f};
  const ExpertChoice choice = route_token(c, logits.data(), {});
  double sum = 0;
  for (float l : logits) sum += std::exp(l);
  EXPECT_EQ(choice.experts, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(choice.weights[0], 16.0 * std::exp(2.0) / sum, 1e-4);
  EXPECT_NEAR(choice.weights[1], 16.0 * std::exp(1.0) / sum, 1e-4);
}

TEST(MoeRouter, V2GroupLimitedGreedyUsesGroupMaximum) {
  ModelConfig c;
  c.n_routed_experts = 6;
  c.num_experts_per_tok = 2;
  c.n_group = 3;
  c.topk_group = 1;
  c.scoring_func = "softmax";
  c.topk_method = "group_limited_greedy";
  c.norm_topk_prob = true;
  // Group maxima: group 0 = 1.0, group 1 = 3.0, group 2 = 2.5: only group 1 survives.
  const std::vector<float> logits = {1.0f, 0.5f, 3.0f, -2.0f, 2.5f, 2.4f};
  const ExpertChoice choice = route_token(c, logits.data(), {});
  EXPECT_EQ(choice.experts, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(choice.weights[0] + choice.weights[1], 1.0f, 1e-5f);  // renormalized, not scaled
}

TEST(MoeRouter, UnknownMethodIsAnError) {
  ModelConfig c = v3_config();
  c.topk_method = "random";
  const std::vector<float> logits(8, 0.0f);
  EXPECT_THROW(route_token(c, logits.data(), {}), InvalidArgument);
}

}  // namespace
}  // namespace quantmla
