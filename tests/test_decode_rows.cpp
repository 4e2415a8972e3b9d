// The SIMD tile decoders (decode_rows) against the scalar codecs, bit for bit, on fresh random
// records of every format; and the record layouts of quant/records.h against encoded_bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "error_matchers.h"
#include "kernels/cpu/decode_rows.h"
#include "quant/path_dispatch.h"
#include "quantmla/cache_format.h"
#include "quantmla/error.h"
#include "test_seed.h"

namespace quantmla {
namespace {

constexpr int64_t kContentWidth = 512;
constexpr int64_t kRopeWidth = 64;

// Every spelling the parser accepts, up to the clip ratio (one clip variant stands for all) and
// the choice of kept BF16 pairs (1 to 3, inside the 64 RoPE channels, two in one group).
std::vector<std::string> all_specs() {
  std::vector<std::string> specs = {"f32",
                                    "bf16",
                                    "fp8",
                                    "fp8:g64",
                                    "q8_0",
                                    "q4_0",
                                    "int4:g64:clip0.9",
                                    "int4:g64:clip0.9:bf16pairs=5+21"};
  for (const char* codec : {"int8", "int4", "int2"}) {
    for (const char* group : {"g32", "g64", "g128"}) {
      specs.push_back(std::string(codec) + ":" + group);
      for (const char* pairs : {"bf16pairs=31", "bf16pairs=5+21", "bf16pairs=0+1+17"}) {
        specs.push_back(std::string(codec) + ":" + group + ":" + pairs);
      }
    }
  }
  return specs;
}

bool encodable(const PathFormat& format, int64_t width) {
  const bool pairs_fit = format.bf16_pairs.empty() || 2 * format.bf16_pairs.back() + 1 < width;
  return (format.group == 0 || width % format.group == 0) && pairs_fit;
}

struct Case {
  std::string spec;
  int64_t width;
};

// Failure messages name the case instead of dumping its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.spec << " at width " << c.width; }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const std::string& spec : all_specs()) {
    for (const int64_t width : {kContentWidth, kRopeWidth}) {
      if (encodable(PathFormat::parse(spec), width)) cases.push_back({spec, width});
    }
  }
  // The formats without groups take any width, down to a tail shorter than a vector.
  cases.push_back({"f32", 13});
  cases.push_back({"bf16", 13});
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.spec + "_w" + std::to_string(info.param.width);
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

uint32_t pick_seed() {
  return static_cast<uint32_t>(
      testing::test_seed(::testing::UnitTest::GetInstance()->current_test_info()->name()));
}

// Bit equality of two decoded rows, NaN payloads aside.
void check_same_values(const std::vector<float>& fast, const std::vector<float>& reference,
                       int64_t width) {
  ASSERT_EQ(fast.size(), reference.size());
  for (size_t i = 0; i < fast.size(); ++i) {
    const auto where = [&] {
      return "row " + std::to_string(i / width) + " channel " + std::to_string(i % width);
    };
    if (std::isnan(reference[i]) || std::isnan(fast[i])) {
      ASSERT_EQ(std::isnan(fast[i]), std::isnan(reference[i])) << where();
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(fast[i]), std::bit_cast<uint32_t>(reference[i]))
          << where() << ": " << fast[i] << " vs " << reference[i];
    }
  }
}

// Encoded records of random rows, `stride` bytes apart with random bytes in the gaps.
class DecodeRows : public ::testing::TestWithParam<Case> {
 protected:
  static constexpr int64_t kCount = 13;     // not a multiple of the 8 lanes of a vector
  static constexpr int64_t kStridePad = 7;  // odd: records start at every alignment

  // Row kinds: plain, shifted (a large min), special groups, large magnitudes, non-finite.
  std::vector<float> random_row(int kind) {
    const float spread = std::ldexp(1.0f, std::uniform_int_distribution<int>(-8, 6)(rng_));
    std::normal_distribution<float> normal(0.0f, spread);
    std::vector<float> row(static_cast<size_t>(width_));
    for (float& value : row) value = normal(rng_);
    const int64_t group = std::min<int64_t>(width_, std::max(format_.group, 32));
    switch (kind) {
      case 0:
        break;
      case 1:
        for (float& value : row) value = std::fabs(value) + 40.0f * spread;
        break;
      case 2:  // a constant group, an all-zero group (when there are two), a lone outlier
        std::fill_n(row.begin(), group, normal(rng_));
        if (width_ >= 2 * group) std::fill_n(row.begin() + group, group, 0.0f);
        row.back() = 100.0f * spread;
        break;
      case 3: {  // large magnitudes; beyond FP16's range the int and ggml scales overflow to inf
        const float boost = std::ldexp(1.0f, std::bernoulli_distribution(0.5)(rng_) ? 7 : 20);
        for (float& value : row) value *= boost;
        break;
      }
      default: {
        // The ggml quantizers convert x / d to int, which NaN and inf would make undefined.
        if (format_.codec == Codec::kQ8_0 || format_.codec == Codec::kQ4_0) break;
        const float specials[] = {
            std::numeric_limits<float>::quiet_NaN(),  std::numeric_limits<float>::infinity(),
            -std::numeric_limits<float>::infinity(),  -0.0f,
            std::numeric_limits<float>::denorm_min(), 3e38f};
        for (const float special : specials) {
          row[std::uniform_int_distribution<size_t>(0, row.size() - 1)(rng_)] = special;
        }
        // And some in kept channels, which a random position rarely hits.
        std::uniform_int_distribution<size_t> pick(0, std::size(specials) - 1);
        for (const int pair : format_.bf16_pairs) {
          row[static_cast<size_t>(2 * pair + pair % 2)] = specials[pick(rng_)];
        }
      }
    }
    // Kept channels with magnitudes far beyond the rest, as the RoPE key's high-energy pairs.
    if (kind == 1 || kind == 3) {
      for (const int pair : format_.bf16_pairs) row[static_cast<size_t>(2 * pair)] *= 1000.0f;
    }
    return row;
  }

  std::vector<uint8_t> encode_records() {
    std::vector<uint8_t> records(static_cast<size_t>(kCount * stride_));
    std::uniform_int_distribution<int> byte(0, 255);
    for (uint8_t& b : records) b = static_cast<uint8_t>(byte(rng_));
    for (int64_t r = 0; r < kCount; ++r) {
      const std::vector<float> row = random_row(static_cast<int>(r % 5));
      encode_path(format_, row.data(), width_, records.data() + r * stride_);
    }
    return records;
  }

  const uint32_t seed_ = pick_seed();
  std::mt19937 rng_{seed_};
  ::testing::ScopedTrace seed_trace_{
      __FILE__, __LINE__,
      "random seed " + std::to_string(seed_) +
          " (replay with QUANTMLA_TEST_SEED=" + std::to_string(seed_) + ")"};
  const PathFormat format_ = PathFormat::parse(GetParam().spec);
  const int64_t width_ = GetParam().width;
  const int64_t stride_ = format_.encoded_bytes(width_) + kStridePad;
};

TEST_P(DecodeRows, BitIdenticalToScalarDecode) {
  for (int round = 0; round < 4; ++round) {
    const std::vector<uint8_t> records = encode_records();
    std::vector<float> fast(static_cast<size_t>(kCount * width_));
    std::vector<float> reference(fast.size());
    cpu::decode_rows(format_, records.data(), stride_, kCount, width_, fast.data(), width_);
    cpu::decode_rows_reference(format_, records.data(), stride_, kCount, width_, reference.data(),
                               width_);
    ASSERT_NO_FATAL_FAILURE(check_same_values(fast, reference, width_));
  }
}

// Rows land out_stride floats apart and the floats in between keep their bits.
TEST_P(DecodeRows, WritesOnlyTheRowsOfTheOutputStride) {
  constexpr int64_t kOutPad = 9;
  constexpr uint32_t kSentinel = 0x7fc0beefu;  // a NaN no decoder produces
  const std::vector<uint8_t> records = encode_records();
  const int64_t out_stride = width_ + kOutPad;
  std::vector<float> out(static_cast<size_t>(kCount * out_stride), std::bit_cast<float>(kSentinel));
  std::vector<float> reference(static_cast<size_t>(kCount * width_));
  cpu::decode_rows(format_, records.data(), stride_, kCount, width_, out.data(), out_stride);
  cpu::decode_rows_reference(format_, records.data(), stride_, kCount, width_, reference.data(),
                             width_);
  for (int64_t r = 0; r < kCount; ++r) {
    for (int64_t i = 0; i < out_stride; ++i) {
      const float got = out[static_cast<size_t>(r * out_stride + i)];
      if (i >= width_) {
        ASSERT_EQ(std::bit_cast<uint32_t>(got), kSentinel) << "row " << r << " padding " << i;
      } else if (!std::isnan(reference[static_cast<size_t>(r * width_ + i)])) {
        ASSERT_EQ(got, reference[static_cast<size_t>(r * width_ + i)]) << "row " << r << " " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, DecodeRows, ::testing::ValuesIn(all_cases()), case_name);

// Random rows reach few of the e4m3 subnormal and NaN codes: all 256 codes, under four scales.
TEST(DecodeRowsFp8, EveryCodeUnderSeveralScales) {
  const PathFormat fp8 = PathFormat::parse("fp8");
  std::vector<uint8_t> record(static_cast<size_t>(fp8.encoded_bytes(kContentWidth)));
  for (int64_t i = 0; i < kContentWidth; ++i) {
    record[static_cast<size_t>(i)] = static_cast<uint8_t>(i);
  }
  const float scales[] = {1.0f, 0.375f, 3e-3f, 0x1p100f};
  std::memcpy(record.data() + kContentWidth, scales, sizeof(scales));
  std::vector<float> fast(kContentWidth), reference(kContentWidth);
  cpu::decode_rows(fp8, record.data(), 0, 1, kContentWidth, fast.data(), kContentWidth);
  cpu::decode_rows_reference(fp8, record.data(), 0, 1, kContentWidth, reference.data(),
                             kContentWidth);
  check_same_values(fast, reference, kContentWidth);
}

TEST(DecodeRowsErrors, NamesTheBadValues) {
  std::vector<uint8_t> records(4096);
  std::vector<float> out(4096);
  const PathFormat int4 = PathFormat::parse("int4:g64");
  const PathFormat two_pairs = PathFormat::parse("int4:g64:bf16pairs=5+21");
  const PathFormat pairs_g32 = PathFormat::parse("int4:g32:bf16pairs=5+21");
  using testing::error_message;
  using testing::expect_contains;
  for (const auto decode : {cpu::decode_rows, cpu::decode_rows_reference}) {
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(int4, records.data(), 36, -1, 64, out.data(), 64); }),
                    {"negative count -1"});
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(int4, records.data(), 35, 2, 64, out.data(), 64); }),
                    {"record stride 35", "36 bytes"});
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(int4, records.data(), 36, 2, 64, out.data(), 63); }),
                    {"output stride 63"});
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(int4, records.data(), 36, 1, 96, out.data(), 96); }),
                    {"width 96", "group 64"});
    expect_contains(
        error_message<InvalidArgument>([&] {
          decode(PathFormat{Codec::kInt4, 48}, records.data(), 36, 1, 96, out.data(), 96);
        }),
        {"group 48"});
    // Kept pairs count in the record: 36 + 2 x 4 bytes.
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(two_pairs, records.data(), 43, 2, 64, out.data(), 64); }),
                    {"record stride 43", "44 bytes"});
    expect_contains(error_message<InvalidArgument>(
                        [&] { decode(pairs_g32, records.data(), 28, 1, 32, out.data(), 32); }),
                    {"pair index 21", "width 32"});
  }
}

// sizeof(Record<kWidth>) of the format's layout, or KeptPairsRecord<kWidth, kPairs> for kPairs
// kept pairs, or nothing where the format has none.
template <int kWidth, int kPairs>
std::optional<size_t> record_size_with(const PathFormat& format) {
  return visit_path_format(format, [](auto path) -> std::optional<size_t> {
    using Path = decltype(path);
    if constexpr (kPairs == 0 && requires { typename Path::template Record<kWidth>; }) {
      return sizeof(typename Path::template Record<kWidth>);
    } else if constexpr (requires { typename Path::template KeptPairsRecord<kWidth, kPairs>; }) {
      return sizeof(typename Path::template KeptPairsRecord<kWidth, kPairs>);
    } else {
      return std::nullopt;
    }
  });
}

template <int kWidth>
std::optional<size_t> record_size(const PathFormat& format) {
  switch (format.bf16_pairs.size()) {
    case 0:
      return record_size_with<kWidth, 0>(format);
    case 1:
      return record_size_with<kWidth, 1>(format);
    case 2:
      return record_size_with<kWidth, 2>(format);
    case 3:
      return record_size_with<kWidth, 3>(format);
    default:
      ADD_FAILURE() << "no record size for " << format.bf16_pairs.size() << " kept pairs";
      return std::nullopt;
  }
}

// A record type exists exactly for the widths the codec can encode, and spans encoded_bytes.
TEST(PathRecords, SizesMatchEncodedBytesAtProductionWidths) {
  for (const std::string& spec : all_specs()) {
    SCOPED_TRACE(spec);
    const PathFormat format = PathFormat::parse(spec);
    const std::optional<size_t> sizes[] = {record_size<kContentWidth>(format),
                                           record_size<kRopeWidth>(format)};
    const int64_t widths[] = {kContentWidth, kRopeWidth};
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE("width " + std::to_string(widths[i]));
      ASSERT_EQ(sizes[i].has_value(), encodable(format, widths[i]));
      if (sizes[i]) {
        EXPECT_EQ(static_cast<int64_t>(*sizes[i]), format.encoded_bytes(widths[i]));
      }
    }
  }
}

TEST(PathRecords, UnknownCodecGroupPairThrows) {
  const std::string message = testing::error_message<InvalidArgument>([] {
    visit_path_format(PathFormat{Codec::kQ4_0, 64}, [](auto) { return 0; });
  });
  testing::expect_contains(message, {"codec 7", "group 64"});
}

}  // namespace
}  // namespace quantmla
