// Paged storage of encoded (c, k_pe) records: pages of kPageTokens records per layer, found through
// a block table, encoded when written and decoded page by page for the attention kernels.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cache/cache_common.h"
#include "kernels/cpu/decode_rows.h"
#include "quantmla/attention.h"
#include "quantmla/cache.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

using cache_detail::attention_params;
using cache_detail::check_layer;
using cache_detail::check_length;
using cache_detail::check_write;

// The decode kernel's tiles are then single pages: one decode_rows call per path and tile.
static_assert(kKeyTile == kPageTokens);

class PagedCache final : public MlaCache {
 public:
  PagedCache(const CacheShape& shape, const CacheFormat& format, int64_t capacity)
      : shape_(shape),
        format_(format),
        capacity_(capacity),
        content_bytes_(format.content.encoded_bytes(shape.kv_lora_rank)),
        record_bytes_(format.record_bytes(shape.kv_lora_rank, shape.rope_dim)) {
    const int64_t pages = (capacity + kPageTokens - 1) / kPageTokens;
    for (int64_t page = 0; page < pages; ++page) block_table_.push_back(static_cast<int32_t>(page));
    pool_.assign(static_cast<size_t>(shape.num_layers),
                 std::vector<uint8_t>(static_cast<size_t>(pages * kPageTokens * record_bytes_)));
  }

  const CacheShape& shape() const override { return shape_; }
  std::string format() const override { return format_.to_string(); }
  int64_t capacity() const override { return capacity_; }
  int64_t length() const override { return length_; }
  int64_t bytes_per_token_per_layer() const override { return record_bytes_; }

  void write(int64_t layer, int64_t pos, int64_t n, const float* c, const float* k_pe) override {
    check_layer(shape_, layer);
    check_write(pos, n, length_, capacity_);
    for (int64_t t = 0; t < n; ++t) {
      uint8_t* rec = record(layer, pos + t);
      encode_path(format_.content, c + t * shape_.kv_lora_rank, shape_.kv_lora_rank, rec);
      encode_path(format_.rope, k_pe + t * shape_.rope_dim, shape_.rope_dim, rec + content_bytes_);
    }
  }

  void set_length(int64_t n) override {
    check_length(n, capacity_);
    length_ = n;
  }

  void attend(int64_t layer, const CacheQuery& query, float* out, float* lse) const override {
    check_layer(shape_, layer);
    const TileContext context{this, layer};
    AttentionParams params = attention_params(shape_, query, out, lse);
    params.decode_keys = decode_tile;
    params.decode_context = &context;
    attention_f32(params);
  }

  void read_row(int64_t layer, int64_t pos, float* c, float* k_pe) const override {
    check_layer(shape_, layer);
    decode_row(layer, pos, c, k_pe);
  }

 private:
  struct TileContext {
    const PagedCache* cache;
    int64_t layer;
  };

  // AttentionParams::decode_keys: rows [first, first + count) of one layer, decoded to FP32, one
  // page at a time (records are contiguous only within a page). The prefill kernel asks for spans
  // of several pages.
  static void decode_tile(const void* context, int64_t first, int64_t count, float* rows) {
    const auto& [cache, layer] = *static_cast<const TileContext*>(context);
    const CacheShape& shape = cache->shape_;
    const int64_t width = shape.row_width();
    for (int64_t pos = first, end = first + count; pos < end;) {
      const int64_t n = std::min(end, (pos / kPageTokens + 1) * kPageTokens) - pos;
      const uint8_t* rec = cache->record(layer, pos);
      float* out = rows + (pos - first) * width;
      cpu::decode_rows(cache->format_.content, rec, cache->record_bytes_, n, shape.kv_lora_rank,
                       out, width);
      cpu::decode_rows(cache->format_.rope, rec + cache->content_bytes_, cache->record_bytes_, n,
                       shape.rope_dim, out + shape.kv_lora_rank, width);
      pos += n;
    }
  }

  void decode_row(int64_t layer, int64_t pos, float* c, float* k_pe) const {
    const uint8_t* rec = record(layer, pos);
    decode_path(format_.content, rec, shape_.kv_lora_rank, c);
    decode_path(format_.rope, rec + content_bytes_, shape_.rope_dim, k_pe);
  }

  uint8_t* record(int64_t layer, int64_t pos) {
    return const_cast<uint8_t*>(std::as_const(*this).record(layer, pos));
  }
  const uint8_t* record(int64_t layer, int64_t pos) const {
    const int64_t page = block_table_[static_cast<size_t>(pos / kPageTokens)];
    return pool_[layer].data() + (page * kPageTokens + pos % kPageTokens) * record_bytes_;
  }

  CacheShape shape_;
  CacheFormat format_;
  int64_t capacity_;
  int64_t content_bytes_;
  int64_t record_bytes_;
  int64_t length_ = 0;
  std::vector<int32_t> block_table_;        // logical page -> physical page
  std::vector<std::vector<uint8_t>> pool_;  // per layer: [pages, kPageTokens, record_bytes]
};

bool is_f32(const CacheFormat& format) {
  return format.content.codec == Codec::kF32 && format.rope.codec == Codec::kF32;
}

}  // namespace

std::unique_ptr<MlaCache> make_cache(const CacheShape& shape, const CacheFormat& format,
                                     int64_t capacity) {
  if (is_f32(format)) return make_f32_cache(shape, capacity);
  cache_detail::check_capacity(capacity);
  return std::make_unique<PagedCache>(shape, format, capacity);
}

}  // namespace quantmla
