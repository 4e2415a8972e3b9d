// The schedule-only runner: the step seam with nothing behind it, so that the scheduler's
// decisions (admission, chunking, preemption) over a real model's page budget can be replayed in
// seconds on any machine.
#include <algorithm>
#include <string>

#include "quantmla/error.h"
#include "quantmla/runner.h"

namespace quantmla {
namespace {

class NoPageStorage final : public PageStorage {
 public:
  PoolMemory memory() const override { return PoolMemory::kNone; }
  uint8_t* layer_pages(int64_t) override { return nullptr; }
};

class ScheduleOnlyRunner final : public Runner {
 public:
  explicit ScheduleOnlyRunner(const ModelConfig& config)
      : config_(config),
        token_(static_cast<int32_t>((std::max<int64_t>(config.eos_token_id, -1) + 1) %
                                    config.vocab_size)) {}

  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return "schedule-only"; }

  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    return std::make_unique<PagePool>(
        CacheShape{config_.num_layers, config_.kv_lora_rank, config_.qk_rope_head_dim}, format,
        num_pages, std::make_unique<NoPageStorage>());
  }

  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    if (pool.memory() != PoolMemory::kNone) {
      throw InvalidArgument("schedule-only runner: the pool was made by another runner");
    }
    check_step(batch, pool, config_, outputs);
    for (const SequenceChunk& chunk : batch.chunks) {
      pool.set_length(chunk.sequence,
                      pool.length(chunk.sequence) + static_cast<int64_t>(chunk.tokens.size()));
    }
    std::fill(outputs.tokens.begin(), outputs.tokens.end(), token_);
    std::fill(outputs.logits.begin(), outputs.logits.end(), 0.0f);
  }

 private:
  ModelConfig config_;
  int32_t token_;  // the token every row "generates": the one after EOS, never EOS itself
};

}  // namespace

std::unique_ptr<Runner> make_schedule_only_runner(const ModelConfig& config) {
  return std::make_unique<ScheduleOnlyRunner>(config);
}

}  // namespace quantmla
