// What every runner checks before a step, and the sizes of a step's outputs.
#include <set>
#include <string>

#include "quantmla/error.h"
#include "quantmla/runner.h"

namespace quantmla {

int64_t StepBatch::num_tokens() const {
  int64_t total = 0;
  for (const SequenceChunk& chunk : chunks) total += static_cast<int64_t>(chunk.tokens.size());
  return total;
}

int64_t SequenceChunk::num_logit_rows() const {
  switch (logits) {
    case LogitRows::kNone:
      return 0;
    case LogitRows::kLast:
      return 1;
    case LogitRows::kAll:
      return static_cast<int64_t>(tokens.size());
  }
  throw InvalidArgument("step: a chunk's LogitRows value " +
                        std::to_string(static_cast<int>(logits)) +
                        " is not one of kNone, kLast, kAll");
}

int64_t StepBatch::num_logit_rows() const {
  int64_t rows = 0;
  for (const SequenceChunk& chunk : chunks) rows += chunk.num_logit_rows();
  return rows;
}

int64_t StepBatch::num_returned_logit_rows() const {
  int64_t rows = 0;
  for (const SequenceChunk& chunk : chunks)
    rows += chunk.return_logits ? chunk.num_logit_rows() : 0;
  return rows;
}

void check_step(const StepBatch& batch, const PagePool& pool, const ModelConfig& config,
                const StepOutputs& outputs) {
  if (batch.chunks.empty()) throw InvalidArgument("step: the batch has no sequences");
  const CacheShape expected{config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim};
  if (!(pool.shape() == expected)) {
    throw ShapeError(
        "step: the pool's cache shape (layers " + std::to_string(pool.shape().num_layers) +
        ", rank " + std::to_string(pool.shape().kv_lora_rank) + ", rope " +
        std::to_string(pool.shape().rope_dim) + ") does not match the model's (" +
        std::to_string(expected.num_layers) + ", " + std::to_string(expected.kv_lora_rank) + ", " +
        std::to_string(expected.rope_dim) + ")");
  }
  std::set<SequenceId> seen;
  for (size_t i = 0; i < batch.chunks.size(); ++i) {
    const SequenceChunk& chunk = batch.chunks[i];
    const std::string where =
        "step: chunk " + std::to_string(i) + " (sequence " + std::to_string(chunk.sequence) + ")";
    if (!pool.has_sequence(chunk.sequence)) throw InvalidArgument(where + " is not in the pool");
    if (!seen.insert(chunk.sequence).second) {
      throw InvalidArgument(where + " appears twice in one step");
    }
    if (chunk.tokens.empty()) throw InvalidArgument(where + " has no tokens");
    for (size_t t = 0; t < chunk.tokens.size(); ++t) {
      if (chunk.tokens[t] < 0 || chunk.tokens[t] >= config.vocab_size) {
        throw InvalidArgument(where + ": token id " + std::to_string(chunk.tokens[t]) +
                              " at index " + std::to_string(t) + " is outside the vocabulary [0, " +
                              std::to_string(config.vocab_size) + ")");
      }
    }
    const int64_t end = pool.length(chunk.sequence) + static_cast<int64_t>(chunk.tokens.size());
    if (end > pool.capacity(chunk.sequence)) {
      throw CapacityError(where + ": positions up to " + std::to_string(end) +
                          " but its pages hold " + std::to_string(pool.capacity(chunk.sequence)) +
                          " tokens (reserve them first)");
    }
    if (!outputs.tokens.empty() && chunk.logits != LogitRows::kNone) {
      check_sampler_options(chunk.sampling);
    }
  }
  const int64_t rows = batch.num_logit_rows();
  const int64_t returned = batch.num_returned_logit_rows();
  if (!outputs.logits.empty() &&
      static_cast<int64_t>(outputs.logits.size()) != returned * config.vocab_size) {
    throw ShapeError("step: logits span holds " + std::to_string(outputs.logits.size()) +
                     " floats, the batch returns " + std::to_string(returned) + " rows of " +
                     std::to_string(config.vocab_size));
  }
  if (!outputs.tokens.empty() && static_cast<int64_t>(outputs.tokens.size()) != rows) {
    throw ShapeError("step: tokens span holds " + std::to_string(outputs.tokens.size()) +
                     " ids, the batch returns " + std::to_string(rows) + " rows");
  }
}

}  // namespace quantmla
