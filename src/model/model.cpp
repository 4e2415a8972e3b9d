#include "quantmla/model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "model/forward.h"
#include "model/weights.h"
#include "quantmla/error.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

// One sequence in an MlaCache: the cache stores the rows and attends over them.
class CacheRowStore final : public detail::RowStore {
 public:
  explicit CacheRowStore(MlaCache& cache) : cache_(cache) {}
  void write(int64_t, int64_t layer, int64_t pos, int64_t n, const float* c,
             const float* k_pe) override {
    cache_.write(layer, pos, n, c, k_pe);
  }
  void attend(int64_t, int64_t layer, const CacheQuery& query, float* out) const override {
    cache_.attend(layer, query, out, nullptr);
  }
  void read_rows(int64_t, int64_t layer, int64_t count, float* rows) const override {
    const CacheShape& shape = cache_.shape();
    const int64_t width = shape.row_width();
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < count; ++j) {
      cache_.read_row(layer, j, rows + j * width, rows + j * width + shape.kv_lora_rank);
    }
  }

 private:
  MlaCache& cache_;
};

}  // namespace

Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

Model Model::load(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) {
    throw IoError("model directory " + dir.string() + " does not exist");
  }
  const std::filesystem::path config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path)) {
    throw IoError("model directory " + dir.string() + " has no config.json");
  }
  Model model;
  model.config_ = ModelConfig::from_file(config_path);
  const TensorStore store = TensorStore::open_dir(dir);
  model.weights_ = std::make_unique<ModelWeights>(load_weights(model.config_, store));
  return model;
}

int64_t Model::parameter_count() const { return weights_->parameter_count; }

CacheShape Model::cache_shape() const {
  return CacheShape{config_.num_layers, config_.kv_lora_rank, config_.qk_rope_head_dim};
}

std::unique_ptr<MlaCache> Model::make_cache(int64_t capacity, const CacheFormat& format) const {
  return quantmla::make_cache(cache_shape(), format, capacity);
}

void Model::forward(std::span<const int32_t> tokens, MlaCache& cache, std::span<float> logits,
                    bool all_logits, AttentionTrace* trace) const {
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) throw InvalidArgument("forward: empty input, no tokens to run");
  for (int64_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      throw InvalidArgument("token id " + std::to_string(tokens[t]) + " at index " +
                            std::to_string(t) + " is outside the vocabulary [0, " +
                            std::to_string(c.vocab_size) + ")");
    }
  }
  const CacheShape expected = cache_shape();
  const CacheShape& actual = cache.shape();
  if (actual != expected) {
    throw ShapeError(
        "cache shape (layers " + std::to_string(actual.num_layers) + ", rank " +
        std::to_string(actual.kv_lora_rank) + ", rope " + std::to_string(actual.rope_dim) +
        ") does not match the model (" + std::to_string(expected.num_layers) + ", " +
        std::to_string(expected.kv_lora_rank) + ", " + std::to_string(expected.rope_dim) + ")");
  }
  const int64_t pos0 = cache.length();
  if (pos0 + n > cache.capacity()) {
    throw CapacityError("cache full: " + std::to_string(pos0) + " tokens cached + " +
                        std::to_string(n) + " new > capacity " + std::to_string(cache.capacity()));
  }
  const int64_t logit_rows = all_logits ? n : 1;
  if (static_cast<int64_t>(logits.size()) != logit_rows * c.vocab_size) {
    throw ShapeError("forward: logits buffer holds " + std::to_string(logits.size()) +
                     " floats, expected " + std::to_string(logit_rows * c.vocab_size));
  }

  const detail::ForwardSegment segment{0, n, pos0};
  std::vector<int64_t> logit_tokens(static_cast<size_t>(logit_rows));
  for (int64_t r = 0; r < logit_rows; ++r) logit_tokens[r] = n - logit_rows + r;
  CacheRowStore store(cache);
  // A workspace per call: forward is const and may run on several threads at once (the batched
  // CPU runner keeps one across its steps instead).
  detail::ForwardWorkspace workspace;
  detail::run_forward(c, *weights_, tokens, std::span(&segment, 1), store, logit_tokens, logits,
                      trace, workspace);
  cache.set_length(pos0 + n);
}

}  // namespace quantmla
