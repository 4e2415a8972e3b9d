// A DeepSeek-V2/V3 MLA model on the CPU: weights in FP32, attention in the absorbed form through
// an MlaCache.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "quantmla/cache.h"
#include "quantmla/config.h"

namespace quantmla {

struct ModelWeights;  // src/model/weights.h

// What forward() records for analysis tools (the error model), per layer, for the tokens run.
struct AttentionTrace {
  bool record_queries = false;
  bool record_cache_rows = false;
  // Absorbed queries as attention saw them: [n, num_heads, kv_lora_rank + rope_dim].
  std::vector<std::vector<float>> queries;
  // Attention output per head, softmax(q k^T) v after W_UV: [n, num_heads, v_head_dim].
  std::vector<std::vector<float>> outputs;
  // Cache rows before quantization, as the cache was asked to store them (record_cache_rows):
  // content latents [n, kv_lora_rank] and RoPE keys after RoPE [n, rope_dim].
  std::vector<std::vector<float>> latents;
  std::vector<std::vector<float>> rope_keys;
};

class Model {
 public:
  // Reads DIR/config.json and the safetensors weights; every tensor the config implies must be
  // present with the expected shape. Throws IoError / FormatError / ShapeError / InvalidArgument.
  static Model load(const std::filesystem::path& dir);

  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const ModelConfig& config() const { return config_; }
  // Parameters of the layers the engine runs (embedding, decoder layers, final norm, lm_head).
  int64_t parameter_count() const;
  CacheShape cache_shape() const;
  // A cache for `capacity` tokens in `format` (default: exact FP32 on both paths).
  std::unique_ptr<MlaCache> make_cache(int64_t capacity,
                                       const CacheFormat& format = CacheFormat::f32()) const;

  // Runs `tokens` at positions [cache.length(), cache.length() + n): writes their cache rows, lets
  // every position attend through the cache, commits them, and writes logits.
  // logits: [n, vocab] when all_logits, else [1, vocab] for the last token. Throws InvalidArgument
  // for an out-of-range token id or an empty input, CapacityError when the cache is full.
  // trace, when given, receives every layer's attention outputs (and queries if it asks).
  void forward(std::span<const int32_t> tokens, MlaCache& cache, std::span<float> logits,
               bool all_logits = true, AttentionTrace* trace = nullptr) const;

  // Positions (cached + new) this model may run at; beyond it RoPE was never trained.
  int64_t max_positions() const { return config_.max_position_embeddings; }

  // Weights, for the transforms that fold into them (src/calib). Not for the hot path.
  ModelWeights& mutable_weights() { return *weights_; }
  const ModelWeights& weights() const { return *weights_; }

 private:
  Model() = default;
  ModelConfig config_;
  std::unique_ptr<ModelWeights> weights_;
};

}  // namespace quantmla
