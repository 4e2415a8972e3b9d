// The per-layer MLA cache of (c, k_pe) rows for one sequence. Attention is a method of the cache,
// so a quantized format can read its own records inside the attention loop.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "quantmla/cache_format.h"

namespace quantmla {

struct CacheShape {
  int64_t num_layers = 0;
  int64_t kv_lora_rank = 0;  // width of c
  int64_t rope_dim = 0;      // width of k_pe
  int64_t row_width() const { return kv_lora_rank + rope_dim; }
  bool operator==(const CacheShape&) const = default;
};

// Queries for one layer, in the layout of AttentionParams::q.
struct CacheQuery {
  const float* q = nullptr;  // [n_q, num_heads, kv_lora_rank + rope_dim], contiguous
  int64_t n_q = 0;
  int64_t num_heads = 0;
  int64_t q_pos0 = 0;  // absolute position of the first query (causal: attends keys [0, pos])
  float softmax_scale = 1.0f;
};

class MlaCache {
 public:
  virtual ~MlaCache() = default;

  virtual const CacheShape& shape() const = 0;
  virtual std::string format() const = 0;
  // Tokens the cache can hold.
  virtual int64_t capacity() const = 0;
  // Tokens committed (written in every layer).
  virtual int64_t length() const = 0;
  // Bytes one token occupies in one layer, everything the format stores included.
  virtual int64_t bytes_per_token_per_layer() const = 0;

  // Stores rows for positions [pos, pos + n) of `layer`. c: [n, kv_lora_rank], k_pe: [n, rope_dim]
  // (after RoPE), contiguous. pos must not exceed length(); throws CapacityError past capacity().
  virtual void write(int64_t layer, int64_t pos, int64_t n, const float* c, const float* k_pe) = 0;
  // Marks positions [0, n) as written in every layer (after a forward step), or truncates.
  virtual void set_length(int64_t n) = 0;
  // out: [n_q, num_heads, kv_lora_rank]; lse: [n_q, num_heads] or null.
  virtual void attend(int64_t layer, const CacheQuery& query, float* out, float* lse) const = 0;
  // Reads back row `pos` of `layer` as FP32 (the values attention sees). c: [kv_lora_rank],
  // k_pe: [rope_dim]. For tests and tools, not for the hot path.
  virtual void read_row(int64_t layer, int64_t pos, float* c, float* k_pe) const = 0;
};

// FP32 rows: the exact cache every quantized format is measured against.
std::unique_ptr<MlaCache> make_f32_cache(const CacheShape& shape, int64_t capacity);

// Tokens per page of the paged caches.
inline constexpr int64_t kPageTokens = 64;

// A cache in `format`: FP32 for "f32" on both paths, otherwise paged records of
// format.record_bytes() bytes, encoded on write and decoded tile by tile inside attention.
std::unique_ptr<MlaCache> make_cache(const CacheShape& shape, const CacheFormat& format,
                                     int64_t capacity);

// A cache with a format per layer (formats.size() == shape.num_layers), e.g. to keep the first
// layers wider, or to quantize a single layer. Throws InvalidArgument for a count mismatch.
std::unique_ptr<MlaCache> make_layered_cache(const CacheShape& shape,
                                             const std::vector<CacheFormat>& formats,
                                             int64_t capacity);

// Physical bytes of one sequence of `tokens` tokens in every layer: whole pages of records plus one
// 4-byte block-table entry per page (f32: one unpaged array).
int64_t cache_physical_bytes(const CacheShape& shape, const CacheFormat& format, int64_t tokens);

}  // namespace quantmla
