// Which cache formats the GPU kernels implement (host code).
#include <string>

#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

void check_gpu_format(const CacheFormat& format) {
  const PathFormat& content = format.content;
  const PathFormat& rope = format.rope;
  const bool content_ok = content.bf16_pairs.empty() &&
                          (content.codec == Codec::kBF16 || content.codec == Codec::kFP8 ||
                           ((content.codec == Codec::kInt4 || content.codec == Codec::kInt2) &&
                            (content.group == 64 || content.group == 128)));
  const bool rope_ok =
      (rope.codec == Codec::kBF16) || (rope.codec == Codec::kInt4 && rope.group == 64 &&
                                       static_cast<int>(rope.bf16_pairs.size()) <= kMaxKeptPairs);
  if (!content_ok || !rope_ok) {
    throw InvalidArgument("cache format " + format.to_string() +
                          " has no GPU kernel: content bf16|fp8|int4:g64|int4:g128|int2:g64|"
                          "int2:g128, rope bf16|int4:g64 with up to " +
                          std::to_string(kMaxKeptPairs) + " bf16pairs");
  }
}

}  // namespace quantmla::gpu
