// One pool of 64-token pages per layer in one cache format, shared by many sequences through
// their block tables: the layout the GPU kernels read (MlaDecodeParams) and the CPU runner reads
// alike. The pool does the bookkeeping (which page belongs to which sequence, how many tokens each
// sequence has committed); its storage lives where the runner that made it computes (host memory
// for the CPU runner, device memory for the CUDA runner).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "quantmla/cache.h"
#include "quantmla/cache_format.h"

namespace quantmla {

// kNone: bookkeeping only, no records (the schedule-only runner's pools, for planning).
enum class PoolMemory { kHost, kDevice, kNone };

// Where a pool's pages live. Every layer has num_pages * kPageTokens records of record_bytes.
class PageStorage {
 public:
  virtual ~PageStorage() = default;
  virtual PoolMemory memory() const = 0;
  // Layer `layer`'s pages: [num_pages, kPageTokens, record_bytes] (a device pointer for kDevice).
  virtual uint8_t* layer_pages(int64_t layer) = 0;
  // Copies whole pages of layers [0, num_layers) to host memory, layer by layer (page pages[i] of
  // layer l to host + (l * pages.size() + i) * page_bytes), or back, and returns once the copy is
  // done (a swapped-out sequence: PagePool::copy_out, copy_in). Between steps only: a copy does
  // not wait for a step still running on the device.
  virtual void read_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                          uint8_t* host);
  virtual void write_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                           const uint8_t* host);
};

// Host storage: one zeroed buffer of `layer_bytes` per layer.
std::unique_ptr<PageStorage> make_host_page_storage(int64_t num_layers, int64_t layer_bytes);

using SequenceId = int64_t;

class PagePool {
 public:
  // `storage` must hold num_pages pages of every layer in `format` (bytes_per_layer()).
  // Throws InvalidArgument for num_pages < 1 or more than int32 block-table entries can name.
  PagePool(const CacheShape& shape, const CacheFormat& format, int64_t num_pages,
           std::unique_ptr<PageStorage> storage);
  // A pool in host memory.
  static std::unique_ptr<PagePool> on_host(const CacheShape& shape, const CacheFormat& format,
                                           int64_t num_pages);

  // Bytes one page of every layer takes, records only.
  static int64_t bytes_per_page(const CacheShape& shape, const CacheFormat& format);
  // Pages `bytes` of memory hold (floor), for a cache budget given in bytes.
  static int64_t pages_for_bytes(const CacheShape& shape, const CacheFormat& format, int64_t bytes);
  // Pages that hold `tokens` tokens.
  static int64_t pages_for_tokens(int64_t tokens) {
    return (tokens + kPageTokens - 1) / kPageTokens;
  }

  const CacheShape& shape() const { return shape_; }
  const CacheFormat& format() const { return format_; }
  int64_t record_bytes() const { return record_bytes_; }
  int64_t content_bytes() const { return content_bytes_; }
  int64_t bytes_per_layer() const { return num_pages_ * kPageTokens * record_bytes_; }
  int64_t num_pages() const { return num_pages_; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_pages() const { return num_pages_ - free_pages(); }
  PageStorage& storage() { return *storage_; }
  PoolMemory memory() const { return storage_->memory(); }

  // A new sequence with no pages and no tokens.
  SequenceId add_sequence();
  // Frees the sequence's pages (at once) and forgets it. Throws InvalidArgument for an unknown id.
  void remove_sequence(SequenceId sequence);
  bool has_sequence(SequenceId sequence) const { return sequences_.contains(sequence); }
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // Grows the sequence's block table until it holds `tokens` tokens. All or nothing: when the
  // free pages do not suffice it throws CapacityError (naming the pages needed and free) and the
  // pool is unchanged. Never shrinks.
  void reserve(SequenceId sequence, int64_t tokens);
  // Tokens the sequence's pages hold, and tokens it has committed.
  int64_t capacity(SequenceId sequence) const;
  int64_t length(SequenceId sequence) const;
  // Commits `tokens` tokens (after a step wrote them in every layer) or truncates to them; whole
  // pages past the new length stay reserved. Throws CapacityError past capacity().
  void set_length(SequenceId sequence, int64_t tokens);
  // Logical page -> physical page.
  const std::vector<int32_t>& block_table(SequenceId sequence) const;

  // Host bytes that hold the records of a sequence's first `tokens` tokens in every layer, in
  // whole pages (copy_out / copy_in: a preemption by swap).
  int64_t swap_bytes(int64_t tokens) const {
    return pages_for_tokens(tokens) * kPageTokens * record_bytes_ * shape_.num_layers;
  }
  // Copies the records of the sequence's first `tokens` tokens (at most its length) of every
  // layer into `host` (swap_bytes(tokens) bytes, layer by layer, its pages in order); copy_in
  // writes them back into a sequence whose pages hold `tokens` tokens and commits that length.
  // A pool without records (PoolMemory::kNone) copies nothing. Throws InvalidArgument for tokens
  // outside [0, length] (copy_out) or [0, capacity] (copy_in) and ShapeError for a buffer of
  // another size.
  void copy_out(SequenceId sequence, int64_t tokens, std::span<uint8_t> host) const;
  void copy_in(SequenceId sequence, int64_t tokens, std::span<const uint8_t> host);

  // Host storage only: the record of token `pos` of `sequence` in `layer`. Throws InvalidArgument
  // for device storage, a layer outside the shape or a position past capacity().
  uint8_t* record(int64_t layer, SequenceId sequence, int64_t pos);
  const uint8_t* record(int64_t layer, SequenceId sequence, int64_t pos) const;

 private:
  struct Sequence {
    std::vector<int32_t> block_table;
    int64_t length = 0;
  };
  const Sequence& find(SequenceId sequence) const;
  Sequence& find(SequenceId sequence);
  // The pages that hold a sequence's first `tokens` tokens, after checking a swap buffer's size.
  std::span<const int32_t> swap_pages(const Sequence& seq, int64_t tokens, size_t host_bytes) const;

  CacheShape shape_;
  CacheFormat format_;
  int64_t num_pages_;
  int64_t record_bytes_;
  int64_t content_bytes_;
  std::unique_ptr<PageStorage> storage_;
  std::vector<int32_t> free_;  // a stack: the page freed last is handed out first
  std::map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
};

}  // namespace quantmla
