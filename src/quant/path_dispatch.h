// The one place where a run-time PathFormat becomes a compile-time type: kernels written per format
// (codec, bits and group as template parameters) are reached through visit_path_format, so adding
// a format means adding one case here and the compiler then asks every visitor for its overload.
#pragma once

#include <cstdint>
#include <string>

#include "quant/records.h"
#include "quantmla/cache_format.h"
#include "quantmla/error.h"

namespace quantmla {

// Tags, one per decodable format; Record<kWidth> is the layout of one encoded vector (records.h),
// left undefined for widths the format cannot encode.
struct F32Path {
  template <int kWidth>
  using Record = F32Record<kWidth>;
};
struct Bf16Path {
  template <int kWidth>
  using Record = Bf16Record<kWidth>;
};
template <int kGroupSize>
struct Fp8Path {
  static constexpr int kGroup = kGroupSize;
  template <int kWidth>
  using Record = Fp8Record<kGroup, kWidth>;
};
template <int kCodeBits, int kGroupSize>
struct UniformIntPath {
  static constexpr int kBits = kCodeBits;
  static constexpr int kGroup = kGroupSize;
  template <int kWidth>
  using Record = UniformIntRecord<kBits, kGroup, kWidth>;
  // The layout with kPairs frequency pairs kept in BF16 (PathFormat::bf16_pairs).
  template <int kWidth, int kPairs>
  using KeptPairsRecord = UniformIntKeptPairsRecord<kBits, kGroup, kWidth, kPairs>;
};
struct Q8_0Path {
  template <int kWidth>
  using Record = Q8_0Record<kWidth>;
};
struct Q4_0Path {
  template <int kWidth>
  using Record = Q4_0Record<kWidth>;
};

namespace path_dispatch_detail {
constexpr int64_t key(Codec codec, int64_t group) {
  return static_cast<int64_t>(codec) << 32 | static_cast<uint32_t>(group);
}
}  // namespace path_dispatch_detail

// Calls visitor(Tag{}) with the tag of `format` (the clip ratio plays no part in the layout) and
// returns its result. The tag describes the base record only: kept BF16 pairs (bf16_pairs) follow
// it at kept_pairs_offset, and visitors that decode handle them (see decode_rows). Throws
// InvalidArgument for a codec/group pair without a layout; callers that want check_path_width's
// fuller message call it first.
template <typename Visitor>
decltype(auto) visit_path_format(const PathFormat& format, Visitor&& visitor) {
  using path_dispatch_detail::key;
  switch (key(format.codec, format.group)) {
    case key(Codec::kF32, 0):
      return visitor(F32Path{});
    case key(Codec::kBF16, 0):
      return visitor(Bf16Path{});
    case key(Codec::kFP8, kFp8Group):
      return visitor(Fp8Path<kFp8Group>{});
    case key(Codec::kFP8, kFp8Group / 2):
      return visitor(Fp8Path<kFp8Group / 2>{});
    case key(Codec::kInt8, 32):
      return visitor(UniformIntPath<8, 32>{});
    case key(Codec::kInt8, 64):
      return visitor(UniformIntPath<8, 64>{});
    case key(Codec::kInt8, 128):
      return visitor(UniformIntPath<8, 128>{});
    case key(Codec::kInt4, 32):
      return visitor(UniformIntPath<4, 32>{});
    case key(Codec::kInt4, 64):
      return visitor(UniformIntPath<4, 64>{});
    case key(Codec::kInt4, 128):
      return visitor(UniformIntPath<4, 128>{});
    case key(Codec::kInt2, 32):
      return visitor(UniformIntPath<2, 32>{});
    case key(Codec::kInt2, 64):
      return visitor(UniformIntPath<2, 64>{});
    case key(Codec::kInt2, 128):
      return visitor(UniformIntPath<2, 128>{});
    case key(Codec::kQ8_0, kGgmlBlockValues):
      return visitor(Q8_0Path{});
    case key(Codec::kQ4_0, kGgmlBlockValues):
      return visitor(Q4_0Path{});
    default:
      throw InvalidArgument("path format: no layout for codec " +
                            std::to_string(static_cast<int>(format.codec)) + " with group " +
                            std::to_string(format.group));
  }
}

}  // namespace quantmla
