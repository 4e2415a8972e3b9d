// Calibration: learns the content and RoPE transforms of every layer for a cache format and folds
// them into the model's weights (DESIGN §5-§6). The model keeps its function in full precision;
// only what its cache stores, and so what quantization loses, changes.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "quantmla/cache_format.h"
#include "quantmla/model.h"

namespace quantmla {

struct CalibrationOptions {
  CacheFormat cache;     // the format the transforms are learned for
  int64_t samples = 16;  // training windows
  int64_t held_out = 4;  // held-back windows: model selection and the reported losses
  int64_t seq = 512;     // tokens per window, BOS included
  uint64_t seed = 0;     // window choice and the Hadamard start (seed + layer)
  bool content = true;   // calibrate the content path
  bool rope = true;      // calibrate the RoPE path
  std::string rope_objective = "auto";       // auto | attention | uniform | mse
  std::string content_objective = "output";  // output | mse
  int64_t rope_keys_per_window = 128;        // sampled key positions per window
  // Query positions per window the content output objective sums over (evenly spaced, each
  // attending to all its keys); 0 = all. Keeps long windows affordable: cost m L, not L^2.
  int64_t content_queries_per_window = 512;
  int64_t content_steps = 40;  // Riemannian SGD steps per layer
  int64_t content_batch = 2;   // windows per step
  float content_learning_rate = 0.5f;
  std::vector<int64_t> layers;  // layers to calibrate; empty = all
  // RoPE frequency pairs to keep in BF16 (the format's bf16pairs, chosen here by the QK loss
  // they remove, one choice for all layers); 0 = as the spec says.
  int64_t rope_bf16_pairs = 0;
  // Search the content path's clipping ratio (int codecs; one for all layers); off: the spec's.
  bool search_clip = true;

  // Throws InvalidArgument for settings it cannot work with (nothing to calibrate, unknown
  // objective, a window shorter than 2 tokens, a layer out of range).
  void validate(const ModelConfig& config) const;
};

// Losses are relative: squared error divided by the squared signal, on held-back windows.
struct RopeLayerReport {
  bool calibrated = false;
  std::string objective;                       // the objective whose transform was kept
  double qk_before = 0, qk_after = 0;          // positional QK loss, identity vs learned
  double output_before = 0, output_after = 0;  // attention-output error, exact content
  // Held-back attention-output error of each objective's search result, to compare weightings.
  std::vector<std::pair<std::string, double>> output_by_objective;
  std::vector<float> scales, angles;
};
struct ContentLayerReport {
  bool calibrated = false;
  double loss_identity = 0;  // A = I (round to nearest)
  double loss_start = 0;     // the random Hadamard start
  double loss_final = 0;     // learned
  float delta_exponent_query = 0, delta_exponent_value = 0;
};
struct LayerCalibrationReport {
  int64_t layer = 0;
  RopeLayerReport rope;
  ContentLayerReport content;
  double seconds = 0;
};
struct CalibrationReport {
  CacheFormat cache;  // the calibrated format, with the clipping ratios chosen
  std::vector<LayerCalibrationReport> layers;
  int64_t windows = 0;  // training + held-back
  double capture_seconds = 0;
  double seconds = 0;
};

// stage names what runs ("capture", "layer 3 rope", "layer 3 content"); done of total within it.
using CalibrationProgress =
    std::function<void(const std::string& stage, int64_t done, int64_t total)>;

// Picks samples + held_out windows of `seq` tokens (BOS + seq - 1 text tokens, non-overlapping,
// chosen by seed) from `tokens`, captures every layer's attention inputs in full precision,
// learns the transforms layer by layer and folds them into `model`. Throws InvalidArgument when
// the text is too short for the windows asked for.
CalibrationReport calibrate(Model& model, std::span<const int32_t> tokens,
                            const CalibrationOptions& options,
                            const CalibrationProgress& progress = {});

}  // namespace quantmla
