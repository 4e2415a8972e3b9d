// The error model of DESIGN §4, measured: quantization error injected into one cache path of one
// layer (everything else exact FP32), and what it does to that layer's attention logits, its
// attention output and the model's next-token distribution.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "quantmla/cache_format.h"
#include "quantmla/model.h"

namespace quantmla {

enum class CachePath { kContent, kRope };
const char* to_string(CachePath path);

struct ErrorModelOptions {
  int64_t ctx = 1024;
  int64_t max_windows = 4;                            // 0 = every window
  PathFormat format = PathFormat::parse("int4:g64");  // injected into one path at a time
  std::function<void(int64_t, int64_t)> progress;     // (windows done, windows total)
};

struct Injection {
  int64_t layer = 0;  // -1: the path quantized in every layer at once
  CachePath path = CachePath::kContent;
  // ||x_hat - x|| / ||x|| over the injected rows of the path.
  double cache_rel_error = 0.0;
  // Change of the scaled attention logits (scale * q . k) at the injected layer, over every query,
  // head and visible key: root mean square, and the mean over (query, head) of the largest change
  // over its keys (the eps of the softmax bound). Every-layer rows: mean of the single-layer rows.
  double score_rms_error = 0.0;
  double score_max_error = 0.0;
  // ||o_hat - o|| / ||o|| of the attention output (after W_UV, all heads) at the injected layer.
  // Every-layer rows: the mean over layers, propagation from earlier layers included.
  double attention_rel_error = 0.0;
  // The model's output: mean KL(P_exact || P_injected) per position, and RMS change of the logits.
  double kld_mean = 0.0;
  double logit_rms_error = 0.0;
};

// One row per (layer, path) for every layer and both paths, then one every-layer row per path.
// Throws InvalidArgument for a format the paths cannot take or a text shorter than one window.
std::vector<Injection> measure_error_model(const Model& model, std::span<const int32_t> ids,
                                           const ErrorModelOptions& options);

}  // namespace quantmla
