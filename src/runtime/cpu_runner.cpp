// The CPU runner: the model's forward pass over a ragged batch whose rows live in a host PagePool.
#include <algorithm>
#include <string>
#include <vector>

#include "cache/cache_common.h"
#include "kernels/cpu/decode_rows.h"
#include "model/forward.h"
#include "quantmla/attention.h"
#include "quantmla/error.h"
#include "quantmla/model.h"
#include "quantmla/runner.h"

namespace quantmla {
namespace {

// The batch's sequences in a host pool: rows encoded into their records on write, decoded page
// by page (through the block table) inside attention.
class PoolRowStore final : public detail::RowStore {
 public:
  PoolRowStore(PagePool& pool, std::vector<SequenceId> sequences)
      : pool_(pool), sequences_(std::move(sequences)) {}

  void write(int64_t segment, int64_t layer, int64_t pos, int64_t n, const float* c,
             const float* k_pe) override {
    const CacheShape& shape = pool_.shape();
    const CacheFormat& format = pool_.format();
    for (int64_t t = 0; t < n; ++t) {
      uint8_t* rec = pool_.record(layer, sequences_[segment], pos + t);
      encode_path(format.content, c + t * shape.kv_lora_rank, shape.kv_lora_rank, rec);
      encode_path(format.rope, k_pe + t * shape.rope_dim, shape.rope_dim,
                  rec + pool_.content_bytes());
    }
  }

  void attend(int64_t segment, int64_t layer, const CacheQuery& query, float* out) const override {
    const TileContext context{this, sequences_[segment], layer};
    AttentionParams params = cache_detail::attention_params(pool_.shape(), query, out, nullptr);
    params.decode_keys = decode_keys;
    params.decode_context = &context;
    attention_f32(params);
  }

  void read_rows(int64_t segment, int64_t layer, int64_t count, float* rows) const override {
    const int64_t pages = PagePool::pages_for_tokens(count);
#pragma omp parallel for schedule(static)
    for (int64_t page = 0; page < pages; ++page) {
      const int64_t first = page * kPageTokens;
      decode(sequences_[segment], layer, first, std::min(kPageTokens, count - first),
             rows + first * pool_.shape().row_width());
    }
  }

 private:
  struct TileContext {
    const PoolRowStore* store;
    SequenceId sequence;
    int64_t layer;
  };

  static void decode_keys(const void* context, int64_t first, int64_t count, float* rows) {
    const auto& [store, sequence, layer] = *static_cast<const TileContext*>(context);
    store->decode(sequence, layer, first, count, rows);
  }

  // Rows [first, first + count) of one sequence as FP32 [count, row_width], page by page
  // (records are contiguous only within a page).
  void decode(SequenceId sequence, int64_t layer, int64_t first, int64_t count, float* rows) const {
    const CacheShape& shape = pool_.shape();
    const CacheFormat& format = pool_.format();
    const int64_t width = shape.row_width();
    for (int64_t pos = first, end = first + count; pos < end;) {
      const int64_t n = std::min(end, (pos / kPageTokens + 1) * kPageTokens) - pos;
      const uint8_t* rec = pool_.record(layer, sequence, pos);
      float* out = rows + (pos - first) * width;
      cpu::decode_rows(format.content, rec, pool_.record_bytes(), n, shape.kv_lora_rank, out,
                       width);
      cpu::decode_rows(format.rope, rec + pool_.content_bytes(), pool_.record_bytes(), n,
                       shape.rope_dim, out + shape.kv_lora_rank, width);
      pos += n;
    }
  }

  PagePool& pool_;
  std::vector<SequenceId> sequences_;
};

class CpuRunner final : public Runner {
 public:
  explicit CpuRunner(const Model& model) : model_(model) {}

  const ModelConfig& config() const override { return model_.config(); }
  std::string device() const override { return "cpu"; }

  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    return PagePool::on_host(model_.cache_shape(), format, num_pages);
  }

  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    if (pool.memory() != PoolMemory::kHost) {
      throw InvalidArgument("step: the CPU runner needs a pool in host memory");
    }
    check_step(batch, pool, config(), outputs);
    std::vector<int32_t> tokens;
    tokens.reserve(static_cast<size_t>(batch.num_tokens()));
    std::vector<detail::ForwardSegment> segments;
    std::vector<SequenceId> sequences;
    std::vector<int64_t> logit_tokens;
    for (const SequenceChunk& chunk : batch.chunks) {
      const auto first = static_cast<int64_t>(tokens.size());
      const auto n = static_cast<int64_t>(chunk.tokens.size());
      segments.push_back({first, n, pool.length(chunk.sequence)});
      sequences.push_back(chunk.sequence);
      tokens.insert(tokens.end(), chunk.tokens.begin(), chunk.tokens.end());
      if (chunk.logits == LogitRows::kAll) {
        for (int64_t i = 0; i < n; ++i) logit_tokens.push_back(first + i);
      } else if (chunk.logits == LogitRows::kLast) {
        logit_tokens.push_back(first + n - 1);
      }
    }
    const int64_t vocab = config().vocab_size;
    // Every row's logits straight into the caller's span where it takes them all; otherwise into
    // the runner's buffer, the returned rows copied out after.
    const bool all_returned =
        batch.num_returned_logit_rows() == static_cast<int64_t>(logit_tokens.size());
    std::span<float> logits = all_returned ? outputs.logits : std::span<float>();
    if (logits.empty() && (!outputs.tokens.empty() || !outputs.logits.empty())) {
      const size_t size = logit_tokens.size() * static_cast<size_t>(vocab);
      if (sampled_logits_.size() < size) sampled_logits_.resize(size);
      logits = std::span<float>(sampled_logits_).first(size);
    }
    PoolRowStore store(pool, sequences);
    detail::run_forward(config(), model_.weights(), tokens, segments, store,
                        logits.empty() ? std::span<const int64_t>() : logit_tokens, logits, nullptr,
                        workspace_);
    for (size_t s = 0; s < segments.size(); ++s) {
      pool.set_length(sequences[s], segments[s].pos0 + segments[s].num_tokens);
    }
    if (!outputs.logits.empty() && logits.data() != outputs.logits.data()) {
      auto to = outputs.logits.begin();
      auto from = logits.begin();
      for (const SequenceChunk& chunk : batch.chunks) {
        const auto size = static_cast<ptrdiff_t>(chunk.num_logit_rows() * vocab);
        if (chunk.return_logits) to = std::copy(from, from + size, to);
        from += size;
      }
    }
    if (outputs.tokens.empty()) return;
    // Row r predicts the token after batch token logit_tokens[r].
    size_t row = 0;
    for (size_t s = 0; s < segments.size(); ++s) {
      const SequenceChunk& chunk = batch.chunks[s];
      for (; row < logit_tokens.size() &&
             logit_tokens[row] < segments[s].first_token + segments[s].num_tokens;
           ++row) {
        const int64_t position = segments[s].pos0 + logit_tokens[row] - segments[s].first_token;
        outputs.tokens[row] = sample_token(
            logits.subspan(row * static_cast<size_t>(vocab), static_cast<size_t>(vocab)),
            chunk.sampling,
            counter_uniform(chunk.sampling.seed, static_cast<uint64_t>(position + 1)));
      }
    }
  }

 private:
  const Model& model_;
  // Kept from step to step (a runner takes one step at a time): steps of sizes seen before
  // allocate nothing.
  detail::ForwardWorkspace workspace_;
  std::vector<float> sampled_logits_;  // the logit rows of steps that only want tokens
};

}  // namespace

std::unique_ptr<Runner> make_cpu_runner(const Model& model) {
  return std::make_unique<CpuRunner>(model);
}

}  // namespace quantmla
