#include "cache/cache_common.h"

#include <string>

#include "quantmla/error.h"

namespace quantmla::cache_detail {

void check_capacity(int64_t capacity) {
  if (capacity <= 0) {
    throw InvalidArgument("cache capacity must be positive, got " + std::to_string(capacity));
  }
}

void check_layer(const CacheShape& shape, int64_t layer) {
  if (layer < 0 || layer >= shape.num_layers) {
    throw InvalidArgument("cache layer " + std::to_string(layer) + " outside [0, " +
                          std::to_string(shape.num_layers) + ")");
  }
}

void check_write(int64_t pos, int64_t n, int64_t length, int64_t capacity) {
  if (pos < 0 || pos > length) {
    throw InvalidArgument("cache write at position " + std::to_string(pos) +
                          " leaves a gap: cache holds " + std::to_string(length) + " tokens");
  }
  if (pos + n > capacity) {
    throw CapacityError("cache full: writing positions [" + std::to_string(pos) + ", " +
                        std::to_string(pos + n) + ") into a cache of " + std::to_string(capacity) +
                        " tokens");
  }
}

void check_length(int64_t n, int64_t capacity) {
  if (n < 0 || n > capacity) {
    throw CapacityError("cache length " + std::to_string(n) + " outside [0, " +
                        std::to_string(capacity) + "]");
  }
}

AttentionParams attention_params(const CacheShape& shape, const CacheQuery& query, float* out,
                                 float* lse) {
  AttentionParams params;
  params.q = query.q;
  params.q_head_stride = shape.row_width();
  params.q_row_stride = query.num_heads * shape.row_width();
  params.out = out;
  params.out_head_stride = shape.kv_lora_rank;
  params.out_row_stride = query.num_heads * shape.kv_lora_rank;
  params.lse = lse;
  params.n_q = query.n_q;
  params.num_heads = query.num_heads;
  params.kv_lora_rank = shape.kv_lora_rank;
  params.rope_dim = shape.rope_dim;
  params.q_pos0 = query.q_pos0;
  params.softmax_scale = query.softmax_scale;
  return params;
}

}  // namespace quantmla::cache_detail
