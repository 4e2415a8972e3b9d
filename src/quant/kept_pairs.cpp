// Kept BF16 pairs of the uniform-int codecs (DESIGN §9: the RoPE key's high-energy pairs).
#include "quant/kept_pairs.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "quant/codec_kernels.h"
#include "quant/format_checks.h"
#include "quant/records.h"
#include "quantmla/dtype.h"

namespace quantmla {
namespace {

// Widths up to the content latent's are copied on the stack: this runs for every cache write.
constexpr int64_t kStackWidth = 512;

// In a copy of the values, gives every kept channel the lowest value of the other channels of its
// group (0 where the group holds kept channels only), so that the base encoder's min and max are
// those of the other channels. The lowest is found by the encoder's own fold (std::min from the
// first channel on), so that NaNs and signed zeros leave the same min and max as they would with
// the kept channels absent.
void hide_kept_channels(const std::vector<int>& pairs, int group, const float* values,
                        int64_t width, float* hidden) {
  std::copy(values, values + width, hidden);
  size_t next = 0;  // the first kept pair at or after the current group
  for (int64_t start = 0; start < width; start += group) {
    const int64_t end = start + group;
    const size_t first = next;
    // Groups hold whole pairs (groups are multiples of 32 channels and start at even channels).
    while (next < pairs.size() && 2 * static_cast<int64_t>(pairs[next]) < end) ++next;
    if (first == next) continue;
    bool found = false;
    float lowest = 0.0f;
    size_t kept = first;
    for (int64_t channel = start; channel < end; ++channel) {
      if (kept < next && channel / 2 == pairs[kept]) {
        if (channel % 2 == 1) ++kept;
        continue;
      }
      lowest = found ? std::min(lowest, values[channel]) : values[channel];
      found = true;
    }
    for (size_t k = first; k < next; ++k) {
      hidden[2 * pairs[k]] = lowest;
      hidden[2 * pairs[k] + 1] = lowest;
    }
  }
}

}  // namespace

void encode_uniform_int_kept_pairs(const PathFormat& format, const float* values, int64_t width,
                                   uint8_t* out) {
  std::array<float, kStackWidth> stack;
  std::vector<float> heap;
  float* hidden = stack.data();
  if (width > kStackWidth) {
    heap.resize(static_cast<size_t>(width));
    hidden = heap.data();
  }
  hide_kept_channels(format.bf16_pairs, format.group, values, width, hidden);
  encode_uniform_int(format.bits(), format.group, format.clip, hidden, width, out);
  uint8_t* stored = out + kept_pairs_offset(format, width);
  for (const int pair : format.bf16_pairs) {
    store_le16(stored, f32_to_bf16(values[2 * pair]));
    store_le16(stored + 2, f32_to_bf16(values[2 * pair + 1]));
    stored += kBf16PairBytes;
  }
}

void restore_kept_pairs(const std::vector<int>& pairs, const uint8_t* stored, float* values) {
  for (const int pair : pairs) {
    values[2 * pair] = bf16_to_f32(load_le16(stored));
    values[2 * pair + 1] = bf16_to_f32(load_le16(stored + 2));
    stored += kBf16PairBytes;
  }
}

}  // namespace quantmla
