#include "model/moe_router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "quantmla/error.h"

namespace quantmla {
namespace {

// Indices of the k largest values; ties go to the lower index (as torch.topk does on CPU).
std::vector<int32_t> top_k(const std::vector<float>& values, int64_t k) {
  std::vector<int32_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return values[a] > values[b]; });
  order.resize(static_cast<size_t>(k));
  return order;
}

// Zeroes every expert outside the topk_group best groups (transformers masks with 0, not -inf).
void mask_to_best_groups(const ModelConfig& config, std::vector<float>& choice_scores,
                         bool sum_top_two) {
  const int64_t group_size = config.n_routed_experts / config.n_group;
  std::vector<float> group_scores(static_cast<size_t>(config.n_group));
  for (int64_t g = 0; g < config.n_group; ++g) {
    std::vector<float> members(choice_scores.begin() + g * group_size,
                               choice_scores.begin() + (g + 1) * group_size);
    std::sort(members.begin(), members.end(), std::greater<>());
    group_scores[g] = sum_top_two && group_size >= 2 ? members[0] + members[1] : members[0];
  }
  std::vector<bool> keep(static_cast<size_t>(config.n_group), false);
  for (int32_t g : top_k(group_scores, config.topk_group)) keep[g] = true;
  for (int64_t e = 0; e < config.n_routed_experts; ++e) {
    if (!keep[e / group_size]) choice_scores[e] = 0.0f;
  }
}

}  // namespace

ExpertChoice route_token(const ModelConfig& config, const float* router_logits,
                         const std::vector<float>& correction_bias) {
  const int64_t n = config.n_routed_experts;
  std::vector<float> scores(router_logits, router_logits + n);
  if (config.scoring_func == "sigmoid") {
    for (float& s : scores) s = 1.0f / (1.0f + std::exp(-s));
  } else if (config.scoring_func == "softmax") {
    const float max_logit = *std::max_element(scores.begin(), scores.end());
    float sum = 0.0f;
    for (float& s : scores) sum += (s = std::exp(s - max_logit));
    for (float& s : scores) s /= sum;
  } else {
    throw InvalidArgument("unsupported scoring_func \"" + config.scoring_func + "\"");
  }

  std::vector<float> choice_scores = scores;
  if (config.topk_method == "noaux_tc") {
    if (!correction_bias.empty()) {
      for (int64_t e = 0; e < n; ++e) choice_scores[e] += correction_bias[e];
    }
    mask_to_best_groups(config, choice_scores, /*sum_top_two=*/true);
  } else if (config.topk_method == "group_limited_greedy") {
    mask_to_best_groups(config, choice_scores, /*sum_top_two=*/false);
  } else if (config.topk_method != "greedy") {
    throw InvalidArgument("unsupported topk_method \"" + config.topk_method + "\"");
  }

  ExpertChoice choice;
  choice.experts = top_k(choice_scores, config.num_experts_per_tok);
  for (int32_t e : choice.experts) choice.weights.push_back(scores[e]);

  const bool is_v3 = config.topk_method == "noaux_tc";
  if (config.norm_topk_prob && (is_v3 || config.num_experts_per_tok > 1)) {
    const float denominator =
        std::accumulate(choice.weights.begin(), choice.weights.end(), 0.0f) + 1e-20f;
    for (float& w : choice.weights) w /= denominator;
  }
  // V3 scales always; the V2 reference code scales only when it does not renormalize.
  if (is_v3 || !config.norm_topk_prob) {
    for (float& w : choice.weights) w *= static_cast<float>(config.routed_scaling_factor);
  }
  return choice;
}

}  // namespace quantmla
