// A cache whose layers each have their own format: one single-layer cache per layer. Used to keep
// sensitive layers in a wider format, and by the error model to quantize one layer at a time.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache/cache_common.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

class LayeredCache final : public MlaCache {
 public:
  LayeredCache(const CacheShape& shape, const std::vector<CacheFormat>& formats, int64_t capacity)
      : shape_(shape) {
    const CacheShape one_layer{1, shape.kv_lora_rank, shape.rope_dim};
    for (const CacheFormat& format : formats) {
      layers_.push_back(make_cache(one_layer, format, capacity));
    }
  }

  const CacheShape& shape() const override { return shape_; }
  std::string format() const override {
    std::string text;
    for (size_t l = 0; l < layers_.size(); ++l) {
      text +=
          (l ? "; " : "") + std::string("layer ") + std::to_string(l) + ": " + layers_[l]->format();
    }
    return text;
  }
  int64_t capacity() const override { return layers_.front()->capacity(); }
  int64_t length() const override { return layers_.front()->length(); }
  // The mean over layers, rounded down: what the layers hold together per token and layer.
  int64_t bytes_per_token_per_layer() const override {
    int64_t total = 0;
    for (const auto& layer : layers_) total += layer->bytes_per_token_per_layer();
    return total / static_cast<int64_t>(layers_.size());
  }

  void write(int64_t layer, int64_t pos, int64_t n, const float* c, const float* k_pe) override {
    at(layer).write(0, pos, n, c, k_pe);
  }
  void set_length(int64_t n) override {
    for (auto& layer : layers_) layer->set_length(n);
  }
  void attend(int64_t layer, const CacheQuery& query, float* out, float* lse) const override {
    at(layer).attend(0, query, out, lse);
  }
  void read_row(int64_t layer, int64_t pos, float* c, float* k_pe) const override {
    at(layer).read_row(0, pos, c, k_pe);
  }

 private:
  MlaCache& at(int64_t layer) const {
    cache_detail::check_layer(shape_, layer);
    return *layers_[static_cast<size_t>(layer)];
  }

  CacheShape shape_;
  std::vector<std::unique_ptr<MlaCache>> layers_;
};

}  // namespace

std::unique_ptr<MlaCache> make_layered_cache(const CacheShape& shape,
                                             const std::vector<CacheFormat>& formats,
                                             int64_t capacity) {
  if (static_cast<int64_t>(formats.size()) != shape.num_layers) {
    throw InvalidArgument("layered cache: " + std::to_string(formats.size()) + " formats for " +
                          std::to_string(shape.num_layers) + " layers");
  }
  return std::make_unique<LayeredCache>(shape, formats, capacity);
}

}  // namespace quantmla
