#include "quantmla/calibrate.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <random>

#include "calib/content_learn.h"
#include "calib/layer_data.h"
#include "calib/rope_search.h"
#include "quantmla/error.h"
#include "quantmla/transform.h"

namespace quantmla {
namespace {

using calib::ContentObjective;
using calib::ContentTarget;
using calib::ContentWindows;
using calib::LayerGeometry;
using calib::LayerWindow;
using calib::RopeObjective;

bool is_quantized(const PathFormat& format) {
  return format.codec != Codec::kF32 && format.codec != Codec::kBF16;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Windows of BOS + (seq - 1) text tokens, from non-overlapping chunks chosen by seed.
std::vector<std::vector<int32_t>> pick_windows(const ModelConfig& config,
                                               std::span<const int32_t> tokens,
                                               const CalibrationOptions& options) {
  const int64_t body = options.seq - 1;
  const int64_t chunks = static_cast<int64_t>(tokens.size()) / body;
  const int64_t wanted = options.samples + options.held_out;
  if (chunks < wanted) {
    throw InvalidArgument("calibration text has " + std::to_string(tokens.size()) +
                          " tokens: room for " + std::to_string(chunks) + " windows of " +
                          std::to_string(options.seq) + ", need " + std::to_string(wanted) +
                          " (--samples " + std::to_string(options.samples) + " + " +
                          std::to_string(options.held_out) + " held back)");
  }
  std::vector<int64_t> order(static_cast<size_t>(chunks));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(options.seed);
  for (int64_t i = 0; i < wanted; ++i) {  // partial Fisher-Yates: the first `wanted` are chosen
    std::uniform_int_distribution<int64_t> pick(i, chunks - 1);
    std::swap(order[i], order[pick(rng)]);
  }
  std::vector<std::vector<int32_t>> windows;
  for (int64_t i = 0; i < wanted; ++i) {
    std::vector<int32_t> window{static_cast<int32_t>(config.bos_token_id)};
    const auto first = tokens.begin() + order[i] * body;
    window.insert(window.end(), first, first + body);
    windows.push_back(std::move(window));
  }
  return windows;
}

std::vector<float> quantized_rope_keys(const PathFormat& format, const RopeTransform& transform,
                                       const LayerWindow& window, int64_t rope_dim) {
  std::vector<float> keys(window.rope_keys.size());
  calib::quantize_rope_keys(format, transform, window.rope_keys.data(), window.length, rope_dim,
                            keys.data());
  return keys;
}

// Attention-output error of the held-back windows with exact content and the RoPE keys stored
// through `transform`: what the RoPE path alone costs downstream. `targets` hold each window's
// exact outputs (computed once per layer); only the keys attention reads are replaced here.
double rope_output_loss(const PathFormat& format, const RopeTransform& transform,
                        const LayerGeometry& geometry, std::span<const LayerWindow> windows,
                        std::vector<ContentTarget>& targets) {
  double loss = 0.0, signal = 0.0;
  for (size_t w = 0; w < windows.size(); ++w) {
    const LayerWindow& window = windows[w];
    targets[w].rope_keys = quantized_rope_keys(format, transform, window, geometry.rope_dim);
    loss += calib::content_loss(ContentObjective::kOutput, window, geometry, targets[w],
                                window.latents.data(), nullptr);
    signal += targets[w].signal;
  }
  return loss / signal;
}

// Content clipping ratios tried (one per path: the format has one). The RoPE path gets none: its
// per-pair scales already trade range for resolution, and a search over 1.0 / 0.95 / 0.9 on top
// of them kept 1.0 on mla-tiny while tripling the RoPE search time.
constexpr float kContentClips[] = {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f, 0.7f};

// Greedily, the pairs whose keeping in BF16 lowers the summed QK loss of every layer the most
// (identity transform): one model-wide choice, since the format is one for all layers.
std::vector<int> choose_bf16_pairs(const std::vector<calib::RopeProblem>& problems,
                                   const PathFormat& base, int64_t count,
                                   const CalibrationProgress& progress) {
  const int64_t pairs = problems.front().rope_dim / 2;
  if (count > pairs) {
    throw InvalidArgument("cannot keep " + std::to_string(count) +
                          " RoPE pairs in BF16: the key has " + std::to_string(pairs));
  }
  const RopeTransform identity = calib::identity_rope_transform(problems.front().rope_dim);
  PathFormat format = base;
  for (int64_t round = 0; round < count; ++round) {
    int best_pair = -1;
    double best_loss = std::numeric_limits<double>::infinity();
    for (int pair = 0; pair < pairs; ++pair) {
      if (std::find(format.bf16_pairs.begin(), format.bf16_pairs.end(), pair) !=
          format.bf16_pairs.end()) {
        continue;
      }
      PathFormat candidate = format;
      candidate.bf16_pairs.push_back(pair);
      std::sort(candidate.bf16_pairs.begin(), candidate.bf16_pairs.end());
      double loss = 0.0;
      for (const calib::RopeProblem& problem : problems) {
        loss += calib::rope_loss(problem, candidate, identity);
      }
      if (loss < best_loss) best_loss = loss, best_pair = pair;
      if (progress) progress("rope bf16 pairs", round * pairs + pair + 1, count * pairs);
    }
    format.bf16_pairs.push_back(best_pair);
    std::sort(format.bf16_pairs.begin(), format.bf16_pairs.end());
  }
  return format.bf16_pairs;
}

RopeObjective parse_rope_objective(const std::string& name) {
  if (name == "attention") return RopeObjective::kAttention;
  if (name == "uniform") return RopeObjective::kUniform;
  return RopeObjective::kMse;
}

RopeTransform calibrate_rope(const CalibrationOptions& options, const PathFormat& format,
                             const LayerGeometry& geometry, std::span<const LayerWindow> train,
                             std::span<const LayerWindow> held_out, int64_t layer,
                             RopeLayerReport& report, const CalibrationProgress& progress) {
  std::vector<RopeObjective> objectives;
  if (options.rope_objective == "auto") {
    objectives = {RopeObjective::kAttention, RopeObjective::kUniform};
  } else {
    objectives = {parse_rope_objective(options.rope_objective)};
  }
  const std::string stage = "layer " + std::to_string(layer) + " rope";
  const RopeTransform identity = calib::identity_rope_transform(geometry.rope_dim);
  RopeTransform best = identity;
  RopeObjective best_objective = objectives.front();
  std::vector<ContentTarget> held_targets;
  for (const LayerWindow& window : held_out) {
    held_targets.push_back(calib::make_content_target(ContentObjective::kOutput, window, geometry,
                                                      window.rope_keys.data(),
                                                      options.content_queries_per_window));
  }
  report.output_before = rope_output_loss(format, identity, geometry, held_out, held_targets);
  report.output_after = report.output_before;
  report.objective = "none (no candidate beat the identity)";
  for (size_t k = 0; k < objectives.size(); ++k) {
    const calib::RopeProblem problem =
        calib::build_rope_problem(train, geometry, objectives[k], options.rope_keys_per_window);
    const RopeTransform found =
        calib::search_rope_transform(problem, format, [&](int64_t done, int64_t total) {
          if (progress) {
            progress(stage, static_cast<int64_t>(k) * total + done,
                     static_cast<int64_t>(objectives.size()) * total);
          }
        });
    // Candidates compete on the function they serve: the held-back attention output.
    const double output = rope_output_loss(format, found, geometry, held_out, held_targets);
    report.output_by_objective.emplace_back(calib::to_string(objectives[k]), output);
    if (output < report.output_after) {
      report.objective = calib::to_string(objectives[k]);
      report.output_after = output;
      best = found;
      best_objective = objectives[k];
    }
  }
  const calib::RopeProblem held =
      calib::build_rope_problem(held_out, geometry, best_objective, options.rope_keys_per_window);
  report.qk_before = calib::rope_loss(held, format, identity);
  report.qk_after = calib::rope_loss(held, format, best);
  report.calibrated = true;
  report.scales = best.scales;
  report.angles = best.angles;
  return best;
}

}  // namespace

void CalibrationOptions::validate(const ModelConfig& config) const {
  const bool content_work = content && is_quantized(cache.content);
  const bool rope_work = rope && is_quantized(cache.rope);
  if (!content_work && !rope_work) {
    throw InvalidArgument("nothing to calibrate: cache " + cache.to_string() + " with paths" +
                          std::string(content ? " content" : "") +
                          std::string(rope ? " rope" : "") +
                          " (a calibrated path needs an int8/int4/int2/fp8/q8_0/q4_0 format)");
  }
  if (rope_objective != "auto" && rope_objective != "attention" && rope_objective != "uniform" &&
      rope_objective != "mse") {
    throw InvalidArgument("unknown RoPE objective '" + rope_objective +
                          "' (auto, attention, uniform, mse)");
  }
  if (content_objective != "output" && content_objective != "mse") {
    throw InvalidArgument("unknown content objective '" + content_objective + "' (output, mse)");
  }
  if (seq < 2 || seq > config.max_position_embeddings) {
    throw InvalidArgument("calibration window of " + std::to_string(seq) + " tokens outside [2, " +
                          std::to_string(config.max_position_embeddings) + "]");
  }
  if (samples < 1 || held_out < 1) {
    throw InvalidArgument("calibration needs at least one training and one held-back window (" +
                          std::to_string(samples) + ", " + std::to_string(held_out) + ")");
  }
  if (rope_keys_per_window < 0 || content_queries_per_window < 0) {
    throw InvalidArgument("sampled RoPE keys (" + std::to_string(rope_keys_per_window) +
                          ") and content queries (" + std::to_string(content_queries_per_window) +
                          ") per window must be >= 0 (0 = all)");
  }
  for (int64_t layer : layers) {
    if (layer < 0 || layer >= config.num_layers) {
      throw InvalidArgument("layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(config.num_layers) + ")");
    }
  }
}

CalibrationReport calibrate(Model& model, std::span<const int32_t> tokens,
                            const CalibrationOptions& options,
                            const CalibrationProgress& progress) {
  const ModelConfig& config = model.config();
  options.validate(config);
  const auto start = std::chrono::steady_clock::now();
  CalibrationReport report;

  const std::vector<std::vector<int32_t>> windows = pick_windows(config, tokens, options);
  report.windows = static_cast<int64_t>(windows.size());
  std::vector<std::vector<LayerWindow>> captured =
      calib::capture_windows(model, windows, [&](int64_t done, int64_t total) {
        if (progress) progress("capture", done, total);
      });
  report.capture_seconds = seconds_since(start);

  std::vector<int64_t> layers = options.layers;
  if (layers.empty()) {
    layers.resize(static_cast<size_t>(config.num_layers));
    std::iota(layers.begin(), layers.end(), 0);
  }
  const ContentObjective content_objective =
      options.content_objective == "mse" ? ContentObjective::kMse : ContentObjective::kOutput;
  const int64_t count = static_cast<int64_t>(layers.size());
  std::vector<LayerGeometry> geometry;
  for (int64_t layer : layers) geometry.push_back(calib::layer_geometry(model, layer));
  const auto train_of = [&](int64_t k) {
    return std::span<const LayerWindow>(captured[layers[k]]).first(options.samples);
  };
  const auto held_of = [&](int64_t k) {
    return std::span<const LayerWindow>(captured[layers[k]]).subspan(options.samples);
  };
  report.cache = options.cache;
  report.layers.resize(static_cast<size_t>(count));
  for (int64_t k = 0; k < count; ++k) report.layers[k].layer = layers[k];
  const auto timed = [&](int64_t k, auto&& work) {
    const auto layer_start = std::chrono::steady_clock::now();
    work();
    report.layers[k].seconds += seconds_since(layer_start);
  };

  // RoPE path, every layer (with the BF16 pairs chosen first when asked for).
  std::vector<RopeTransform> rope(static_cast<size_t>(count),
                                  calib::identity_rope_transform(config.qk_rope_head_dim));
  if (options.rope && is_quantized(options.cache.rope)) {
    if (options.rope_bf16_pairs > 0) {
      std::vector<calib::RopeProblem> problems;
      for (int64_t k = 0; k < count; ++k) {
        timed(k, [&] {
          problems.push_back(calib::build_rope_problem(
              train_of(k), geometry[k], RopeObjective::kAttention, options.rope_keys_per_window));
        });
      }
      report.cache.rope.bf16_pairs =
          choose_bf16_pairs(problems, report.cache.rope, options.rope_bf16_pairs, progress);
    }
    for (int64_t k = 0; k < count; ++k) {
      timed(k, [&] {
        rope[k] = calibrate_rope(options, report.cache.rope, geometry[k], train_of(k), held_of(k),
                                 layers[k], report.layers[k].rope, progress);
      });
    }
  }

  // Content path, with the RoPE path in its final quantized state: the clipping ratio is chosen
  // on the start transforms (all layers), then each layer's rotation is trained.
  if (options.content && is_quantized(options.cache.content)) {
    std::vector<std::vector<ContentTarget>> train_targets(count), held_targets(count);
    std::vector<ContentTransform> starts;
    for (int64_t k = 0; k < count; ++k) {
      timed(k, [&] {
        const auto targets_for = [&](std::span<const LayerWindow> set) {
          std::vector<ContentTarget> targets;
          for (const LayerWindow& window : set) {
            const std::vector<float> keys =
                quantized_rope_keys(report.cache.rope, rope[k], window, geometry[k].rope_dim);
            targets.push_back(calib::make_content_target(content_objective, window, geometry[k],
                                                         keys.data(),
                                                         options.content_queries_per_window));
          }
          return targets;
        };
        train_targets[k] = targets_for(train_of(k));
        held_targets[k] = targets_for(held_of(k));
      });
      starts.push_back(random_hadamard(geometry[k].rank, options.seed + layers[k]));
    }
    const bool clips_int = options.cache.content.codec == Codec::kInt8 ||
                           options.cache.content.codec == Codec::kInt4 ||
                           options.cache.content.codec == Codec::kInt2;
    const std::vector<float> clips =
        options.search_clip && clips_int
            ? std::vector<float>(std::begin(kContentClips), std::end(kContentClips))
            : std::vector<float>{options.cache.content.clip};
    double best_total = std::numeric_limits<double>::infinity();
    for (size_t c = 0; c < clips.size(); ++c) {
      PathFormat format = options.cache.content;
      format.clip = clips[c];
      double total = 0.0;
      for (int64_t k = 0; k < count; ++k) {
        timed(k, [&] {
          total += calib::content_transform_loss(content_objective, format, geometry[k], starts[k],
                                                 ContentWindows{held_of(k), held_targets[k]});
        });
      }
      if (total < best_total) {
        best_total = total;
        report.cache.content = format;
      }
      if (progress) progress("content clip", static_cast<int64_t>(c) + 1, clips.size());
    }
    calib::ContentLearnOptions learn;
    learn.objective = content_objective;
    learn.steps = options.content_steps;
    learn.batch = options.content_batch;
    learn.learning_rate = options.content_learning_rate;
    for (int64_t k = 0; k < count; ++k) {
      timed(k, [&] {
        const std::string stage = "layer " + std::to_string(layers[k]) + " content";
        const calib::ContentLearnResult learned = calib::learn_content_transform(
            report.cache.content, geometry[k], starts[k],
            ContentWindows{train_of(k), train_targets[k]},
            ContentWindows{held_of(k), held_targets[k]}, learn, [&](int64_t done, int64_t total) {
              if (progress) progress(stage, done, total);
            });
        report.layers[k].content = learned.report;
        fold_content_transform(model, layers[k], learned.transform);
      });
    }
  }
  for (int64_t k = 0; k < count; ++k) {
    if (report.layers[k].rope.calibrated) fold_rope_transform(model, layers[k], rope[k]);
  }
  report.seconds = seconds_since(start);
  return report;
}

}  // namespace quantmla
