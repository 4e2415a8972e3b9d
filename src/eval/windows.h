// The window protocol shared by the evaluators (internal).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "quantmla/model.h"

namespace quantmla {

// Windows of ctx tokens ([BOS] + ctx - 1 text tokens) that `tokens` ids fill, at most max_windows
// (0 = no limit). Throws InvalidArgument for ctx < 2, ctx beyond the model, or no whole window.
int64_t count_windows(const Model& model, size_t tokens, int64_t ctx, int64_t max_windows);
int64_t count_windows(const ModelConfig& config, size_t tokens, int64_t ctx, int64_t max_windows);
// log softmax of one row of logits, in double (out[vocab]).
void log_softmax(const float* logits, int64_t vocab, double* out);
// Window `index`: [BOS] + ids[index * (ctx - 1), (index + 1) * (ctx - 1)).
void fill_window(const Model& model, std::span<const int32_t> ids, int64_t ctx, int64_t index,
                 std::vector<int32_t>& window);
void fill_window(const ModelConfig& config, std::span<const int32_t> ids, int64_t ctx,
                 int64_t index, std::vector<int32_t>& window);

}  // namespace quantmla
