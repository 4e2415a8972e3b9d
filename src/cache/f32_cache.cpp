#include <algorithm>
#include <string>
#include <vector>

#include "quantmla/attention.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

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
    check_layer(layer);
    if (pos < 0 || pos > length_) {
      throw InvalidArgument("cache write at position " + std::to_string(pos) +
                            " leaves a gap: cache holds " + std::to_string(length_) + " tokens");
    }
    if (pos + n > capacity_) {
      throw CapacityError("cache full: writing positions [" + std::to_string(pos) + ", " +
                          std::to_string(pos + n) + ") into a cache of " +
                          std::to_string(capacity_) + " tokens");
    }
    const int64_t width = shape_.row_width();
    float* base = rows_[layer].data() + pos * width;
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(c + t * shape_.kv_lora_rank, shape_.kv_lora_rank, base + t * width);
      std::copy_n(k_pe + t * shape_.rope_dim, shape_.rope_dim,
                  base + t * width + shape_.kv_lora_rank);
    }
  }

  void set_length(int64_t n) override {
    if (n < 0 || n > capacity_) {
      throw CapacityError("cache length " + std::to_string(n) + " outside [0, " +
                          std::to_string(capacity_) + "]");
    }
    length_ = n;
  }

  void attend(int64_t layer, const CacheQuery& query, float* out, float* lse) const override {
    check_layer(layer);
    const int64_t width = shape_.row_width();
    AttentionParams params;
    params.q = query.q;
    params.q_head_stride = width;
    params.q_row_stride = query.num_heads * width;
    params.kv = rows_[layer].data();
    params.kv_row_stride = width;
    params.out = out;
    params.out_head_stride = shape_.kv_lora_rank;
    params.out_row_stride = query.num_heads * shape_.kv_lora_rank;
    params.lse = lse;
    params.n_q = query.n_q;
    params.num_heads = query.num_heads;
    params.kv_lora_rank = shape_.kv_lora_rank;
    params.rope_dim = shape_.rope_dim;
    params.q_pos0 = query.q_pos0;
    params.softmax_scale = query.softmax_scale;
    attention_f32(params);
  }

  void read_row(int64_t layer, int64_t pos, float* c, float* k_pe) const override {
    check_layer(layer);
    const float* row = rows_[layer].data() + pos * shape_.row_width();
    std::copy_n(row, shape_.kv_lora_rank, c);
    std::copy_n(row + shape_.kv_lora_rank, shape_.rope_dim, k_pe);
  }

 private:
  void check_layer(int64_t layer) const {
    if (layer < 0 || layer >= shape_.num_layers) {
      throw InvalidArgument("cache layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(shape_.num_layers) + ")");
    }
  }

  CacheShape shape_;
  int64_t capacity_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> rows_;  // per layer [capacity, row_width]
};

}  // namespace

std::unique_ptr<MlaCache> make_f32_cache(const CacheShape& shape, int64_t capacity) {
  if (capacity <= 0) {
    throw InvalidArgument("cache capacity must be positive, got " + std::to_string(capacity));
  }
  return std::make_unique<F32Cache>(shape, capacity);
}

}  // namespace quantmla
