// What every cache implementation checks and fills the same way (internal).
#pragma once

#include <cstdint>

#include "quantmla/attention.h"
#include "quantmla/cache.h"

namespace quantmla::cache_detail {

// Throws InvalidArgument for a capacity that is not positive.
void check_capacity(int64_t capacity);
// Throws InvalidArgument for a layer outside [0, num_layers).
void check_layer(const CacheShape& shape, int64_t layer);
// Throws InvalidArgument for a write that would leave a gap after `length` tokens, CapacityError
// for one that runs past `capacity`.
void check_write(int64_t pos, int64_t n, int64_t length, int64_t capacity);
// Throws CapacityError for a length outside [0, capacity].
void check_length(int64_t n, int64_t capacity);
// Attention parameters for `query` over the cache's rows, output [n_q, heads, kv_lora_rank];
// the caller sets the key source (kv or decode_keys).
AttentionParams attention_params(const CacheShape& shape, const CacheQuery& query, float* out,
                                 float* lse);

}  // namespace quantmla::cache_detail
