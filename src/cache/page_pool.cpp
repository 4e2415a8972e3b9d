#include "quantmla/page_pool.h"

#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "quantmla/error.h"

namespace quantmla {
namespace {

class HostPageStorage final : public PageStorage {
 public:
  HostPageStorage(int64_t num_layers, int64_t layer_bytes)
      : layers_(static_cast<size_t>(num_layers),
                std::vector<uint8_t>(static_cast<size_t>(layer_bytes))) {}
  PoolMemory memory() const override { return PoolMemory::kHost; }
  uint8_t* layer_pages(int64_t layer) override {
    return layers_[static_cast<size_t>(layer)].data();
  }

 private:
  std::vector<std::vector<uint8_t>> layers_;
};

}  // namespace

void PageStorage::read_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                             uint8_t* host) {
  if (memory() == PoolMemory::kNone) return;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const uint8_t* base = layer_pages(layer);
    for (const int32_t page : pages) {
      std::memcpy(host, base + page * page_bytes, static_cast<size_t>(page_bytes));
      host += page_bytes;
    }
  }
}

void PageStorage::write_pages(int64_t num_layers, std::span<const int32_t> pages,
                              int64_t page_bytes, const uint8_t* host) {
  if (memory() == PoolMemory::kNone) return;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    uint8_t* base = layer_pages(layer);
    for (const int32_t page : pages) {
      std::memcpy(base + page * page_bytes, host, static_cast<size_t>(page_bytes));
      host += page_bytes;
    }
  }
}

std::unique_ptr<PageStorage> make_host_page_storage(int64_t num_layers, int64_t layer_bytes) {
  return std::make_unique<HostPageStorage>(num_layers, layer_bytes);
}

PagePool::PagePool(const CacheShape& shape, const CacheFormat& format, int64_t num_pages,
                   std::unique_ptr<PageStorage> storage)
    : shape_(shape),
      format_(format),
      num_pages_(num_pages),
      record_bytes_(format.record_bytes(shape.kv_lora_rank, shape.rope_dim)),
      content_bytes_(format.content.encoded_bytes(shape.kv_lora_rank)),
      storage_(std::move(storage)) {
  if (num_pages < 1 || num_pages > std::numeric_limits<int32_t>::max()) {
    throw InvalidArgument("page pool: " + std::to_string(num_pages) +
                          " pages, expected 1 to 2^31 - 1");
  }
  if (storage_ == nullptr) throw InvalidArgument("page pool: no storage");
  free_.reserve(static_cast<size_t>(num_pages));
  for (int64_t page = num_pages - 1; page >= 0; --page) free_.push_back(static_cast<int32_t>(page));
}

std::unique_ptr<PagePool> PagePool::on_host(const CacheShape& shape, const CacheFormat& format,
                                            int64_t num_pages) {
  const int64_t layer_bytes = std::max<int64_t>(num_pages, 0) * kPageTokens *
                              format.record_bytes(shape.kv_lora_rank, shape.rope_dim);
  return std::make_unique<PagePool>(shape, format, num_pages,
                                    make_host_page_storage(shape.num_layers, layer_bytes));
}

int64_t PagePool::bytes_per_page(const CacheShape& shape, const CacheFormat& format) {
  return shape.num_layers * kPageTokens * format.record_bytes(shape.kv_lora_rank, shape.rope_dim);
}

int64_t PagePool::pages_for_bytes(const CacheShape& shape, const CacheFormat& format,
                                  int64_t bytes) {
  return std::max<int64_t>(bytes, 0) / bytes_per_page(shape, format);
}

SequenceId PagePool::add_sequence() {
  const SequenceId id = next_id_++;
  sequences_.emplace(id, Sequence{});
  return id;
}

void PagePool::remove_sequence(SequenceId sequence) {
  Sequence& seq = find(sequence);
  for (auto page = seq.block_table.rbegin(); page != seq.block_table.rend(); ++page) {
    free_.push_back(*page);
  }
  sequences_.erase(sequence);
}

void PagePool::reserve(SequenceId sequence, int64_t tokens) {
  Sequence& seq = find(sequence);
  const int64_t have = static_cast<int64_t>(seq.block_table.size());
  const int64_t need = pages_for_tokens(tokens) - have;
  if (need <= 0) return;
  if (need > free_pages()) {
    throw CapacityError("page pool full: sequence " + std::to_string(sequence) + " needs " +
                        std::to_string(need) + " more pages for " + std::to_string(tokens) +
                        " tokens, " + std::to_string(free_pages()) + " of " +
                        std::to_string(num_pages_) + " are free");
  }
  for (int64_t i = 0; i < need; ++i) {
    seq.block_table.push_back(free_.back());
    free_.pop_back();
  }
}

int64_t PagePool::capacity(SequenceId sequence) const {
  return static_cast<int64_t>(find(sequence).block_table.size()) * kPageTokens;
}

int64_t PagePool::length(SequenceId sequence) const { return find(sequence).length; }

void PagePool::set_length(SequenceId sequence, int64_t tokens) {
  Sequence& seq = find(sequence);
  const int64_t held = static_cast<int64_t>(seq.block_table.size()) * kPageTokens;
  if (tokens < 0 || tokens > held) {
    throw CapacityError("sequence " + std::to_string(sequence) + ": length " +
                        std::to_string(tokens) + " outside [0, " + std::to_string(held) +
                        "] (the tokens its pages hold)");
  }
  seq.length = tokens;
}

const std::vector<int32_t>& PagePool::block_table(SequenceId sequence) const {
  return find(sequence).block_table;
}

std::span<const int32_t> PagePool::swap_pages(const Sequence& seq, int64_t tokens,
                                              size_t host_bytes) const {
  if (static_cast<int64_t>(host_bytes) != swap_bytes(tokens)) {
    throw ShapeError("page pool: " + std::to_string(host_bytes) + " bytes for the records of " +
                     std::to_string(tokens) + " tokens, expected " +
                     std::to_string(swap_bytes(tokens)));
  }
  return {seq.block_table.data(), static_cast<size_t>(pages_for_tokens(tokens))};
}

void PagePool::copy_out(SequenceId sequence, int64_t tokens, std::span<uint8_t> host) const {
  const Sequence& seq = find(sequence);
  if (tokens < 0 || tokens > seq.length) {
    throw InvalidArgument("page pool: copy of " + std::to_string(tokens) + " tokens of sequence " +
                          std::to_string(sequence) + ", which holds " + std::to_string(seq.length));
  }
  storage_->read_pages(shape_.num_layers, swap_pages(seq, tokens, host.size()),
                       kPageTokens * record_bytes_, host.data());
}

void PagePool::copy_in(SequenceId sequence, int64_t tokens, std::span<const uint8_t> host) {
  Sequence& seq = find(sequence);
  const int64_t held = static_cast<int64_t>(seq.block_table.size()) * kPageTokens;
  if (tokens < 0 || tokens > held) {
    throw InvalidArgument("page pool: copy of " + std::to_string(tokens) +
                          " tokens into sequence " + std::to_string(sequence) +
                          ", whose pages hold " + std::to_string(held));
  }
  storage_->write_pages(shape_.num_layers, swap_pages(seq, tokens, host.size()),
                        kPageTokens * record_bytes_, host.data());
  seq.length = tokens;
}

const uint8_t* PagePool::record(int64_t layer, SequenceId sequence, int64_t pos) const {
  return const_cast<PagePool*>(this)->record(layer, sequence, pos);
}

uint8_t* PagePool::record(int64_t layer, SequenceId sequence, int64_t pos) {
  if (storage_->memory() != PoolMemory::kHost) {
    throw InvalidArgument("page pool: records of a device pool are not readable on the host");
  }
  if (layer < 0 || layer >= shape_.num_layers) {
    throw InvalidArgument("page pool: layer " + std::to_string(layer) + " outside [0, " +
                          std::to_string(shape_.num_layers) + ")");
  }
  const Sequence& seq = find(sequence);
  const int64_t held = static_cast<int64_t>(seq.block_table.size()) * kPageTokens;
  if (pos < 0 || pos >= held) {
    throw InvalidArgument("sequence " + std::to_string(sequence) + ": position " +
                          std::to_string(pos) + " outside its " + std::to_string(held) +
                          " reserved tokens");
  }
  const int64_t page = seq.block_table[static_cast<size_t>(pos / kPageTokens)];
  return storage_->layer_pages(layer) + (page * kPageTokens + pos % kPageTokens) * record_bytes_;
}

const PagePool::Sequence& PagePool::find(SequenceId sequence) const {
  const auto it = sequences_.find(sequence);
  if (it == sequences_.end()) {
    throw InvalidArgument("page pool: no sequence " + std::to_string(sequence));
  }
  return it->second;
}

PagePool::Sequence& PagePool::find(SequenceId sequence) {
  return const_cast<Sequence&>(std::as_const(*this).find(sequence));
}

}  // namespace quantmla
