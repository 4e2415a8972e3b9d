#include <algorithm>
#include <string>
#include <vector>

#include "cache/cache_common.h"
#include "quantmla/attention.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

using cache_detail::attention_params;
using cache_detail::check_layer;
using cache_detail::check_length;
using cache_detail::check_write;

class F32Cache final : public MlaCache {
 public:
  F32Cache(const CacheShape& shape, int64_t capacity)
      : shape_(shape),
        capacity_(capacity),
        rows_(static_cast<size_t>(shape.num_layers),
              std::vector<float>(static_cast<size_t>(capacity * shape.row_width()))) {}

  const CacheShape& shape() const override { return shape_; }
  std::string format() const override { return "f32"; }
  int64_t capacity() const override { return capacity_; }
  int64_t length() const override { return length_; }
  int64_t bytes_per_token_per_layer() const override {
    return shape_.row_width() * static_cast<int64_t>(sizeof(float));
  }

  void write(int64_t layer, int64_t pos, int64_t n, const float* c, const float* k_pe) override {
    check_layer(shape_, layer);
    check_write(pos, n, length_, capacity_);
    const int64_t width = shape_.row_width();
    float* base = rows_[layer].data() + pos * width;
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(c + t * shape_.kv_lora_rank, shape_.kv_lora_rank, base + t * width);
      std::copy_n(k_pe + t * shape_.rope_dim, shape_.rope_dim,
                  base + t * width + shape_.kv_lora_rank);
    }
  }

  void set_length(int64_t n) override {
    check_length(n, capacity_);
    length_ = n;
  }

  void attend(int64_t layer, const CacheQuery& query, float* out, float* lse) const override {
    check_layer(shape_, layer);
    AttentionParams params = attention_params(shape_, query, out, lse);
    params.kv = rows_[layer].data();
    params.kv_row_stride = shape_.row_width();
    attention_f32(params);
  }

  void read_row(int64_t layer, int64_t pos, float* c, float* k_pe) const override {
    check_layer(shape_, layer);
    const float* row = rows_[layer].data() + pos * shape_.row_width();
    std::copy_n(row, shape_.kv_lora_rank, c);
    std::copy_n(row + shape_.kv_lora_rank, shape_.rope_dim, k_pe);
  }

 private:
  CacheShape shape_;
  int64_t capacity_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> rows_;  // per layer [capacity, row_width]
};

}  // namespace

std::unique_ptr<MlaCache> make_f32_cache(const CacheShape& shape, int64_t capacity) {
  cache_detail::check_capacity(capacity);
  return std::make_unique<F32Cache>(shape, capacity);
}

}  // namespace quantmla
