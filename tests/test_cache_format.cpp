// Cache spec parsing, canonical spelling and record sizes (include/quantmla/cache_format.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "error_matchers.h"
#include "quantmla/cache_format.h"
#include "quantmla/error.h"
#include "test_seed.h"

namespace quantmla {
namespace {

constexpr int64_t kKvLoraRank = 512;
constexpr int64_t kRopeDim = 64;

PathFormat path(Codec codec, int group = 0, float clip = 1.0f, std::vector<int> pairs = {}) {
  return {codec, group, clip, std::move(pairs)};
}

struct GoodSpec {
  std::string spec;
  CacheFormat expected;
  std::string canonical;
};

TEST(CacheFormat, ParsesGoodSpecsAndRoundTrips) {
  const PathFormat bf16 = path(Codec::kBF16);
  const std::vector<GoodSpec> specs = {
      {"bf16", {bf16, bf16}, "content=bf16,rope=bf16"},
      {"f32", {path(Codec::kF32), path(Codec::kF32)}, "content=f32,rope=f32"},
      {"content=bf16,rope=bf16", {bf16, bf16}, "content=bf16,rope=bf16"},
      {"content=fp8", {path(Codec::kFP8, 128), bf16}, "content=fp8,rope=bf16"},
      {"content=fp8:g128,rope=bf16", {path(Codec::kFP8, 128), bf16}, "content=fp8,rope=bf16"},
      // A bare fp8 on the 64-wide RoPE path has one scale for the path.
      {"rope=fp8", {bf16, path(Codec::kFP8, 64)}, "content=bf16,rope=fp8:g64"},
      {"content=fp8:g64,rope=fp8:g64",
       {path(Codec::kFP8, 64), path(Codec::kFP8, 64)},
       "content=fp8:g64,rope=fp8:g64"},
      {"rope=f32", {bf16, path(Codec::kF32)}, "content=bf16,rope=f32"},
      {"content=q8_0,rope=q8_0",
       {path(Codec::kQ8_0, 32), path(Codec::kQ8_0, 32)},
       "content=q8_0,rope=q8_0"},
      {"rope=q4_0,content=q4_0",
       {path(Codec::kQ4_0, 32), path(Codec::kQ4_0, 32)},
       "content=q4_0,rope=q4_0"},
      {"content=int4:g64,rope=int4:g64",
       {path(Codec::kInt4, 64), path(Codec::kInt4, 64)},
       "content=int4:g64,rope=int4:g64"},
      {"content=int2:g32,rope=int4:g64:clip0.95",
       {path(Codec::kInt2, 32), path(Codec::kInt4, 64, 0.95f)},
       "content=int2:g32,rope=int4:g64:clip0.95"},
      {"content=int8:g128:clip0.5",
       {path(Codec::kInt8, 128, 0.5f), bf16},
       "content=int8:g128:clip0.5,rope=bf16"},
      // A clip of 1 is the default and is left out of the canonical spelling.
      {"content=int4:g32:clip1", {path(Codec::kInt4, 32), bf16}, "content=int4:g32,rope=bf16"},
      {"  content = int4:g64 ,  rope=bf16 ",
       {path(Codec::kInt4, 64), bf16},
       "content=int4:g64,rope=bf16"},
      {"content=int4:g64:clip1e-3",
       {path(Codec::kInt4, 64, 1e-3f), bf16},
       "content=int4:g64:clip0.001,rope=bf16"},
      // Kept BF16 pairs: any order in, ascending out; clip and pairs in either order, clip first.
      {"content=int4:g64,rope=int4:g64:bf16pairs=21+5",
       {path(Codec::kInt4, 64), path(Codec::kInt4, 64, 1.0f, {5, 21})},
       "content=int4:g64,rope=int4:g64:bf16pairs=5+21"},
      {"rope=int4:g64:bf16pairs=5+21:clip0.9",
       {bf16, path(Codec::kInt4, 64, 0.9f, {5, 21})},
       "content=bf16,rope=int4:g64:clip0.9:bf16pairs=5+21"},
      {"rope=int2:g32:clip0.5:bf16pairs=0",
       {bf16, path(Codec::kInt2, 32, 0.5f, {0})},
       "content=bf16,rope=int2:g32:clip0.5:bf16pairs=0"},
      {"content=int8:g128:bf16pairs=255+0+100",
       {path(Codec::kInt8, 128, 1.0f, {0, 100, 255}), bf16},
       "content=int8:g128:bf16pairs=0+100+255,rope=bf16"},
  };
  for (const GoodSpec& good : specs) {
    SCOPED_TRACE(good.spec);
    const CacheFormat parsed = CacheFormat::parse(good.spec);
    EXPECT_EQ(parsed, good.expected);
    EXPECT_EQ(parsed.to_string(), good.canonical);
    EXPECT_EQ(CacheFormat::parse(parsed.to_string()), good.expected);
    EXPECT_EQ(PathFormat::parse(parsed.content.to_string()), parsed.content);
    EXPECT_EQ(PathFormat::parse(parsed.rope.to_string()), parsed.rope);
  }
}

TEST(CacheFormat, ClipSpellingRoundTripsExactly) {
  std::mt19937 rng(static_cast<uint32_t>(testing::test_seed("ClipSpellingRoundTripsExactly")));
  std::uniform_real_distribution<float> ratio(0.0f, 1.0f);
  std::vector<float> clips = {1e-7f,
                              0.1f,
                              0.123456789f,
                              1.0f / 3.0f,
                              std::nextafter(1.0f, 0.0f),
                              std::numeric_limits<float>::denorm_min()};
  for (int i = 0; i < 1000; ++i) clips.push_back(ratio(rng));
  for (const float clip : clips) {
    if (!(clip > 0.0f)) continue;
    const PathFormat format = path(Codec::kInt2, 128, clip);
    SCOPED_TRACE(format.to_string());
    EXPECT_EQ(PathFormat::parse(format.to_string()), format);
  }
}

struct BadSpec {
  std::string spec;
  std::string bad_token;
};

TEST(CacheFormat, RejectsBadSpecsNamingTheBadToken) {
  const std::vector<BadSpec> specs = {
      {"", "empty"},
      {"   ", "empty"},
      {"content=int3", "\"int3\""},
      {"content=BF16", "\"BF16\""},
      {"content=int4", "\"int4\" needs a group"},
      {"content=int4:g48", "\"g48\""},
      {"content=int4:64", "\"64\""},
      {"content=int4:clip0.9", "\"clip0.9\""},
      {"content=fp8:g32", "\"g32\""},
      {"content=q8_0:g64", "\"g64\""},
      {"content=bf16:g32", "\"g32\""},
      {"rope=f32:g64", "\"g64\""},
      {"content=int4:g64:clip0", "\"clip0\""},
      {"content=int4:g64:clip1.5", "\"clip1.5\""},
      {"content=int4:g64:clip-0.5", "\"clip-0.5\""},
      {"content=int4:g64:clipnan", "\"clipnan\""},
      {"content=int4:g64:clipinf", "\"clipinf\""},
      {"content=int4:g64:clip", "\"clip\""},
      {"content=int4:g64:clip0.9x", "\"clip0.9x\""},
      {"content=fp8:clip0.9", "\"clip0.9\""},
      {"content=q4_0:clip0.9", "\"clip0.9\""},
      {"content=int4:g64:clip0.9:extra", "\":extra\""},
      {"content=int4:g64:", "\":\""},
      {"content=bf16x", "\"bf16x\""},
      {"content=q8_0:junk", "junk"},
      {"content=", "empty format"},
      {"content=bf16,content=f32", "duplicate key \"content\""},
      {"rope=bf16,rope=bf16", "duplicate key \"rope\""},
      {"value=bf16", "\"value\""},
      {"=bf16", "unknown key \"\""},
      {"content=bf16,,rope=bf16", "empty entry"},
      {"content=bf16,", "empty entry"},
      {"content", "\"content\""},
      {"int4:g64", "\"int4:g64\""},
      {"fp8", "\"fp8\""},
      {"f32x", "\"f32x\""},
      {"f32,bf16", "\"f32\""},
      {"rope=int4:g64:bf16pairs=", "empty pair list in \"bf16pairs=\""},
      {"rope=int4:g64:bf16pairs=5+x", "bad pair index \"x\""},
      {"rope=int4:g64:bf16pairs=5++6", "bad pair index \"\""},
      {"rope=int4:g64:bf16pairs=-1", "bad pair index \"-1\""},
      {"rope=int4:g64:bf16pairs=1.5", "bad pair index \"1.5\""},
      {"rope=int4:g64:bf16pairs=99999999999", "bad pair index \"99999999999\""},
      {"rope=int4:g64:bf16pairs=5+21+5", "duplicate pair index 5"},
      {"rope=int4:g64:bf16pairs", "\"bf16pairs\""},
      {"rope=int4:g64:bf16pairs5", "\"bf16pairs5\""},
      {"rope=int4:g64:bf16pairs=1:bf16pairs=2", "second pair list \"bf16pairs=2\""},
      {"rope=int4:g64:clip0.9:clip0.8", "second clip \"clip0.8\""},
      {"rope=int4:g64:bf16pairs=1:extra", "\":extra\""},
      {"rope=int4:bf16pairs=1", "\"bf16pairs=1\""},
      {"rope=bf16:bf16pairs=5", "\"bf16pairs=5\" not allowed for bf16"},
      {"rope=fp8:bf16pairs=5", "\"bf16pairs=5\" not allowed for fp8"},
      {"rope=q4_0:bf16pairs=5", "\"bf16pairs=5\" not allowed for q4_0"},
  };
  for (const BadSpec& bad : specs) {
    SCOPED_TRACE("spec \"" + bad.spec + "\"");
    try {
      CacheFormat::parse(bad.spec);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(bad.bad_token), std::string::npos) << message;
      EXPECT_NE(message.find("cache spec \"" + bad.spec + "\""), std::string::npos) << message;
    }
  }
}

TEST(CacheFormat, UnknownCodecMessageListsTheAcceptedCodecs) {
  try {
    CacheFormat::parse("content=int3");
    FAIL() << "accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_STREQ(error.what(),
                 "cache spec \"content=int3\": unknown codec \"int3\" (accepted: f32, bf16, fp8, "
                 "int8, int4, int2, q8_0, q4_0)");
  }
}

TEST(PathFormat, ParseNamesTheText) {
  try {
    PathFormat::parse("int4:g64:clip2");
    FAIL() << "accepted";
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("path format \"int4:g64:clip2\""), std::string::npos) << message;
    EXPECT_NE(message.find("(0, 1]"), std::string::npos) << message;
  }
  EXPECT_THROW(PathFormat::parse(""), InvalidArgument);
  EXPECT_THROW(PathFormat::parse("int4:g64 "), InvalidArgument);
}

TEST(PathFormat, KeptPairsTakeFourBytesEach) {
  EXPECT_EQ(PathFormat::parse("int4:g64:bf16pairs=5+21").encoded_bytes(64), 44);  // 36 + 2 x 4
  EXPECT_EQ(PathFormat::parse("int4:g64:bf16pairs=5+21").encoded_bytes(512), 288 + 8);
  EXPECT_EQ(PathFormat::parse("int2:g32:clip0.9:bf16pairs=0+1+31").encoded_bytes(64), 24 + 12);
  // Every pair of a width may be kept (the codes stay, unused).
  std::vector<int> every_pair(16);
  for (int i = 0; i < 16; ++i) every_pair[static_cast<size_t>(i)] = i;
  EXPECT_EQ(path(Codec::kInt8, 32, 1.0f, every_pair).encoded_bytes(32), 32 + 4 + 16 * 4);
}

TEST(PathFormat, EqualityIncludesKeptPairs) {
  EXPECT_EQ(PathFormat::parse("int4:g64:bf16pairs=21+5"), path(Codec::kInt4, 64, 1.0f, {5, 21}));
  EXPECT_NE(PathFormat::parse("int4:g64:bf16pairs=5"), PathFormat::parse("int4:g64:bf16pairs=6"));
  EXPECT_NE(PathFormat::parse("int4:g64:bf16pairs=5"), PathFormat::parse("int4:g64"));
  EXPECT_NE(CacheFormat::parse("rope=int4:g64:bf16pairs=5"), CacheFormat::parse("rope=int4:g64"));
}

// The parser cannot know the width; encoded_bytes (and so every codec and cache) checks it.
TEST(PathFormat, KeptPairsMustFitTheWidth) {
  using testing::error_message;
  using testing::expect_contains;
  const PathFormat pair_32 = PathFormat::parse("int4:g64:bf16pairs=5+32");
  EXPECT_EQ(pair_32.encoded_bytes(128), 64 + 2 * 4 + 2 * 4);
  expect_contains(error_message<InvalidArgument>([&] { pair_32.encoded_bytes(64); }),
                  {"int4:g64:bf16pairs=5+32", "pair index 32", "channels 64, 65", "width 64"});
  expect_contains(error_message<InvalidArgument>(
                      [] { PathFormat::parse("int8:g32:bf16pairs=2147483647").encoded_bytes(64); }),
                  {"pair index 2147483647", "channels 4294967294, 4294967295", "width 64"});
  expect_contains(error_message<InvalidArgument>([] {
                    CacheFormat::parse("rope=int4:g64:bf16pairs=40").record_bytes(512, 64);
                  }),
                  {"rope path", "rope_dim 64", "pair index 40", "width 64"});
  EXPECT_EQ(CacheFormat::parse("content=int4:g64:bf16pairs=40").record_bytes(512, 64),
            288 + 4 + 128);

  std::vector<int> too_many(33);
  for (int i = 0; i < 33; ++i) too_many[static_cast<size_t>(i)] = i;
  expect_contains(error_message<InvalidArgument>(
                      [&] { path(Codec::kInt4, 32, 1.0f, too_many).encoded_bytes(64); }),
                  {"33 kept pairs", "width 64 has only 32 pairs"});
  // Hand-built formats that no spec could produce.
  expect_contains(error_message<InvalidArgument>([] {
                    path(Codec::kInt4, 64, 1.0f, {21, 5}).encoded_bytes(64);
                  }),
                  {"not ascending and unique: 5 after 21"});
  expect_contains(error_message<InvalidArgument>([] {
                    path(Codec::kInt4, 64, 1.0f, {5, 5}).encoded_bytes(64);
                  }),
                  {"5 after 5"});
  expect_contains(
      error_message<InvalidArgument>([] { path(Codec::kInt4, 64, 1.0f, {-1}).encoded_bytes(64); }),
      {"negative pair index -1"});
  for (const PathFormat& format :
       {path(Codec::kBF16, 0, 1.0f, {1}), path(Codec::kFP8, 128, 1.0f, {1}),
        path(Codec::kQ8_0, 32, 1.0f, {1}), path(Codec::kF32, 0, 1.0f, {1})}) {
    expect_contains(error_message<InvalidArgument>([&] { format.encoded_bytes(128); }),
                    {format.to_string(), "only int8, int4 and int2 keep BF16 pairs"});
  }
}

TEST(PathFormat, BitsPerCode) {
  EXPECT_EQ(path(Codec::kF32).bits(), 32);
  EXPECT_EQ(path(Codec::kBF16).bits(), 16);
  EXPECT_EQ(path(Codec::kFP8, 128).bits(), 8);
  EXPECT_EQ(path(Codec::kInt8, 64).bits(), 8);
  EXPECT_EQ(path(Codec::kInt4, 64).bits(), 4);
  EXPECT_EQ(path(Codec::kInt2, 64).bits(), 2);
  EXPECT_EQ(path(Codec::kQ8_0, 32).bits(), 8);
  EXPECT_EQ(path(Codec::kQ4_0, 32).bits(), 4);
}

TEST(PathFormat, EncodedBytesFollowTheLayout) {
  for (const int64_t width : {0, 128, 256, 512}) {
    SCOPED_TRACE("width " + std::to_string(width));
    EXPECT_EQ(path(Codec::kF32).encoded_bytes(width), 4 * width);
    EXPECT_EQ(path(Codec::kBF16).encoded_bytes(width), 2 * width);
    EXPECT_EQ(path(Codec::kFP8, 128).encoded_bytes(width), width + 4 * (width / 128));
    EXPECT_EQ(path(Codec::kQ8_0, 32).encoded_bytes(width), 34 * (width / 32));
    EXPECT_EQ(path(Codec::kQ4_0, 32).encoded_bytes(width), 18 * (width / 32));
    for (const Codec codec : {Codec::kInt8, Codec::kInt4, Codec::kInt2}) {
      for (const int group : {32, 64, 128}) {
        const PathFormat format = path(codec, group, 0.9f);
        EXPECT_EQ(format.encoded_bytes(width), width * format.bits() / 8 + 4 * (width / group))
            << format.to_string();
      }
    }
  }
  EXPECT_EQ(path(Codec::kBF16).encoded_bytes(7), 14);  // no groups, any width
}

TEST(PathFormat, EncodedBytesRejectsPartialGroupsAndBadFormats) {
  try {
    path(Codec::kInt4, 64).encoded_bytes(96);
    FAIL() << "accepted";
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("96"), std::string::npos) << message;
    EXPECT_NE(message.find("64"), std::string::npos) << message;
  }
  EXPECT_THROW(path(Codec::kFP8, 128).encoded_bytes(64), InvalidArgument);
  EXPECT_THROW(path(Codec::kQ4_0, 32).encoded_bytes(48), InvalidArgument);
  EXPECT_THROW(path(Codec::kBF16).encoded_bytes(-1), InvalidArgument);
  // Hand-built formats that no spec could produce.
  EXPECT_THROW(path(Codec::kInt4, 0).encoded_bytes(64), InvalidArgument);
  EXPECT_THROW(path(Codec::kInt4, 48).encoded_bytes(96), InvalidArgument);
  EXPECT_THROW(path(Codec::kFP8, 32).encoded_bytes(128), InvalidArgument);
  EXPECT_EQ(path(Codec::kFP8, 64).encoded_bytes(128), 128 + 2 * 4);
  EXPECT_THROW(path(Codec::kBF16, 32).encoded_bytes(64), InvalidArgument);
  EXPECT_THROW(path(Codec::kInt4, 64, 0.0f).encoded_bytes(64), InvalidArgument);
  EXPECT_THROW(path(Codec::kInt4, 64, 1.5f).encoded_bytes(64), InvalidArgument);
  EXPECT_THROW(path(Codec::kQ8_0, 32, 0.5f).encoded_bytes(64), InvalidArgument);
}

struct RecordSize {
  std::string spec;
  int64_t bytes;
};

TEST(CacheFormat, RecordBytesForKvLoraRank512Rope64) {
  // content: 512 values, rope: 64 values; scales counted, no padding.
  const std::vector<RecordSize> sizes = {
      {"bf16", 1024 + 128},                                                                 // 1152
      {"f32", 2048 + 256},                                                                  // 2304
      {"content=fp8,rope=bf16", (512 + 4 * 4) + 128},                                       // 656
      {"content=fp8,rope=fp8", (512 + 4 * 4) + (64 + 4)},                                   // 596
      {"content=q8_0,rope=q8_0", 34 * 16 + 34 * 2},                                         // 612
      {"content=q4_0,rope=q4_0", 18 * 16 + 18 * 2},                                         // 324
      {"content=int4:g64,rope=int4:g64", (256 + 4 * 8) + (32 + 4)},                         // 324
      {"content=int2:g64,rope=int4:g64", (128 + 4 * 8) + (32 + 4)},                         // 196
      {"content=int8:g64,rope=int8:g64", (512 + 4 * 8) + (64 + 4)},                         // 612
      {"content=int4:g64,rope=bf16", (256 + 4 * 8) + 128},                                  // 416
      {"content=int4:g32,rope=int4:g32:clip0.9", (256 + 4 * 16) + (32 + 4 * 2)},            // 360
      {"content=int2:g128,rope=int8:g32", (128 + 4 * 4) + (64 + 4 * 2)},                    // 216
      {"content=int4:g64,rope=int4:g64:bf16pairs=5+21", (256 + 4 * 8) + (32 + 4 + 2 * 4)},  // 332
      {"content=int2:g64:bf16pairs=7,rope=int4:g32:clip0.9:bf16pairs=0+1+31",
       (128 + 4 * 8 + 4) + (32 + 4 * 2 + 3 * 4)},  // 216
  };
  for (const RecordSize& size : sizes) {
    SCOPED_TRACE(size.spec);
    EXPECT_EQ(CacheFormat::parse(size.spec).record_bytes(kKvLoraRank, kRopeDim), size.bytes);
  }
  EXPECT_EQ(CacheFormat::parse("bf16").record_bytes(kKvLoraRank, kRopeDim), 1152);
  EXPECT_EQ(CacheFormat::parse("content=fp8,rope=bf16").record_bytes(kKvLoraRank, kRopeDim), 656);
  EXPECT_EQ(CacheFormat::parse("content=q8_0,rope=q8_0").record_bytes(kKvLoraRank, kRopeDim), 612);
  EXPECT_EQ(CacheFormat::parse("content=q4_0,rope=q4_0").record_bytes(kKvLoraRank, kRopeDim), 324);
  EXPECT_EQ(CacheFormat::parse("content=int4:g64,rope=int4:g64").record_bytes(512, 64), 324);
  EXPECT_EQ(CacheFormat::parse("content=int2:g64,rope=int4:g64").record_bytes(512, 64), 196);
  EXPECT_EQ(CacheFormat::parse("content=int8:g64,rope=int8:g64").record_bytes(512, 64), 612);
  EXPECT_EQ(
      CacheFormat::parse("content=int4:g64,rope=int4:g64:bf16pairs=5+21").record_bytes(512, 64),
      332);
}

TEST(CacheFormat, RecordBytesNamesThePathThatDoesNotFit) {
  try {
    CacheFormat::parse("rope=fp8:g128").record_bytes(kKvLoraRank, kRopeDim);
    FAIL() << "accepted";
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("rope path"), std::string::npos) << message;
    EXPECT_NE(message.find("64"), std::string::npos) << message;
    EXPECT_NE(message.find("128"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace quantmla
