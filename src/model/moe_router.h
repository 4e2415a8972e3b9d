// Expert selection of DeepSeek MoE layers (internal; a pure function so it can be tested alone).
#pragma once

#include <cstdint>
#include <vector>

#include "quantmla/config.h"

namespace quantmla {

struct ExpertChoice {
  std::vector<int32_t> experts;  // num_experts_per_tok expert ids
  std::vector<float> weights;    // their mixing weights (scaling applied)
};

// router_logits: [n_routed_experts] for one token; correction_bias: [n_routed_experts] or empty.
// V2 (scoring softmax): greedy or group_limited_greedy (group score = its best expert).
// V3 (scoring sigmoid, noaux_tc): choice on score + bias, group score = sum of its top two, weights
// from the unbiased scores. norm_topk_prob and routed_scaling_factor as transformers applies them.
ExpertChoice route_token(const ModelConfig& config, const float* router_logits,
                         const std::vector<float>& correction_bias);

}  // namespace quantmla
