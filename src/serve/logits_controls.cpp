#include "quantmla/logits_controls.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <unordered_map>

#include "quantmla/error.h"

namespace quantmla {
namespace {

std::string str(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

void check_range(const char* name, double value, double low, double high) {
  if (!(value >= low && value <= high)) {
    throw InvalidArgument(std::string(name) + " is " + str(value) + ", expected a value in [" +
                          str(low) + ", " + str(high) + "]");
  }
}

constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

}  // namespace

bool LogitsControls::active() const {
  return top_k != 0 || min_p != 0.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
         repetition_penalty != 1.0f || !logit_bias.empty();
}

void check_logits_controls(const LogitsControls& controls, int64_t vocab_size) {
  if (controls.top_k < 0) {
    throw InvalidArgument("top_k is " + std::to_string(controls.top_k) +
                          ", expected >= 0 (0: all)");
  }
  check_range("min_p", controls.min_p, 0.0, 1.0);
  check_range("presence_penalty", controls.presence_penalty, -2.0, 2.0);
  check_range("frequency_penalty", controls.frequency_penalty, -2.0, 2.0);
  if (!(controls.repetition_penalty > 0.0f && controls.repetition_penalty <= 100.0f)) {
    throw InvalidArgument("repetition_penalty is " + str(controls.repetition_penalty) +
                          ", expected a value in (0, 100] (1: none)");
  }
  for (const auto& [token, bias] : controls.logit_bias) {
    if (token < 0 || token >= vocab_size) {
      throw InvalidArgument("logit_bias: token " + std::to_string(token) +
                            " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    }
    check_range("logit_bias", bias, -100.0, 100.0);
  }
}

void apply_logits_controls(std::span<float> logits, const LogitsControls& controls,
                           std::span<const int32_t> prompt, std::span<const int32_t> generated,
                           std::span<const int32_t> banned) {
  for (const auto& [token, bias] : controls.logit_bias) logits[static_cast<size_t>(token)] += bias;
  for (const int32_t token : banned) logits[static_cast<size_t>(token)] = kMinusInfinity;
  if (controls.repetition_penalty != 1.0f) {
    // Each token of the prompt or the output once, however often it occurs.
    std::vector<bool> seen(logits.size(), false);
    const float penalty = controls.repetition_penalty;
    for (const auto tokens : {prompt, generated}) {
      for (const int32_t token : tokens) {
        const size_t t = static_cast<size_t>(token);
        if (seen[t]) continue;
        seen[t] = true;
        logits[t] = logits[t] > 0.0f ? logits[t] / penalty : logits[t] * penalty;
      }
    }
  }
  if (controls.frequency_penalty != 0.0f || controls.presence_penalty != 0.0f) {
    std::unordered_map<int32_t, int64_t> counts;
    for (const int32_t token : generated) ++counts[token];
    for (const auto& [token, count] : counts) {
      logits[static_cast<size_t>(token)] -=
          controls.frequency_penalty * static_cast<float>(count) + controls.presence_penalty;
    }
  }
}

int32_t sample_controlled(std::span<float> logits, const SamplerOptions& options,
                          const LogitsControls& controls, double uniform) {
  if (options.temperature > 0.0f) {
    const float best = *std::max_element(logits.begin(), logits.end());
    // min_p: p_i < min_p p_max, that is (l_i - l_max) / T < log(min_p).
    if (controls.min_p > 0.0f) {
      const float floor = best + options.temperature * std::log(controls.min_p);
      for (float& l : logits) {
        if (l < floor) l = kMinusInfinity;
      }
    }
    if (controls.top_k > 0 && static_cast<size_t>(controls.top_k) < logits.size()) {
      std::vector<float> sorted(logits.begin(), logits.end());
      std::nth_element(sorted.begin(), sorted.begin() + (controls.top_k - 1), sorted.end(),
                       std::greater<float>());
      const float kth = sorted[static_cast<size_t>(controls.top_k - 1)];
      for (float& l : logits) {
        if (l < kth) l = kMinusInfinity;
      }
    }
  }
  // The tokens left, in id order (greedy's lowest id on ties stays the lowest): the draw runs
  // over them alone, so a removed token can never be drawn, whatever the rounding of the sums.
  std::vector<int32_t> ids;
  std::vector<float> kept;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] == kMinusInfinity) continue;
    ids.push_back(static_cast<int32_t>(i));
    kept.push_back(logits[i]);
  }
  if (ids.empty()) throw InvalidArgument("sampling: every token of the vocabulary is excluded");
  return ids[static_cast<size_t>(sample_token(kept, options, uniform))];
}

int32_t draw_with_controls(std::span<const float> logits, const SamplerOptions& options,
                           const LogitsControls& controls, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated, std::span<const int32_t> banned,
                           double uniform, std::vector<float>& work) {
  work.assign(logits.begin(), logits.end());
  apply_logits_controls(work, controls, prompt, generated, banned);
  return sample_controlled(work, options, controls, uniform);
}

}  // namespace quantmla
