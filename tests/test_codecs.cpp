// Byte layouts, rounding rules and error bounds of the cache codecs (encode_path / decode_path) and
// the e4m3 scalar conversions.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "quant/rounding.h"
#include "quantmla/cache_format.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "test_seed.h"

namespace quantmla {
namespace {

constexpr float kFloatEpsilon = std::numeric_limits<float>::epsilon();
constexpr uint8_t kGuardByte = 0xa5;
constexpr size_t kGuardBytes = 16;

// The codecs' branch-free rounding equals nearbyint (half to even in the default rounding mode)
// on its whole range: every float in [0, 512) (all the codes of 8-bit and e4m3 and far beyond),
// then every 97th float up to 2^23 (every float's bits in that range are visited in steps that
// land on both parities, halves and the values next to them).
TEST(Rounding, HalfToEvenMatchesNearbyint) {
  const auto check = [](float value) {
    ASSERT_EQ(round_half_even_nonnegative(value), static_cast<int>(std::nearbyint(value))) << value;
  };
  for (uint32_t bits = 0; std::bit_cast<float>(bits) < 512.0f; ++bits) {
    check(std::bit_cast<float>(bits));
  }
  for (uint32_t bits = std::bit_cast<uint32_t>(512.0f); std::bit_cast<float>(bits) < 8388608.0f;
       bits += 97) {
    check(std::bit_cast<float>(bits));
  }
  for (float half = 0.5f; half < 8388608.0f; half = half * 2.0f + 0.5f) check(half);
}

uint16_t load_le16(const std::vector<uint8_t>& bytes, size_t offset) {
  return static_cast<uint16_t>(bytes[offset] | bytes[offset + 1] << 8);
}
float load_le_f32(const std::vector<uint8_t>& bytes, size_t offset) {
  uint32_t bits = 0;
  for (int i = 0; i < 4; ++i) bits |= static_cast<uint32_t>(bytes[offset + i]) << (8 * i);
  return std::bit_cast<float>(bits);
}
float round_to_f16(float value) { return f16_to_f32(f32_to_f16(value)); }

// Encodes into a buffer with guard bytes behind it and checks that the codec wrote no further
// than encoded_bytes says.
std::vector<uint8_t> encode(const PathFormat& format, const std::vector<float>& values) {
  const auto width = static_cast<int64_t>(values.size());
  const auto size = static_cast<size_t>(format.encoded_bytes(width));
  std::vector<uint8_t> bytes(size + kGuardBytes, kGuardByte);
  encode_path(format, values.data(), width, bytes.data());
  for (size_t i = size; i < bytes.size(); ++i) {
    EXPECT_EQ(bytes[i], kGuardByte) << format.to_string() << " wrote past its " << size << " bytes";
  }
  bytes.resize(size);
  return bytes;
}

std::vector<float> decode(const PathFormat& format, const std::vector<uint8_t>& bytes,
                          int64_t width) {
  std::vector<float> values(static_cast<size_t>(width));
  decode_path(format, bytes.data(), width, values.data());
  return values;
}

// Random inputs for every test run; the seed is printed with any failure, and QUANTMLA_TEST_SEED
// replays one.
class CodecTest : public ::testing::Test {
 protected:
  static uint32_t pick_seed() {
    return static_cast<uint32_t>(
        testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name()));
  }

  enum class Shape { kNormal, kUniform, kOutliers };
  static constexpr Shape kShapes[] = {Shape::kNormal, Shape::kUniform, Shape::kOutliers};

  // Spreads from 2^-8 to 2^6 and outliers up to 100x keep everything inside FP16's range, which
  // the int codecs' scale and min need.
  std::vector<float> random_values(Shape shape, int64_t width) {
    const float spread = std::ldexp(1.0f, std::uniform_int_distribution<int>(-8, 6)(rng_));
    std::normal_distribution<float> normal(0.0f, spread);
    std::vector<float> values(static_cast<size_t>(width));
    switch (shape) {
      case Shape::kNormal:
        for (float& value : values) value = normal(rng_);
        break;
      case Shape::kUniform: {
        const float center = std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng_) * spread;
        std::uniform_real_distribution<float> uniform(center - spread, center + spread);
        for (float& value : values) value = uniform(rng_);
        break;
      }
      case Shape::kOutliers: {
        std::bernoulli_distribution is_outlier(0.02);
        std::uniform_real_distribution<float> boost(20.0f, 100.0f);
        for (float& value : values) value = normal(rng_) * (is_outlier(rng_) ? boost(rng_) : 1.0f);
        break;
      }
    }
    return values;
  }

  const uint32_t seed_ = pick_seed();
  std::mt19937 rng_{seed_};
  ::testing::ScopedTrace seed_trace_{
      __FILE__, __LINE__,
      "random seed " + std::to_string(seed_) +
          " (replay with QUANTMLA_TEST_SEED=" + std::to_string(seed_) + ")"};
};

// ---- int8 / int4 / int2 ----

constexpr Codec kIntCodecs[] = {Codec::kInt8, Codec::kInt4, Codec::kInt2};
constexpr int kIntGroups[] = {32, 64, 128};

std::vector<int64_t> widths_for_group(int group) {
  std::vector<int64_t> widths = {group, 2 * group, 512};
  if (64 % group == 0) widths.push_back(64);
  std::sort(widths.begin(), widths.end());
  widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
  return widths;
}

// Where the layout puts channel `channel`'s code: byte channel * bits / 8, lowest channel in the
// lowest bits.
uint32_t code_at(const std::vector<uint8_t>& bytes, int64_t channel, int bits) {
  const int codes_per_byte = 8 / bits;
  const uint8_t byte = bytes[static_cast<size_t>(channel / codes_per_byte)];
  return (byte >> ((channel % codes_per_byte) * bits)) & ((1u << bits) - 1u);
}

// The semantics of the header comment, written independently: nearbyint, then clamp.
std::vector<uint8_t> reference_int_encoding(const PathFormat& format,
                                            const std::vector<float>& values) {
  const int bits = format.bits();
  const int64_t width = static_cast<int64_t>(values.size());
  const float top = static_cast<float>((1 << bits) - 1);
  std::vector<uint8_t> bytes(static_cast<size_t>(format.encoded_bytes(width)), 0);
  for (int64_t start = 0; start < width; start += format.group) {
    const auto first = values.begin() + start;
    const auto [low, high] = std::minmax_element(first, first + format.group);
    const uint16_t scale_bits = f32_to_f16((format.clip * *high - format.clip * *low) / top);
    const uint16_t min_bits = f32_to_f16(format.clip * *low);
    const float scale = f16_to_f32(scale_bits);
    const float minimum = f16_to_f32(min_bits);
    for (int64_t channel = start; channel < start + format.group; ++channel) {
      float code = 0.0f;
      if (scale != 0.0f) {
        const float level = (values[static_cast<size_t>(channel)] - minimum) / scale;
        code = std::clamp(std::nearbyint(level), 0.0f, top);
      }
      bytes[static_cast<size_t>(channel * bits / 8)] |=
          static_cast<uint8_t>(static_cast<uint32_t>(code) << ((channel % (8 / bits)) * bits));
    }
    const size_t scale_offset = static_cast<size_t>(width * bits / 8 + 4 * (start / format.group));
    bytes[scale_offset] = static_cast<uint8_t>(scale_bits);
    bytes[scale_offset + 1] = static_cast<uint8_t>(scale_bits >> 8);
    bytes[scale_offset + 2] = static_cast<uint8_t>(min_bits);
    bytes[scale_offset + 3] = static_cast<uint8_t>(min_bits >> 8);
  }
  return bytes;
}

// Values x = scale * q + min with scale and min exact in FP16 and x exact in float: the codec must
// find the same scale, min and codes and decode x exactly. Every code appears at every position:
// in pass p channel c holds (c + p) mod 2^b, except two anchor channels per group that hold 0 and
// 2^b - 1 (so that the group's min and max are min and scale * (2^b - 1) + min); the anchors sit
// at the front of each group in one sweep and at the back in the other.
TEST_F(CodecTest, IntCodesAndScalesLandWhereTheLayoutSays) {
  std::uniform_int_distribution<int> exponent(-20, -4);  // scale down to FP16 subnormals
  std::uniform_int_distribution<int> scale_units(1, 2047);
  std::uniform_int_distribution<int> min_units(-1023, 1023);
  for (const Codec codec : kIntCodecs) {
    for (const int group : kIntGroups) {
      const PathFormat format{codec, group, 1.0f};
      const int bits = format.bits();
      const uint32_t levels = 1u << bits;
      for (const int64_t width : widths_for_group(group)) {
        SCOPED_TRACE(format.to_string() + " width " + std::to_string(width));
        const int64_t groups = width / group;
        for (int sweep = 0; sweep < 2; ++sweep) {
          const int first_anchor = sweep == 0 ? 0 : group - 2;
          for (uint32_t pass = 0; pass < levels; ++pass) {
            std::vector<uint32_t> codes(static_cast<size_t>(width));
            for (int64_t channel = 0; channel < width; ++channel) {
              const int64_t position = channel % group;
              if (position == first_anchor) {
                codes[channel] = 0;
              } else if (position == first_anchor + 1) {
                codes[channel] = levels - 1;
              } else {
                codes[channel] = static_cast<uint32_t>((channel + pass) % levels);
              }
            }
            std::vector<float> scales(static_cast<size_t>(groups));
            std::vector<float> mins(static_cast<size_t>(groups));
            std::vector<float> values(static_cast<size_t>(width));
            for (int64_t g = 0; g < groups; ++g) {
              const int power = exponent(rng_);
              scales[g] = std::ldexp(static_cast<float>(scale_units(rng_)), power);
              mins[g] = std::ldexp(static_cast<float>(min_units(rng_)), power);
              for (int64_t channel = g * group; channel < (g + 1) * group; ++channel) {
                values[channel] = scales[g] * static_cast<float>(codes[channel]) + mins[g];
              }
            }

            const std::vector<uint8_t> bytes = encode(format, values);
            for (int64_t channel = 0; channel < width; ++channel) {
              ASSERT_EQ(code_at(bytes, channel, bits), codes[channel])
                  << "pass " << pass << " sweep " << sweep << " channel " << channel;
            }
            for (int64_t g = 0; g < groups; ++g) {
              const size_t offset = static_cast<size_t>(width * bits / 8 + 4 * g);
              ASSERT_EQ(f16_to_f32(load_le16(bytes, offset)), scales[g]) << "group " << g;
              ASSERT_EQ(f16_to_f32(load_le16(bytes, offset + 2)), mins[g]) << "group " << g;
            }
            ASSERT_EQ(decode(format, bytes, width), values) << "pass " << pass;
          }
        }
      }
    }
  }
}

TEST(IntCodec, Int4PacksTwoChannelsPerByteLowFirst) {
  // Group [0, 15] with scale 1 and min 0: channel c holds c % 16.
  std::vector<float> values(32);
  for (int channel = 0; channel < 32; ++channel) values[channel] = static_cast<float>(channel % 16);
  const std::vector<uint8_t> bytes = encode({Codec::kInt4, 32, 1.0f}, values);
  ASSERT_EQ(bytes.size(), 16u + 4u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bytes[i], (2 * i) | (2 * i + 1) << 4) << "byte " << i;
  EXPECT_EQ(load_le16(bytes, 16), 0x3c00);  // FP16 1.0
  EXPECT_EQ(load_le16(bytes, 18), 0x0000);  // FP16 0.0
}

// Ties at every level and for many scales: min 0 and max (2^b - 1) * s with s an 11-bit FP16 value
// make the stored scale exactly s, and (k + 0.5) * s divided by s exactly k + 0.5. (Multiplying by
// a rounded 1 / s instead of dividing would move some of these ties off the midpoint.)
TEST_F(CodecTest, IntTiesRoundToEven) {
  std::uniform_int_distribution<int> scale_units(1025, 2047);
  std::uniform_int_distribution<int> exponent(-12, -2);
  for (const Codec codec : kIntCodecs) {
    const PathFormat format{codec, 32, 1.0f};
    const int bits = format.bits();
    const int top = (1 << bits) - 1;
    SCOPED_TRACE(format.to_string());
    for (int trial = 0; trial < 200; ++trial) {
      const float scale = std::ldexp(static_cast<float>(scale_units(rng_)), exponent(rng_));
      std::vector<float> values(32, 0.0f);
      values[1] = static_cast<float>(top) * scale;
      std::vector<uint32_t> expected(32, 0);
      expected[1] = static_cast<uint32_t>(top);
      for (int channel = 2; channel < 32; ++channel) {
        const int below = (channel - 2 + trial) % top;
        values[channel] = (static_cast<float>(below) + 0.5f) * scale;
        expected[channel] = static_cast<uint32_t>(below % 2 == 0 ? below : below + 1);
      }
      const std::vector<uint8_t> bytes = encode(format, values);
      for (int channel = 0; channel < 32; ++channel) {
        ASSERT_EQ(code_at(bytes, channel, bits), expected[channel])
            << "value " << values[channel] << " scale " << scale;
      }
    }
  }
}

// Error bound, for a group with true min lo and max hi (clip 1), stored scale s16 and min m16:
// - a code that is not clamped is the nearest level: |x - x~| <= s16 / 2;
// - a clamped code at 0 means x < m16, so the error is at most |m16 - lo|;
// - a clamped top code means x > m16 + top * s16 while x <= hi = lo + top * s, so the error is at
//   most |lo - m16| + top * |s - s16| (also the whole bound when s16 underflowed to 0).
// On top, float arithmetic in (x - m16) / s16 and s16 * q + m16 costs a few ulps of the operands.
TEST_F(CodecTest, IntErrorStaysWithinHalfAStepAndMatchesTheReference) {
  constexpr int64_t kWidth = 512;
  for (const Codec codec : kIntCodecs) {
    for (const int group : kIntGroups) {
      for (const Shape shape : kShapes) {
        for (int trial = 0; trial < 8; ++trial) {
          const PathFormat format{codec, group, 1.0f};
          SCOPED_TRACE(format.to_string() + " shape " + std::to_string(static_cast<int>(shape)) +
                       " trial " + std::to_string(trial));
          const float top = static_cast<float>((1 << format.bits()) - 1);
          const std::vector<float> values = random_values(shape, kWidth);
          const std::vector<uint8_t> bytes = encode(format, values);
          ASSERT_EQ(bytes, reference_int_encoding(format, values));
          const std::vector<float> decoded = decode(format, bytes, kWidth);
          for (int64_t start = 0; start < kWidth; start += group) {
            const auto first = values.begin() + start;
            const auto [low, high] = std::minmax_element(first, first + group);
            const size_t offset =
                static_cast<size_t>(kWidth * format.bits() / 8 + 4 * (start / group));
            const float scale16 = f16_to_f32(load_le16(bytes, offset));
            const float min16 = f16_to_f32(load_le16(bytes, offset + 2));
            const double exact_scale = (static_cast<double>(*high) - *low) / top;
            const double rounding_slack = std::abs(min16 - *low) +
                                          top * std::abs(scale16 - exact_scale) +
                                          8 * kFloatEpsilon * (std::abs(*low) + std::abs(*high));
            for (int64_t channel = start; channel < start + group; ++channel) {
              const float value = values[channel];
              ASSERT_TRUE(std::isfinite(decoded[channel])) << "channel " << channel;
              ASSERT_LE(std::abs(decoded[channel] - value), 0.5 * scale16 + rounding_slack)
                  << "channel " << channel << " value " << value << " scale " << scale16;
            }
          }
        }
      }
    }
  }
}

TEST_F(CodecTest, ClippedIntMatchesTheReferenceAndStaysFinite) {
  std::uniform_real_distribution<float> clip_ratio(0.05f, 1.0f);
  for (const Codec codec : kIntCodecs) {
    for (const int group : kIntGroups) {
      for (const Shape shape : kShapes) {
        const PathFormat format{codec, group, clip_ratio(rng_)};
        SCOPED_TRACE(format.to_string());
        const std::vector<float> values = random_values(shape, 256);
        const std::vector<uint8_t> bytes = encode(format, values);
        ASSERT_EQ(bytes, reference_int_encoding(format, values));
        for (const float value : decode(format, bytes, 256)) ASSERT_TRUE(std::isfinite(value));
      }
    }
  }
}

TEST(IntCodec, ClipShrinksTheRangeAndSaturatesOutsideIt) {
  for (const Codec codec : kIntCodecs) {
    const PathFormat clipped{codec, 32, 0.5f};
    const PathFormat unclipped{codec, 32, 1.0f};
    SCOPED_TRACE(clipped.to_string());
    const uint32_t top = (1u << clipped.bits()) - 1u;
    // min -4, max 8: clip 0.5 keeps [-2, 4].
    std::vector<float> values(32, 1.0f);
    const std::vector<float> above = {8.0f, 5.0f, 4.5f};
    const std::vector<float> below = {-4.0f, -3.0f, -2.5f};
    std::copy(above.begin(), above.end(), values.begin());
    std::copy(below.begin(), below.end(), values.begin() + 3);
    values[6] = 0.0f;

    const std::vector<uint8_t> bytes = encode(clipped, values);
    const size_t scale_offset = 32 * clipped.bits() / 8;
    const float top_level = static_cast<float>(top);
    EXPECT_EQ(load_le16(bytes, scale_offset), f32_to_f16((0.5f * 8.0f - 0.5f * -4.0f) / top_level));
    EXPECT_EQ(load_le16(bytes, scale_offset + 2), f32_to_f16(-2.0f));
    EXPECT_EQ(load_le16(encode(unclipped, values), scale_offset),
              f32_to_f16((8.0f - -4.0f) / top_level));
    for (int channel = 0; channel < 3; ++channel) {
      EXPECT_EQ(code_at(bytes, channel, clipped.bits()), top) << "value " << values[channel];
    }
    for (int channel = 3; channel < 6; ++channel) {
      EXPECT_EQ(code_at(bytes, channel, clipped.bits()), 0u) << "value " << values[channel];
    }
    const float scale16 = f16_to_f32(load_le16(bytes, scale_offset));
    EXPECT_EQ(code_at(bytes, 6, clipped.bits()),
              static_cast<uint32_t>(std::nearbyint((0.0f - -2.0f) / scale16)));
    const std::vector<float> decoded = decode(clipped, bytes, 32);
    EXPECT_EQ(decoded[0], scale16 * top_level + -2.0f);
    EXPECT_EQ(decoded[3], -2.0f);
  }
}

TEST(IntCodec, ConstantGroupStoresZeroScaleAndItsValueAsMin) {
  for (const Codec codec : kIntCodecs) {
    const PathFormat format{codec, 64, 1.0f};
    SCOPED_TRACE(format.to_string());
    const std::vector<float> values(64, 3.7f);
    const std::vector<uint8_t> bytes = encode(format, values);
    const size_t codes_size = 64 * format.bits() / 8;
    for (size_t i = 0; i < codes_size; ++i) EXPECT_EQ(bytes[i], 0) << "byte " << i;
    EXPECT_EQ(load_le16(bytes, codes_size), 0);
    EXPECT_EQ(load_le16(bytes, codes_size + 2), f32_to_f16(3.7f));
    for (const float value : decode(format, bytes, 64)) EXPECT_EQ(value, round_to_f16(3.7f));
  }
}

// ---- int8 / int4 / int2 with kept BF16 pairs ----

bool is_kept(const PathFormat& format, int64_t channel) {
  return std::binary_search(format.bf16_pairs.begin(), format.bf16_pairs.end(),
                            static_cast<int>(channel / 2));
}

PathFormat without_pairs(PathFormat format) {
  format.bf16_pairs.clear();
  return format;
}

// What the base encoder must see, written independently for NaN-free inputs: every kept channel
// replaced by the lowest other value of its group, 0 in a group of kept channels only.
std::vector<float> hide_kept(const PathFormat& format, std::vector<float> values) {
  const auto width = static_cast<int64_t>(values.size());
  for (int64_t start = 0; start < width; start += format.group) {
    std::vector<float> others;
    for (int64_t channel = start; channel < start + format.group; ++channel) {
      if (!is_kept(format, channel)) others.push_back(values[static_cast<size_t>(channel)]);
    }
    const float lowest = others.empty() ? 0.0f : *std::min_element(others.begin(), others.end());
    for (int64_t channel = start; channel < start + format.group; ++channel) {
      if (is_kept(format, channel)) values[static_cast<size_t>(channel)] = lowest;
    }
  }
  return values;
}

float to_bf16(float value) { return bf16_to_f32(f32_to_bf16(value)); }

// 1 to 3 distinct pairs of `width`, sometimes two in one group.
std::vector<int> random_pairs(int64_t width, std::mt19937& rng) {
  const int count = std::uniform_int_distribution<int>(1, 3)(rng);
  std::uniform_int_distribution<int> pair(0, static_cast<int>(width / 2) - 1);
  std::vector<int> pairs;
  while (static_cast<int>(pairs.size()) < count) {
    const int candidate = pair(rng);
    if (std::find(pairs.begin(), pairs.end(), candidate) == pairs.end()) pairs.push_back(candidate);
  }
  std::sort(pairs.begin(), pairs.end());
  return pairs;
}

// The kept pairs hold outliers of magnitude ~1000 among values ~1: they come back as their BF16
// roundings, and the other channels keep the error bound of a group whose range leaves the kept
// channels out (see IntErrorStaysWithinHalfAStepAndMatchesTheReference), with a step hundreds of
// times finer than the same values get without kept pairs.
TEST_F(CodecTest, KeptPairsAreBf16AndLeaveTheOthersTheRangeWithoutThem) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> outlier(1000.0f, 2000.0f);
  for (const Codec codec : kIntCodecs) {
    for (const int group : kIntGroups) {
      for (const int64_t width : {int64_t{64}, int64_t{512}}) {
        if (width % group != 0) continue;
        for (int trial = 0; trial < 20; ++trial) {
          const PathFormat format{codec, group, trial % 4 == 3 ? 0.8f : 1.0f,
                                  random_pairs(width, rng_)};
          const PathFormat base = without_pairs(format);
          SCOPED_TRACE(format.to_string() + " width " + std::to_string(width));
          const float top = static_cast<float>((1 << format.bits()) - 1);
          std::vector<float> values(static_cast<size_t>(width));
          for (float& value : values) value = normal(rng_);
          for (const int pair : format.bf16_pairs) {
            values[2 * pair] = outlier(rng_);
            values[2 * pair + 1] = -outlier(rng_);
          }

          const std::vector<uint8_t> bytes = encode(format, values);
          const int64_t base_bytes = base.encoded_bytes(width);
          ASSERT_EQ(static_cast<int64_t>(bytes.size()),
                    base_bytes + 4 * static_cast<int64_t>(format.bf16_pairs.size()));
          const std::vector<uint8_t> expected_base =
              reference_int_encoding(base, hide_kept(format, values));
          ASSERT_TRUE(std::equal(expected_base.begin(), expected_base.end(), bytes.begin()));
          for (size_t k = 0; k < format.bf16_pairs.size(); ++k) {
            const size_t offset = static_cast<size_t>(base_bytes) + 4 * k;
            const size_t channel = 2 * static_cast<size_t>(format.bf16_pairs[k]);
            ASSERT_EQ(load_le16(bytes, offset), f32_to_bf16(values[channel])) << "pair " << k;
            ASSERT_EQ(load_le16(bytes, offset + 2), f32_to_bf16(values[channel + 1]))
                << "pair " << k;
          }

          const std::vector<float> decoded = decode(format, bytes, width);
          const std::vector<uint8_t> plain = encode(base, values);
          for (int64_t start = 0; start < width; start += group) {
            std::vector<float> others;
            for (int64_t channel = start; channel < start + group; ++channel) {
              if (!is_kept(format, channel)) others.push_back(values[channel]);
            }
            const auto [low, high] = std::minmax_element(others.begin(), others.end());
            const size_t offset =
                static_cast<size_t>(width * format.bits() / 8 + 4 * (start / group));
            const float scale16 = f16_to_f32(load_le16(bytes, offset));
            const float min16 = f16_to_f32(load_le16(bytes, offset + 2));
            if (static_cast<int64_t>(others.size()) < group) {
              EXPECT_LT(100 * scale16, f16_to_f32(load_le16(plain, offset))) << "group " << start;
            }
            // Clipped formats saturate beyond the clipped range; the bound is for clip 1.
            const double exact_scale = (static_cast<double>(*high) - *low) / top;
            const double bound = 0.5 * scale16 + std::abs(min16 - *low) +
                                 top * std::abs(scale16 - exact_scale) +
                                 8 * kFloatEpsilon * (std::abs(*low) + std::abs(*high));
            for (int64_t channel = start; channel < start + group; ++channel) {
              const float value = values[channel];
              if (is_kept(format, channel)) {
                ASSERT_EQ(decoded[channel], to_bf16(value)) << "kept channel " << channel;
                continue;
              }
              if (format.clip == 1.0f) {
                ASSERT_LE(std::abs(decoded[channel] - value), bound)
                    << "channel " << channel << " value " << value;
              }
            }
          }
        }
      }
    }
  }
}

TEST(IntCodec, GroupOfKeptChannelsOnlyStoresAZeroRange) {
  std::vector<int> first_group(16);
  for (int i = 0; i < 16; ++i) first_group[static_cast<size_t>(i)] = i;
  for (const Codec codec : kIntCodecs) {
    const PathFormat format{codec, 32, 1.0f, first_group};
    const PathFormat base = without_pairs(format);
    SCOPED_TRACE(format.to_string());
    std::vector<float> values(64);
    for (int channel = 0; channel < 64; ++channel) {
      values[channel] = channel < 32 ? 1000.0f + 3.3f * channel : std::sin(0.3f * channel);
    }
    const std::vector<uint8_t> bytes = encode(format, values);
    const size_t codes_size = 64 * format.bits() / 8;
    for (size_t i = 0; i < codes_size / 2; ++i) EXPECT_EQ(bytes[i], 0) << "byte " << i;
    EXPECT_EQ(load_le16(bytes, codes_size), 0);      // scale
    EXPECT_EQ(load_le16(bytes, codes_size + 2), 0);  // min
    const std::vector<float> decoded = decode(format, bytes, 64);
    const std::vector<float> second(values.begin() + 32, values.end());
    const std::vector<float> second_alone = decode(base, encode(base, second), 32);
    for (int channel = 0; channel < 64; ++channel) {
      EXPECT_EQ(decoded[channel],
                channel < 32 ? to_bf16(values[channel]) : second_alone[channel - 32])
          << "channel " << channel;
    }
  }
}

// Non-finite values in kept channels come back as they were (NaN stays NaN) and do not reach the
// group's scale and min.
TEST(IntCodec, KeptPairsKeepNonFiniteValuesOutOfTheGroup) {
  for (const Codec codec : kIntCodecs) {
    const PathFormat format{codec, 64, 1.0f, {5, 21}};
    SCOPED_TRACE(format.to_string());
    std::vector<float> values(64);
    for (int channel = 0; channel < 64; ++channel) values[channel] = 0.25f * (channel % 9) - 1.0f;
    values[10] = std::numeric_limits<float>::quiet_NaN();
    values[11] = std::numeric_limits<float>::infinity();
    values[42] = -std::numeric_limits<float>::infinity();
    values[43] = -0.0f;
    const std::vector<uint8_t> bytes = encode(format, values);
    const size_t scale_offset = 64 * format.bits() / 8;
    EXPECT_EQ(f16_to_f32(load_le16(bytes, scale_offset)),
              round_to_f16(2.0f / static_cast<float>((1 << format.bits()) - 1)));
    EXPECT_EQ(f16_to_f32(load_le16(bytes, scale_offset + 2)), -1.0f);
    const std::vector<float> decoded = decode(format, bytes, 64);
    EXPECT_TRUE(std::isnan(decoded[10]));
    EXPECT_EQ(decoded[11], std::numeric_limits<float>::infinity());
    EXPECT_EQ(decoded[42], -std::numeric_limits<float>::infinity());
    EXPECT_EQ(std::bit_cast<uint32_t>(decoded[43]), std::bit_cast<uint32_t>(-0.0f));
    for (int channel = 0; channel < 64; ++channel) {
      if (channel == 10 || channel == 11 || channel == 42 || channel == 43) continue;
      EXPECT_TRUE(std::isfinite(decoded[channel])) << "channel " << channel;
      EXPECT_LE(std::abs(decoded[channel] - values[channel]), 1.0f) << "channel " << channel;
    }
  }
}

// ---- q8_0 / q4_0 ----

// ggml's reference q8_0 rounding, written from its description: roundf of x / d.
std::vector<uint8_t> reference_q8_0(const std::vector<float>& values) {
  std::vector<uint8_t> bytes;
  for (size_t start = 0; start < values.size(); start += 32) {
    float absmax = 0.0f;
    for (size_t j = 0; j < 32; ++j) absmax = std::max(absmax, std::abs(values[start + j]));
    const float d = absmax / 127.0f;
    const float inverse_d = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = f32_to_f16(d);
    bytes.push_back(static_cast<uint8_t>(d_bits));
    bytes.push_back(static_cast<uint8_t>(d_bits >> 8));
    for (size_t j = 0; j < 32; ++j) {
      bytes.push_back(
          static_cast<uint8_t>(static_cast<int8_t>(std::round(values[start + j] * inverse_d))));
    }
  }
  return bytes;
}

// ggml's reference q4_0 rounding: d from the signed extreme, +8.5 and truncate, clamp to 15.
std::vector<uint8_t> reference_q4_0(const std::vector<float>& values) {
  std::vector<uint8_t> bytes;
  for (size_t start = 0; start < values.size(); start += 32) {
    float absmax = 0.0f;
    float extreme = 0.0f;
    for (size_t j = 0; j < 32; ++j) {
      if (std::abs(values[start + j]) > absmax) {
        absmax = std::abs(values[start + j]);
        extreme = values[start + j];
      }
    }
    const float d = extreme / -8.0f;
    const float inverse_d = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = f32_to_f16(d);
    bytes.push_back(static_cast<uint8_t>(d_bits));
    bytes.push_back(static_cast<uint8_t>(d_bits >> 8));
    const auto code = [&](size_t index) {
      return std::min(15, static_cast<int>(std::trunc(values[index] * inverse_d + 8.5f)));
    };
    for (size_t j = 0; j < 16; ++j) {
      bytes.push_back(static_cast<uint8_t>(code(start + j) | code(start + j + 16) << 4));
    }
  }
  return bytes;
}

TEST(GgmlBlocks, Q8_0LayoutAndRoundingHalfAwayFromZero) {
  const PathFormat format{Codec::kQ8_0, 32, 1.0f};
  // Block 0: absmax 127 makes d exactly 1, so x * (1 / d) = x and ties stay ties.
  // Block 1: q * 2^-3 with q = +-127 present: d = 2^-3 and every value exact.
  std::vector<float> values(64, 0.0f);
  const std::vector<float> ties = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.5f, -126.5f};
  const std::vector<int8_t> tie_codes = {127, 3, -3, 1, -1, 2, -127};
  std::copy(ties.begin(), ties.end(), values.begin());
  std::vector<int8_t> codes(32);
  for (int j = 0; j < 32; ++j) {
    codes[j] = static_cast<int8_t>(j == 0 ? 127 : j == 1 ? -127 : (j * 37) % 255 - 127);
    values[32 + j] = static_cast<float>(codes[j]) * 0.125f;
  }
  const std::vector<uint8_t> bytes = encode(format, values);
  ASSERT_EQ(bytes.size(), 68u);
  EXPECT_EQ(load_le16(bytes, 0), 0x3c00);  // FP16 1.0
  for (size_t j = 0; j < tie_codes.size(); ++j) {
    EXPECT_EQ(static_cast<int8_t>(bytes[2 + j]), tie_codes[j]) << "value " << ties[j];
  }
  EXPECT_EQ(load_le16(bytes, 34), f32_to_f16(0.125f));
  for (int j = 0; j < 32; ++j) EXPECT_EQ(static_cast<int8_t>(bytes[36 + j]), codes[j]);
  const std::vector<float> decoded = decode(format, bytes, 64);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(decoded[32 + j], values[32 + j]);
}

TEST(GgmlBlocks, Q4_0LayoutAndRounding) {
  const PathFormat format{Codec::kQ4_0, 32, 1.0f};
  // Extreme -8 first: d = -8 / -8 = 1, so code = trunc(x + 8.5) clamped to 15.
  std::vector<float> values(32);
  for (int j = 0; j < 16; ++j) {
    values[j] = static_cast<float>(j - 8);       // codes 0..15
    values[j + 16] = static_cast<float>(7 - j);  // codes 15..0
  }
  std::vector<uint8_t> bytes = encode(format, values);
  ASSERT_EQ(bytes.size(), 18u);
  EXPECT_EQ(load_le16(bytes, 0), 0x3c00);  // FP16 1.0
  for (int j = 0; j < 16; ++j) EXPECT_EQ(bytes[2 + j], j | (15 - j) << 4) << "byte " << j;
  EXPECT_EQ(decode(format, bytes, 32), values);

  // +8.5 then truncate: halves round up, and +8 (the opposite extreme) clamps to code 15 = 7.
  const std::vector<float> probes = {8.0f, 0.4f, 0.5f, -0.5f, -0.6f, 7.6f, -7.5f};
  const std::vector<float> decoded_probes = {7.0f, 0.0f, 1.0f, 0.0f, -1.0f, 7.0f, -7.0f};
  values.assign(32, 0.0f);
  values[0] = -8.0f;
  std::copy(probes.begin(), probes.end(), values.begin() + 1);
  bytes = encode(format, values);
  const std::vector<float> decoded = decode(format, bytes, 32);
  for (size_t i = 0; i < probes.size(); ++i) {
    EXPECT_EQ(decoded[1 + i], decoded_probes[i]) << "value " << probes[i];
  }

  // The first value of largest magnitude sets the sign of d: 4 before -4 gives d = -0.5.
  values.assign(32, 1.0f);
  values[3] = 4.0f;
  values[9] = -4.0f;
  bytes = encode(format, values);
  EXPECT_EQ(load_le16(bytes, 0), f32_to_f16(-0.5f));
  EXPECT_EQ(decode(format, bytes, 32)[3], 4.0f);
}

// q8_0: x * (1 / d) is rounded to the nearest integer q, so |x - q * d| <= d / 2; decoding with the
// FP16 d16 adds |q| * |d16 - d| <= 127 * |d16 - d|.
// q4_0: code - 8 = floor(x / d + 0.5), the nearest step (half up), so |x - (code - 8) * d| <= |d| /
// 2, except the clamped code 16 -> 15 (x / d in [7.5, 8]), off by at most |d|; decoding with d16
// adds 8 * |d16 - d|. Both: a few float ulps of the block's largest magnitude for x * (1 / d) and
// the product.
TEST_F(CodecTest, GgmlBlocksErrorBoundsAndReferenceBytes) {
  constexpr int64_t kWidth = 512;
  const PathFormat q8{Codec::kQ8_0, 32, 1.0f};
  const PathFormat q4{Codec::kQ4_0, 32, 1.0f};
  for (const Shape shape : kShapes) {
    for (int trial = 0; trial < 16; ++trial) {
      SCOPED_TRACE("shape " + std::to_string(static_cast<int>(shape)) + " trial " +
                   std::to_string(trial));
      const std::vector<float> values = random_values(shape, kWidth);
      const std::vector<uint8_t> q8_bytes = encode(q8, values);
      const std::vector<uint8_t> q4_bytes = encode(q4, values);
      ASSERT_EQ(q8_bytes, reference_q8_0(values));
      ASSERT_EQ(q4_bytes, reference_q4_0(values));
      const std::vector<float> q8_decoded = decode(q8, q8_bytes, kWidth);
      const std::vector<float> q4_decoded = decode(q4, q4_bytes, kWidth);
      for (int64_t start = 0; start < kWidth; start += 32) {
        float absmax = 0.0f;
        float extreme = 0.0f;
        for (int64_t j = start; j < start + 32; ++j) {
          if (std::abs(values[j]) > absmax) {
            absmax = std::abs(values[j]);
            extreme = values[j];
          }
        }
        const double float_slack = 8 * kFloatEpsilon * absmax;
        const float q8_d = absmax / 127.0f;
        const float q8_d16 = f16_to_f32(load_le16(q8_bytes, static_cast<size_t>(start / 32 * 34)));
        const float q4_d = extreme / -8.0f;
        const float q4_d16 = f16_to_f32(load_le16(q4_bytes, static_cast<size_t>(start / 32 * 18)));
        for (int64_t j = start; j < start + 32; ++j) {
          const float value = values[j];
          ASSERT_LE(std::abs(q8_decoded[j] - value),
                    0.5 * q8_d + 127.0 * std::abs(q8_d16 - q8_d) + float_slack)
              << "q8_0 channel " << j << " value " << value;
          const bool clamped = value * (1.0f / q4_d) + 8.5f >= 16.0f;
          ASSERT_LE(
              std::abs(q4_decoded[j] - value),
              (clamped ? 1.0 : 0.5) * std::abs(q4_d) + 8.0 * std::abs(q4_d16 - q4_d) + float_slack)
              << "q4_0 channel " << j << " value " << value;
        }
      }
    }
  }
}

// ---- fp8 ----

// e4m3fn from the OCP definition: subnormals m * 2^-9, normals (1 + m / 8) * 2^(e - 7).
float ocp_e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if ((code & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
  return (code & 0x80) ? -magnitude : magnitude;
}

TEST(E4M3, EveryCodeDecodesToTheOcpValue) {
  for (int code = 0; code < 256; ++code) {
    const float expected = ocp_e4m3_value(static_cast<uint8_t>(code));
    const float decoded = e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(decoded)) << "code " << code;
    } else {
      EXPECT_EQ(decoded, expected) << "code " << code;
      EXPECT_EQ(std::signbit(decoded), (code & 0x80) != 0) << "code " << code;
    }
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_f32(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0xb8), -1.0f);
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_f32(0x80)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
}

TEST(E4M3, EncodeInvertsDecode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(f32_to_e4m3(e4m3_to_f32(static_cast<uint8_t>(code))), code) << "code " << code;
  }
}

TEST(E4M3, TiesRoundToEvenAndNeighboursToTheNearer) {
  // Adjacent codes of one sign are adjacent values; the even code has the even mantissa.
  for (int code = 0; code < 0x7e; ++code) {
    const float low = e4m3_to_f32(static_cast<uint8_t>(code));
    const float high = e4m3_to_f32(static_cast<uint8_t>(code + 1));
    const float middle = (low + high) / 2;  // exact: both have 4 significant bits
    const int even = code % 2 == 0 ? code : code + 1;
    EXPECT_EQ(f32_to_e4m3(middle), even) << "between codes " << code << " and " << code + 1;
    EXPECT_EQ(f32_to_e4m3(-middle), 0x80 | even) << "between codes " << code << " and " << code + 1;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(middle, high)), code + 1) << "above " << middle;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(middle, low)), code) << "below " << middle;
  }
}

TEST(E4M3, SaturatesAndKeepsNaN) {
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  for (const float value : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e30f, kInfinity}) {
    EXPECT_EQ(f32_to_e4m3(value), 0x7e) << value;
    EXPECT_EQ(f32_to_e4m3(-value), 0xfe) << -value;
  }
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
  EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

TEST_F(CodecTest, E4M3EncodesToTheNearestValue) {
  std::uniform_int_distribution<int> exponent(-13, 10);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::bernoulli_distribution negative(0.5);
  for (int trial = 0; trial < 20000; ++trial) {
    const float magnitude = std::ldexp(mantissa(rng_), exponent(rng_));
    const float value = negative(rng_) ? -magnitude : magnitude;
    // Brute force over the codes of the value's sign; a tie goes to the even code.
    const int sign = value < 0 ? 0x80 : 0;
    int best = sign;
    for (int code = sign; code < sign + 0x7f; ++code) {
      const float error = std::abs(e4m3_to_f32(static_cast<uint8_t>(code)) - value);
      const float best_error = std::abs(e4m3_to_f32(static_cast<uint8_t>(best)) - value);
      if (error < best_error || (error == best_error && code % 2 == 0)) best = code;
    }
    ASSERT_EQ(f32_to_e4m3(value), best) << "value " << value;
  }
}

// fp8 per group: y = x / scale with scale = absmax / 448 lies in [-448, 448]. e4m3 keeps 3
// mantissa bits, so for |y| >= 2^-6 (normal) the error is at most half a step, 2^-4 of |y|; below,
// subnormal steps are 2^-9, so at most 2^-10 absolute, i.e. scale * 2^-10 in x. The division and
// the product at decoding add a few float ulps.
TEST_F(CodecTest, Fp8ErrorBoundsAndScales) {
  constexpr int64_t kWidth = 512;
  const PathFormat format{Codec::kFP8, 128, 1.0f};
  for (const Shape shape : kShapes) {
    for (int trial = 0; trial < 16; ++trial) {
      const std::vector<float> values = random_values(shape, kWidth);
      const std::vector<uint8_t> bytes = encode(format, values);
      const std::vector<float> decoded = decode(format, bytes, kWidth);
      for (int64_t start = 0; start < kWidth; start += 128) {
        float absmax = 0.0f;
        for (int64_t j = start; j < start + 128; ++j)
          absmax = std::max(absmax, std::abs(values[j]));
        const float scale = load_le_f32(bytes, static_cast<size_t>(kWidth + 4 * (start / 128)));
        ASSERT_EQ(scale, absmax / 448.0f);
        for (int64_t j = start; j < start + 128; ++j) {
          const float value = values[j];
          ASSERT_EQ(bytes[j], f32_to_e4m3(value / scale));
          const bool normal = std::abs(value / scale) >= std::ldexp(1.0f, -6);
          const double bound = normal ? std::ldexp(std::abs(value), -4) : std::ldexp(scale, -10);
          ASSERT_LE(std::abs(decoded[j] - value), bound + 4 * kFloatEpsilon * std::abs(value))
              << "channel " << j << " value " << value << " scale " << scale;
        }
      }
    }
  }
}

// ---- every format ----

std::vector<PathFormat> all_formats() {
  std::vector<PathFormat> formats = {{Codec::kF32, 0, 1.0f},
                                     {Codec::kBF16, 0, 1.0f},
                                     {Codec::kFP8, 128, 1.0f},
                                     {Codec::kQ8_0, 32, 1.0f},
                                     {Codec::kQ4_0, 32, 1.0f}};
  for (const Codec codec : kIntCodecs) {
    for (const int group : kIntGroups) {
      formats.push_back({codec, group, 1.0f});
      formats.push_back({codec, group, 0.8f});
      formats.push_back({codec, group, 1.0f, {0, 5, 31}});
    }
  }
  return formats;
}

TEST(Codecs, ZerosDecodeToZeros) {
  for (const PathFormat& format : all_formats()) {
    SCOPED_TRACE(format.to_string());
    const std::vector<float> zeros(512, 0.0f);
    EXPECT_EQ(decode(format, encode(format, zeros), 512), zeros);
  }
}

// bf16 keeps 8 significant bits: round to nearest is within half a step, 2^-8 of |x|.
TEST_F(CodecTest, FloatFormatsAreExactOrWithinHalfABf16Step) {
  const PathFormat f32{Codec::kF32, 0, 1.0f};
  const PathFormat bf16{Codec::kBF16, 0, 1.0f};
  for (const Shape shape : kShapes) {
    const std::vector<float> values = random_values(shape, 576);
    const std::vector<uint8_t> f32_bytes = encode(f32, values);
    EXPECT_EQ(load_le_f32(f32_bytes, 4), values[1]);
    EXPECT_EQ(decode(f32, f32_bytes, 576), values);
    const std::vector<uint8_t> bf16_bytes = encode(bf16, values);
    const std::vector<float> decoded = decode(bf16, bf16_bytes, 576);
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(load_le16(bf16_bytes, 2 * i), f32_to_bf16(values[i])) << "channel " << i;
      ASSERT_LE(std::abs(decoded[i] - values[i]), std::ldexp(std::abs(values[i]), -8))
          << "channel " << i;
    }
  }
}

TEST_F(CodecTest, EveryFormatDecodesFinitelyWithinItsBytes) {
  for (const PathFormat& format : all_formats()) {
    for (const int64_t width : {int64_t{64}, int64_t{128}, int64_t{512}}) {
      if (width % std::max(format.group, 1) != 0) continue;
      SCOPED_TRACE(format.to_string() + " width " + std::to_string(width));
      for (const Shape shape : kShapes) {
        for (const float value :
             decode(format, encode(format, random_values(shape, width)), width)) {
          ASSERT_TRUE(std::isfinite(value));
        }
      }
    }
  }
}

TEST(Codecs, RejectWidthsThatAreNotWholeGroups) {
  std::vector<float> values(96, 1.0f);
  std::vector<uint8_t> bytes(1024, 0);
  const PathFormat int4{Codec::kInt4, 64, 1.0f};
  EXPECT_THROW(encode_path(int4, values.data(), 96, bytes.data()), InvalidArgument);
  EXPECT_THROW(decode_path(int4, bytes.data(), 96, values.data()), InvalidArgument);
  const PathFormat fp8{Codec::kFP8, 128, 1.0f};
  EXPECT_THROW(encode_path(fp8, values.data(), 64, bytes.data()), InvalidArgument);
  const PathFormat bad_group{Codec::kInt2, 0, 1.0f};
  EXPECT_THROW(encode_path(bad_group, values.data(), 64, bytes.data()), InvalidArgument);
  const PathFormat pair_beyond{Codec::kInt4, 32, 1.0f, {32}};  // channels 64, 65
  EXPECT_THROW(encode_path(pair_beyond, values.data(), 64, bytes.data()), InvalidArgument);
  EXPECT_THROW(decode_path(pair_beyond, bytes.data(), 64, values.data()), InvalidArgument);
  EXPECT_EQ(values, std::vector<float>(96, 1.0f));
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t byte) { return byte == 0; }));
}

}  // namespace
}  // namespace quantmla
