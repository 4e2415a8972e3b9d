// Calibration end to end on the bundled model, reduced to two layers and a few short windows:
// the calibrated model is exact in full precision, its losses went down on held-back windows,
// it is reproducible, and what it cannot do is refused with a clear error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "error_matchers.h"
#include "quantmla/calibrate.h"
#include "quantmla/error.h"
#include "quantmla/eval.h"
#include "quantmla/io.h"
#include "quantmla/tokenizer.h"
#include "quantmla/transform.h"
#include "test_paths.h"

namespace quantmla {
namespace {

using testing::bundled_model;
using testing::error_message;
using testing::expect_contains;
using testing::source_dir;

// The first ~40K characters of the bundled calibration text: room for a dozen 128-token windows.
const std::vector<int32_t>& calibration_tokens() {
  static const std::vector<int32_t> tokens = [] {
    const std::string text =
        read_text_file_universal_newlines(source_dir() / "data" / "calib.txt").substr(0, 40000);
    return Tokenizer::from_model_dir(bundled_model()).encode(text);
  }();
  return tokens;
}

CalibrationOptions reduced_options() {
  CalibrationOptions options;
  options.cache = CacheFormat::parse("content=int2:g64,rope=int4:g64");
  options.samples = 3;
  options.held_out = 2;
  options.seq = 128;
  options.seed = 3;
  options.content_steps = 6;
  options.rope_keys_per_window = 32;
  options.content_queries_per_window = 48;  // sampled query rows: the long-context path
  options.layers = {0, 1};
  return options;
}

struct Calibrated {
  Model model;
  CalibrationReport report;
};

const Calibrated& calibrated() {
  static const Calibrated result = [] {
    Model model = Model::load(bundled_model());
    CalibrationReport report = calibrate(model, calibration_tokens(), reduced_options());
    return Calibrated{std::move(model), std::move(report)};
  }();
  return result;
}

std::vector<float> logits_of(const Model& model, std::span<const int32_t> ids,
                             const CacheFormat& format = CacheFormat::f32()) {
  auto cache = model.make_cache(static_cast<int64_t>(ids.size()), format);
  std::vector<float> logits(ids.size() * model.config().vocab_size);
  model.forward(ids, *cache, logits);
  return logits;
}

TEST(Calibrate, FusedModelGivesTheOriginalLogitsInFullPrecision) {
  const Model original = Model::load(bundled_model());
  const std::span<const int32_t> ids(calibration_tokens().data() + 5000, 96);
  const std::vector<float> expected = logits_of(original, ids);
  const std::vector<float> actual = logits_of(calibrated().model, ids);
  float worst = 0.0f;
  for (size_t i = 0; i < expected.size(); ++i) {
    worst = std::max(worst, std::abs(expected[i] - actual[i]));
  }
  EXPECT_LE(worst, 1e-4f);
}

TEST(Calibrate, LossesWentDownOnHeldBackWindows) {
  const CalibrationReport& report = calibrated().report;
  ASSERT_EQ(report.layers.size(), 2u);
  for (const LayerCalibrationReport& layer : report.layers) {
    SCOPED_TRACE("layer " + std::to_string(layer.layer));
    ASSERT_TRUE(layer.rope.calibrated);
    ASSERT_TRUE(layer.content.calibrated);
    // The RoPE candidates compete on the held-back attention output, so that went down; the
    // QK loss they were searched on may move either way on held-back keys in one layer.
    EXPECT_LT(layer.rope.output_after, layer.rope.output_before);
    EXPECT_LT(layer.content.loss_final, layer.content.loss_identity);
    EXPECT_LE(layer.content.loss_final, layer.content.loss_start);
  }
  EXPECT_LT(report.layers[0].rope.qk_after + report.layers[1].rope.qk_after,
            report.layers[0].rope.qk_before + report.layers[1].rope.qk_before);
  // Only uniform-int paths clip; the chosen ratios are recorded in the calibrated format.
  EXPECT_EQ(report.cache.content.codec, Codec::kInt2);
  EXPECT_LE(report.cache.content.clip, 1.0f);
}

TEST(Calibrate, QuantizedCacheIsCloserToTheModelThanItsStartingPoint) {
  // The starting point: the same random Hadamard rotations, identity RoPE transform, no clip.
  Model start = Model::load(bundled_model());
  for (int64_t layer : reduced_options().layers) {
    fold_content_transform(start, layer, random_hadamard(512, reduced_options().seed + layer));
  }
  const Model original = Model::load(bundled_model());
  KldOptions options;
  options.ctx = 128;
  options.max_windows = 4;
  options.baseline = CacheFormat::parse("f32");
  options.baseline_model = &original;
  const std::span<const int32_t> text(calibration_tokens().data() + 2000, 600);
  const double before =
      evaluate_kld(start, text, {reduced_options().cache}, options).front().kld_mean;
  const double after =
      evaluate_kld(calibrated().model, text, {calibrated().report.cache}, options).front().kld_mean;
  EXPECT_LT(after, before);
}

TEST(Calibrate, SameSeedAndThreadsGiveTheSameModel) {
  CalibrationOptions options = reduced_options();
  options.layers = {1};
  options.content_steps = 2;
  Model first = Model::load(bundled_model());
  Model second = Model::load(bundled_model());
  const CalibrationReport a = calibrate(first, calibration_tokens(), options);
  const CalibrationReport b = calibrate(second, calibration_tokens(), options);
  EXPECT_EQ(a.layers[0].content.loss_final, b.layers[0].content.loss_final);
  EXPECT_EQ(a.layers[0].rope.scales, b.layers[0].rope.scales);
  const std::span<const int32_t> ids(calibration_tokens().data(), 48);
  EXPECT_EQ(logits_of(first, ids, a.cache), logits_of(second, ids, b.cache));
}

TEST(Calibrate, RefusesWhatItCannotDo) {
  Model model = Model::load(bundled_model());
  CalibrationOptions options = reduced_options();
  options.cache = CacheFormat::parse("content=bf16,rope=bf16");
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"nothing to calibrate"});
  options = reduced_options();
  options.cache = CacheFormat::parse("content=int4:g64,rope=bf16");
  options.content = false;  // --paths rope with an unquantized RoPE path
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"nothing to calibrate"});
  options = reduced_options();
  options.samples = 1000;
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"need 1002"});
  options = reduced_options();
  options.rope_objective = "cosine";
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"unknown RoPE objective 'cosine'"});
  options = reduced_options();
  options.layers = {6};
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"layer 6 outside [0, 6)"});
  options = reduced_options();
  options.content_queries_per_window = -1;
  expect_contains(
      error_message<InvalidArgument>([&] { calibrate(model, calibration_tokens(), options); }),
      {"content queries (-1)", ">= 0"});
}

}  // namespace
}  // namespace quantmla
