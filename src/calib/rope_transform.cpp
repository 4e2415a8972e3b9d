// fold_rope_transform (DESIGN §5, RoPE path): a scale and an angle per frequency pair, applied to
// the rows that produce k_pe and, inverted and transposed, to the rows that produce every q_pe.
#include <cmath>
#include <string>

#include "model/weights.h"
#include "quantmla/error.h"
#include "quantmla/model.h"
#include "quantmla/transform.h"

namespace quantmla {
namespace {

// Rows (first, first + 1) of a row-major [out, in] matrix <- scale * Rot(angle) applied to them.
void rotate_row_pair(Linear& linear, int64_t first, float scale, float angle) {
  const float c = scale * std::cos(angle), s = scale * std::sin(angle);
  float* even = linear.weight.data() + first * linear.in;
  float* odd = even + linear.in;
  for (int64_t j = 0; j < linear.in; ++j) {
    const float a = even[j], b = odd[j];
    even[j] = c * a - s * b;
    odd[j] = s * a + c * b;
  }
}

}  // namespace

void fold_rope_transform(Model& model, int64_t layer, const RopeTransform& transform) {
  const ModelConfig& config = model.config();
  const int64_t pairs = config.qk_rope_head_dim / 2;
  if (static_cast<int64_t>(transform.scales.size()) != pairs ||
      static_cast<int64_t>(transform.angles.size()) != pairs) {
    throw ShapeError("RoPE transform of " + std::to_string(transform.scales.size()) +
                     " scales and " + std::to_string(transform.angles.size()) +
                     " angles for qk_rope_head_dim " + std::to_string(config.qk_rope_head_dim) +
                     " (" + std::to_string(pairs) + " pairs)");
  }
  for (int64_t i = 0; i < pairs; ++i) {
    if (!(transform.scales[i] > 0.0f && std::isfinite(transform.scales[i])) ||
        !std::isfinite(transform.angles[i])) {
      throw InvalidArgument("RoPE transform pair " + std::to_string(i) + ": scale " +
                            std::to_string(transform.scales[i]) + ", angle " +
                            std::to_string(transform.angles[i]) +
                            " (scales must be positive, both finite)");
    }
  }
  if (layer < 0 || layer >= config.num_layers) {
    throw InvalidArgument("layer " + std::to_string(layer) + " outside [0, " +
                          std::to_string(config.num_layers) + ")");
  }
  AttentionWeights& attention = model.mutable_weights().layers[layer].attention;
  Linear& queries = config.q_lora_rank > 0 ? attention.q_b : attention.q;
  const int64_t rank = config.kv_lora_rank;
  for (int64_t i = 0; i < pairs; ++i) {
    const float scale = transform.scales[i], angle = transform.angles[i];
    rotate_row_pair(attention.kv_a, rank + 2 * i, scale, angle);
    // Rot(phi)^-T = Rot(phi): the query pair turns the same way and shrinks by the same factor.
    for (int64_t head = 0; head < config.num_heads; ++head) {
      const int64_t first = head * config.qk_head_dim() + config.qk_nope_head_dim + 2 * i;
      rotate_row_pair(queries, first, 1.0f / scale, angle);
    }
  }
  // The original BF16 bits no longer describe these matrices; decode falls back to FP32.
  attention.kv_a.weight_bf16.clear();
  queries.weight_bf16.clear();
}

}  // namespace quantmla
