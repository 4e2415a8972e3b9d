// The engine against transformers' logits (FP32 compute on the checkpoint weights): max abs logit
// difference <= 1e-3 and identical argmax at every position.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "model_fixtures.h"
#include "model/rope.h"
#include "quantmla/eval.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

using testing::mla_tiny;
using testing::mla_tiny_moe;
using testing::mla_tiny_v2;
using testing::shared_dir;

constexpr float kLogitTolerance = 1e-3f;

int32_t argmax(const float* values, int64_t n) {
  return static_cast<int32_t>(std::max_element(values, values + n) - values);
}

// Runs one prompt as a single prefill and returns [n, vocab] logits.
std::vector<float> prefill_logits(const Model& model, std::span<const int32_t> ids) {
  auto cache = model.make_cache(static_cast<int64_t>(ids.size()));
  std::vector<float> logits(ids.size() * model.config().vocab_size);
  model.forward(ids, *cache, logits);
  return logits;
}

// Compares rows [first, first + rows) of `ours` with `reference` ([rows, vocab]).
void expect_logits_match(const std::vector<float>& ours, const float* reference, int64_t first,
                         int64_t rows, int64_t vocab, const std::string& what) {
  float max_diff = 0.0f;
  int64_t argmax_mismatches = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* mine = ours.data() + (first + r) * vocab;
    const float* theirs = reference + r * vocab;
    for (int64_t v = 0; v < vocab; ++v) {
      ASSERT_FALSE(std::isnan(mine[v])) << what << " row " << r << " vocab " << v;
      max_diff = std::max(max_diff, std::abs(mine[v] - theirs[v]));
    }
    argmax_mismatches += argmax(mine, vocab) != argmax(theirs, vocab) ? 1 : 0;
  }
  EXPECT_LE(max_diff, kLogitTolerance) << what;
  EXPECT_EQ(argmax_mismatches, 0) << what;
  std::printf("[ %s ] max |logit diff| = %.3g over %lld rows\n", what.c_str(), max_diff,
              static_cast<long long>(rows));
}

// Every position's argmax, and the NLL of every next token, against transformers'.
void expect_nll_and_argmax_match(const std::vector<float>& ours, const std::vector<int32_t>& ids,
                                 const std::vector<float>& reference_nll,
                                 const std::vector<int32_t>& reference_argmax, int64_t vocab,
                                 const std::string& what) {
  const int64_t n = static_cast<int64_t>(ids.size());
  double max_nll_diff = 0.0;
  int64_t argmax_mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::span<const float> row(ours.data() + i * vocab, static_cast<size_t>(vocab));
    argmax_mismatches += argmax(row.data(), vocab) != reference_argmax[i] ? 1 : 0;
    if (i + 1 < n) {
      max_nll_diff =
          std::max(max_nll_diff, std::abs(token_nll(row, ids[i + 1]) - reference_nll[i]));
    }
  }
  EXPECT_LE(max_nll_diff, kLogitTolerance) << what;
  EXPECT_EQ(argmax_mismatches, 0) << what;
  std::printf("[ %s ] max |nll diff| = %.3g over %lld positions\n", what.c_str(), max_nll_diff,
              static_cast<long long>(n - 1));
}

TEST(ModelReference, MlaTinyShortBatch) {
  const Model& model = mla_tiny();
  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-short-reference.safetensors");
  const std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  const std::vector<float> logits = to_f32(*reference->find("logits"));
  const int64_t vocab = model.config().vocab_size;
  const int64_t batch = 3, seq = 64;
  ASSERT_EQ(ids.size(), static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<float> ours =
        prefill_logits(model, std::span<const int32_t>(ids.data() + b * seq, seq));
    expect_logits_match(ours, logits.data() + b * seq * vocab, 0, seq, vocab,
                        "short row " + std::to_string(b));
  }
}

TEST(ModelReference, MlaTinyLongWindowNllAndArgmax) {
  const Model& model = mla_tiny();
  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-long-reference.safetensors");
  const std::vector<int32_t> ids = to_i32(*reference->find("long_input_ids"));
  const std::vector<float> nll = to_f32(*reference->find("long_nll"));
  const std::vector<int32_t> reference_argmax = to_i32(*reference->find("long_argmax"));
  const std::vector<float> first64 = to_f32(*reference->find("long_logits_first64"));
  const std::vector<float> last64 = to_f32(*reference->find("long_logits_last64"));
  const int64_t vocab = model.config().vocab_size;
  const int64_t n = static_cast<int64_t>(ids.size());
  ASSERT_EQ(n, 1024);

  const std::vector<float> ours = prefill_logits(model, ids);
  expect_logits_match(ours, first64.data(), 0, 64, vocab, "long first 64");
  expect_logits_match(ours, last64.data(), n - 64, 64, vocab, "long last 64");

  expect_nll_and_argmax_match(ours, ids, nll, reference_argmax, vocab, "long window");
}

// transformers keeps RoPE's inv_freq in FP32 whatever the checkpoint's dtype, so the same weights
// stored as BF16 and as F32 are the same model: identical frequencies, identical logits, both
// within tolerance of the reference.
TEST(ModelReference, SameModelStoredAsBf16AndF32) {
  namespace fs = std::filesystem;
  const fs::path source = testing::bundled_model();
  const fs::path dir = fs::temp_directory_path() /
                       ("quantmla-f32-copy-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  const TensorStore store = TensorStore::open_dir(source);
  std::vector<TensorData> tensors;
  for (const std::string& name : store.names()) {
    const TensorView& view = store.get(name);
    ASSERT_EQ(view.dtype, DType::kBF16) << name;
    tensors.push_back(make_f32_tensor(name, view.shape, to_f32(view)));
  }
  write_safetensors(dir / "model.safetensors", tensors);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(source / "config.json"));
  config["torch_dtype"] = "float32";
  std::ofstream(dir / "config.json") << config.dump(2);
  fs::copy_file(source / "tokenizer.json", dir / "tokenizer.json");

  const Model& bf16 = mla_tiny();
  const Model f32 = Model::load(dir);
  fs::remove_all(dir);
  ASSERT_EQ(f32.config().torch_dtype, "float32");
  const ModelConfig& config_bf16 = bf16.config();
  EXPECT_EQ(Rope(config_bf16).inv_freq(), Rope(f32.config()).inv_freq());
  // FP32 frequencies exactly as transformers computes them: 1 / theta^(2i / d) in FP32.
  const Rope rope(config_bf16);
  const std::vector<float>& inv_freq = rope.inv_freq();
  const int64_t dim = config_bf16.qk_rope_head_dim;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    EXPECT_EQ(inv_freq[i], 1.0f / std::pow(static_cast<float>(config_bf16.rope.theta), exponent));
  }

  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-short-reference.safetensors");
  const std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  const std::vector<float> logits = to_f32(*reference->find("logits"));
  const int64_t vocab = config_bf16.vocab_size, seq = 64;
  const std::span<const int32_t> row(ids.data(), seq);
  const std::vector<float> from_bf16 = prefill_logits(bf16, row);
  const std::vector<float> from_f32 = prefill_logits(f32, row);
  expect_logits_match(from_f32, logits.data(), 0, seq, vocab, "F32 storage");
  float max_diff = 0.0f;
  for (size_t i = 0; i < from_bf16.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(from_bf16[i] - from_f32[i]));
  }
  EXPECT_LE(max_diff, 1e-5f) << "BF16 and F32 storage of the same weights";
}

// DeepSeek-V2 layout (q_proj without LoRA) over its whole 4096-token trained context.
TEST(ModelReference, V2FullContextNllAndArgmax) {
  const Model& model = mla_tiny_v2();
  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-v2-4k-long-reference.safetensors");
  const std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  const std::vector<float> nll = to_f32(*reference->find("nll"));
  const std::vector<int32_t> reference_argmax = to_i32(*reference->find("argmax"));
  const std::vector<float> last64 = to_f32(*reference->find("logits_last64"));
  const int64_t vocab = model.config().vocab_size;
  const int64_t n = static_cast<int64_t>(ids.size());
  ASSERT_EQ(n, 4096);

  const std::vector<float> ours = prefill_logits(model, ids);
  expect_logits_match(ours, last64.data(), n - 64, 64, vocab, "v2 last 64");
  expect_nll_and_argmax_match(ours, ids, nll, reference_argmax, vocab, "v2 4096 window");
}

TEST(ModelReference, MoeYarnBeyondOriginalContext) {
  const Model& model = mla_tiny_moe();
  const auto reference =
      SafetensorsFile::open(shared_dir() / "reference/mla-tiny-moe-reference.safetensors");
  const std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
  const std::vector<float> logits = to_f32(*reference->find("logits"));
  const int64_t vocab = model.config().vocab_size;
  const int64_t batch = 2, seq = 200;
  ASSERT_EQ(ids.size(), static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<float> ours =
        prefill_logits(model, std::span<const int32_t>(ids.data() + b * seq, seq));
    expect_logits_match(ours, logits.data() + b * seq * vocab, 0, seq, vocab,
                        "moe row " + std::to_string(b));
  }
}

// Prefill (64 queries and more) runs attention in the expanded form, decode and traced forwards in
// the absorbed form: the same function. Both read the cache rows they just wrote, so in FP32 the
// logits agree to summation order; in a quantized format later layers' rows can flip a rounding
// boundary, so the logits stay close. Also a prefill continuing a cached prefix (q_pos0 > 0).
TEST(ModelReference, ExpandedPrefillMatchesAbsorbedAttention) {
  for (const Model* model : {&mla_tiny(), &mla_tiny_v2()}) {
    const auto reference =
        SafetensorsFile::open(shared_dir() / "reference/mla-tiny-long-reference.safetensors");
    std::vector<int32_t> ids = to_i32(*reference->find("long_input_ids"));
    ids.resize(300);
    const int64_t vocab = model->config().vocab_size;
    for (const char* spec :
         {"f32", "content=int4:g64,rope=int4:g64", "content=int2:g64,rope=bf16"}) {
      const CacheFormat format = CacheFormat::parse(spec);
      const auto run = [&](bool absorbed, int64_t split) {
        auto cache = model->make_cache(static_cast<int64_t>(ids.size()), format);
        std::vector<float> logits(ids.size() * vocab);
        AttentionTrace trace;  // a trace keeps the absorbed form
        for (int64_t begin : {int64_t{0}, split}) {
          const int64_t end = begin == 0 ? split : static_cast<int64_t>(ids.size());
          model->forward(std::span<const int32_t>(ids.data() + begin, end - begin), *cache,
                         std::span<float>(logits.data() + begin * vocab, (end - begin) * vocab),
                         true, absorbed ? &trace : nullptr);
        }
        return logits;
      };
      const std::vector<float> absorbed = run(true, 100);
      const std::vector<float> expanded = run(false, 100);
      float max_diff = 0.0f;
      for (size_t i = 0; i < absorbed.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(absorbed[i] - expanded[i]));
      }
      std::printf("[ %s, %s ] expanded vs absorbed: max |dlogit| %.3g\n",
                  model->config().model_type.c_str(), spec, max_diff);
      EXPECT_LE(max_diff, std::string(spec) == "f32" ? 1e-4f : 0.5f) << spec;
    }
  }
}

// Decoding token by token through the cache must give the logits of one prefill (DESIGN §7). In
// FP32 exactly (up to summation order); in a quantized format each position sees the same rows
// either way except where FP32 noise in a row moves a value across a rounding boundary of the
// quantizer: those flips must be rare, and the logits stay close.
TEST(ModelReference, DecodeStepsMatchPrefill) {
  for (const Model* model : {&mla_tiny(), &mla_tiny_moe()}) {
    const auto reference = SafetensorsFile::open(
        shared_dir() / (model == &mla_tiny() ? "reference/mla-tiny-short-reference.safetensors"
                                             : "reference/mla-tiny-moe-reference.safetensors"));
    std::vector<int32_t> ids = to_i32(*reference->find("input_ids"));
    ids.resize(48);
    const int64_t vocab = model->config().vocab_size;
    for (const char* spec : {"f32", "content=int4:g64,rope=int4:g32", "content=q4_0,rope=bf16"}) {
      const CacheFormat format = CacheFormat::parse(spec);
      auto prefill_cache = model->make_cache(static_cast<int64_t>(ids.size()), format);
      std::vector<float> prefill(ids.size() * vocab);
      model->forward(ids, *prefill_cache, prefill);

      auto cache = model->make_cache(static_cast<int64_t>(ids.size()), format);
      std::vector<float> step(static_cast<size_t>(vocab));
      float max_diff = 0.0f;
      int64_t argmax_agree = 0;
      // A 16-token prefill, then single-token decode steps.
      std::vector<float> first(16 * static_cast<size_t>(vocab));
      model->forward(std::span<const int32_t>(ids.data(), 16), *cache, first);
      for (size_t i = 16; i < ids.size(); ++i) {
        model->forward(std::span<const int32_t>(&ids[i], 1), *cache, step, false);
        for (int64_t v = 0; v < vocab; ++v) {
          max_diff = std::max(max_diff, std::abs(step[v] - prefill[i * vocab + v]));
        }
        argmax_agree += argmax(step.data(), vocab) == argmax(prefill.data() + i * vocab, vocab);
      }
      const auto decoded = static_cast<int64_t>(ids.size()) - 16;
      EXPECT_EQ(cache->length(), static_cast<int64_t>(ids.size()));
      if (std::string(spec) == "f32") {
        EXPECT_LE(max_diff, 1e-4f);
        continue;
      }
      const CacheShape shape = model->cache_shape();
      std::vector<float> c0(shape.kv_lora_rank), c1(shape.kv_lora_rank);
      std::vector<float> r0(shape.rope_dim), r1(shape.rope_dim);
      int64_t changed = 0, total = 0;
      double sum_abs = 0.0, max_abs = 0.0, sum_sq = 0.0;
      for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
        for (int64_t pos = 0; pos < static_cast<int64_t>(ids.size()); ++pos) {
          prefill_cache->read_row(layer, pos, c0.data(), r0.data());
          cache->read_row(layer, pos, c1.data(), r1.data());
          for (size_t d = 0; d < c0.size(); ++d) {
            changed += c0[d] != c1[d] ? 1 : 0;
            sum_abs += std::abs(c0[d] - c1[d]);
            max_abs = std::max<double>(max_abs, std::abs(c0[d] - c1[d]));
            sum_sq += c0[d] * c0[d];
          }
          for (size_t d = 0; d < r0.size(); ++d) changed += r0[d] != r1[d] ? 1 : 0;
          total += shape.row_width();
        }
      }
      std::printf(
          "[ %s ] prefill vs decode: %lld of %lld differ, mean |d| %.3g max |d| %.3g rms %.3g, max "
          "|dlogit| %.3g\n",
          spec, static_cast<long long>(changed), static_cast<long long>(total), sum_abs / total,
          max_abs, std::sqrt(sum_sq / total), max_diff);
      EXPECT_LE(sum_abs / total, 0.01 * std::sqrt(sum_sq / total)) << spec;
      // A flipped code moves its row by one quantization step (max |d| above); the flips of
      // every layer together move a logit of this model by well under 1.5 and rarely the argmax.
      EXPECT_LE(max_diff, 1.5f) << spec;
      EXPECT_GE(argmax_agree, decoded - decoded / 8) << spec;
      std::printf("[ %s ] argmax agrees at %lld of %lld decode steps\n", spec,
                  static_cast<long long>(argmax_agree), static_cast<long long>(decoded));
    }
  }
}

}  // namespace
}  // namespace quantmla
