// The CPU forward pass over a ragged batch (internal): the one engine behind Model::forward (one
// sequence in an MlaCache) and the CPU runner (many sequences in a PagePool).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "quantmla/cache.h"
#include "quantmla/config.h"
#include "quantmla/model.h"

namespace quantmla::detail {

// Tokens [first_token, first_token + num_tokens) of the batch belong to one sequence, at
// positions [pos0, pos0 + num_tokens).
struct ForwardSegment {
  int64_t first_token = 0;
  int64_t num_tokens = 0;
  int64_t pos0 = 0;
};

// Where a forward pass reads and writes each segment's cache rows.
class RowStore {
 public:
  virtual ~RowStore() = default;
  // Stores rows for positions [pos, pos + n) of `segment` in `layer`. c: [n, kv_lora_rank],
  // k_pe: [n, rope_dim] (after RoPE).
  virtual void write(int64_t segment, int64_t layer, int64_t pos, int64_t n, const float* c,
                     const float* k_pe) = 0;
  // Absorbed attention of `query` over the segment's rows [0, query position]; out: [n_q,
  // num_heads, kv_lora_rank].
  virtual void attend(int64_t segment, int64_t layer, const CacheQuery& query,
                      float* out) const = 0;
  // Rows [0, count) as attention sees them: [count, kv_lora_rank + rope_dim].
  virtual void read_rows(int64_t segment, int64_t layer, int64_t count, float* rows) const = 0;
};

// The forward pass's buffers, kept by the caller from one call to the next (the CPU runner keeps
// one for its steps): each grows to the largest step it has served and is never shrunk, so that
// steps of sizes seen before allocate nothing. One forward pass at a time per workspace.
struct ForwardWorkspace {
  // The stream and the attention's per-token buffers.
  std::vector<float> x, h, q, q_low, kv, latent, k_pe, head_out, final_rows;
  // The absorbed form's gathered rows.
  std::vector<float> q_gathered, q_absorbed, attended, absorbed_out;
  // The expanded form: the cache rows read back, their up-projection, one head's keys, scores.
  std::vector<float> key_rows, up_keys, head_keys, scores;
  // MLPs and experts.
  std::vector<float> gate, up, router_logits, gathered, expert_out;
};

// Runs `tokens` (ids already checked) through the model: segment by segment the rows are written
// into `rows` and attended, everything else runs over all tokens at once. Writes the logits of
// the tokens named in logit_tokens (batch indices, in that order) into logits ([size, vocab]).
// trace (one segment only) receives every layer's attention in the absorbed form.
void run_forward(const ModelConfig& config, const ModelWeights& weights,
                 std::span<const int32_t> tokens, std::span<const ForwardSegment> segments,
                 RowStore& rows, std::span<const int64_t> logit_tokens, std::span<float> logits,
                 AttentionTrace* trace, ForwardWorkspace& workspace);

}  // namespace quantmla::detail
