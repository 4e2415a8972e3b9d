#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "error_matchers.h"
#include "quantmla/error.h"
#include "quantmla/safetensors.h"
#include "test_paths.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;

using testing::error_message;
using testing::expect_contains;

// Writes a safetensors file by hand: 8-byte length `header_length` (the real length by default),
// the header text and `data_size` zero bytes.
void write_raw(const fs::path& path, const std::string& header, size_t data_size,
               std::optional<uint64_t> header_length = std::nullopt) {
  const uint64_t length = header_length.value_or(header.size());
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << header << std::string(data_size, '\0');
}

class SafetensorsTempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("quantmla_st_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

TEST(Safetensors, LoadsBundledShardedModel) {
  const TensorStore store = TensorStore::open_dir(testing::bundled_model());
  const std::vector<std::string> names = store.names();
  EXPECT_EQ(names.size(), 75u);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_TRUE(store.contains("model.embed_tokens.weight"));
  EXPECT_FALSE(store.contains("model.embed_tokens"));

  const TensorView& lm_head = store.get("lm_head.weight", {4096, 512});
  EXPECT_EQ(lm_head.dtype, DType::kBF16);
  EXPECT_EQ(lm_head.numel(), 4096 * 512);
  EXPECT_EQ(lm_head.nbytes, 4096u * 512u * 2u);
  EXPECT_EQ(lm_head.shape_string(), "[4096,512]");
  EXPECT_EQ(fs::path(lm_head.file).filename(), "model-00001-of-00004.safetensors");

  const TensorView& q_a = store.get("model.layers.0.self_attn.q_a_proj.weight", {256, 512});
  EXPECT_EQ(fs::path(q_a.file).filename(), "model-00002-of-00004.safetensors");
  store.get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", {512 + 64, 512});
}

TEST(Safetensors, Bf16ToF32MatchesBitShift) {
  const TensorStore store = TensorStore::open_dir(testing::bundled_model());
  const TensorView& norm = store.get("model.layers.0.input_layernorm.weight", {512});
  ASSERT_EQ(norm.dtype, DType::kBF16);
  const std::vector<float> values = to_f32(norm);
  ASSERT_EQ(values.size(), 512u);
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, norm.data + 2 * i, 2);
    ASSERT_EQ(std::bit_cast<uint32_t>(values[i]), static_cast<uint32_t>(bits) << 16) << i;
  }
}

TEST(Safetensors, LoadsSingleFileMoeModel) {
  const TensorStore store =
      TensorStore::open_dir(testing::shared_dir() / "models" / "mla-tiny-moe");
  EXPECT_EQ(store.names().size(), 91u);
  const TensorView& gate = store.get("model.layers.1.mlp.gate.weight", {8, 128});
  EXPECT_EQ(gate.dtype, DType::kF32);
  store.get("model.layers.1.mlp.experts.7.down_proj.weight", {128, 64});
  store.get("model.layers.2.mlp.gate.e_score_correction_bias", {8});

  const std::vector<float> values = to_f32(gate);
  ASSERT_EQ(values.size(), 8u * 128u);
  EXPECT_EQ(std::memcmp(values.data(), gate.data, gate.nbytes), 0);
}

TEST(Safetensors, OpenFileReportsMetadataAndFind) {
  const auto file = SafetensorsFile::open(testing::shared_dir() / "models" / "mla-tiny-moe" /
                                          "model.safetensors");
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->tensors().size(), 91u);
  ASSERT_NE(file->find("lm_head.weight"), nullptr);
  EXPECT_EQ(file->find("lm_head.weight")->shape_string(), "[4096,128]");
  EXPECT_EQ(file->find("lm_head"), nullptr);
  EXPECT_EQ(file->find("zzz"), nullptr);
}

TEST_F(SafetensorsTempDir, WriterRoundTrip) {
  const std::vector<float> f32_values = {1.0f, -2.5f, 3.25f, 0.0f, 1e-8f, -65504.0f};
  const std::vector<float> bf16_values = {1.0f, 3.0f, -0.5f, 1.0078125f};
  std::vector<TensorData> tensors;
  tensors.push_back(make_f32_tensor("a.weight", {2, 3}, f32_values));
  tensors.push_back(make_bf16_tensor("b.weight", {4}, bf16_values));
  tensors.push_back(make_f32_tensor("empty", {0, 7}, {}));
  TensorData ids{"ids", DType::kI64, {3}, std::vector<std::byte>(24)};
  const int64_t id_values[3] = {7, -3, 2147483647};
  std::memcpy(ids.bytes.data(), id_values, sizeof(id_values));
  tensors.push_back(ids);
  const fs::path path = dir_ / "round_trip.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "test"}});

  std::ifstream in(path, std::ios::binary);
  uint64_t header_length = 0;
  in.read(reinterpret_cast<char*>(&header_length), 8);
  EXPECT_EQ(header_length % 8, 0u);  // data section stays 8-byte aligned

  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file->metadata().at("note"), "test");
  EXPECT_EQ(file->tensors().size(), 4u);
  const TensorView* a = file->find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape_string(), "[2,3]");
  EXPECT_EQ(to_f32(*a), f32_values);
  const TensorView* b = file->find("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, DType::kBF16);
  EXPECT_EQ(to_f32(*b), bf16_values);  // all exactly representable in BF16
  const TensorView* empty = file->find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->nbytes, 0u);
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(to_i32(*file->find("ids")), (std::vector<int32_t>{7, -3, 2147483647}));
  EXPECT_EQ(to_f32(*file->find("ids")), (std::vector<float>{7.0f, -3.0f, 2147483647.0f}));
}

TEST_F(SafetensorsTempDir, BF16WriterRoundsToNearestEven) {
  const std::vector<float> values = {std::bit_cast<float>(0x3f808000u)};  // tie -> 0x3f80
  const fs::path path = dir_ / "bf16.safetensors";
  write_safetensors(path, {make_bf16_tensor("x", {1}, values)});
  EXPECT_EQ(to_f32(*SafetensorsFile::open(path)->find("x")), std::vector<float>{1.0f});
}

TEST_F(SafetensorsTempDir, ToI32RejectsFloatAndOverflow) {
  const fs::path path = dir_ / "ints.safetensors";
  TensorData big{"big", DType::kI64, {1}, std::vector<std::byte>(8)};
  const int64_t too_big = int64_t{1} << 40;
  std::memcpy(big.bytes.data(), &too_big, 8);
  write_safetensors(path, {big, make_f32_tensor("floats", {1}, std::vector<float>{1.0f})});
  const auto file = SafetensorsFile::open(path);
  expect_contains(error_message<ShapeError>([&] { to_i32(*file->find("big")); }),
                  {"big", std::to_string(too_big), "int32"});
  expect_contains(error_message<ShapeError>([&] { to_i32(*file->find("floats")); }),
                  {"floats", "F32", "ints.safetensors"});
}

TEST(Safetensors, MakeTensorRejectsWrongValueCount) {
  const std::vector<float> values(5);
  expect_contains(error_message<ShapeError>([&] {
                    make_f32_tensor("w", {2, 3}, values);
                  }),
                  {"w", "[2,3]", "6", "5"});
  expect_contains(error_message<ShapeError>([&] {
                    make_bf16_tensor("w", {2, 2}, values);
                  }),
                  {"w", "[2,2]", "4", "5"});
}

TEST_F(SafetensorsTempDir, WriterRejectsByteCountMismatch) {
  TensorData bad{"bad", DType::kF32, {2, 2}, std::vector<std::byte>(15)};
  expect_contains(
      error_message<ShapeError>([&] { write_safetensors(dir_ / "x.safetensors", {bad}); }),
      {"bad", "[2,2]", "16", "15"});
}

TEST_F(SafetensorsTempDir, ZeroSizeTensorsMayShareOffsets) {
  const fs::path path = dir_ / "zero.safetensors";
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("z":{"dtype":"BF16","shape":[0,4],"data_offsets":[4,4]}})",
            8);
  const auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file->find("z")->nbytes, 0u);
  EXPECT_TRUE(to_f32(*file->find("z")).empty());
}

TEST_F(SafetensorsTempDir, RejectsFileShorterThanLengthField) {
  const fs::path path = dir_ / "tiny.safetensors";
  std::ofstream(path, std::ios::binary) << "abc";
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"tiny.safetensors", "3 bytes", "8-byte"});
}

TEST_F(SafetensorsTempDir, RejectsTruncatedDataSection) {
  const fs::path path = dir_ / "model-00001-of-00004.safetensors";
  write_safetensors(path, {make_f32_tensor("first", {4}, std::vector<float>(4)),
                           make_f32_tensor("second", {25}, std::vector<float>(25))});
  const auto full_size = fs::file_size(path);
  fs::resize_file(path, full_size - 40);  // cut inside the second tensor (bytes [16,116])
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"model-00001-of-00004.safetensors", "tensor second", "data_offsets [16,116]",
                   "end beyond data section of 76 bytes"});
}

TEST_F(SafetensorsTempDir, RejectsHeaderLengthBeyondFile) {
  const fs::path path = dir_ / "long_header.safetensors";
  write_raw(path, "{}", 0, 1000);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"long_header.safetensors", "header length 1000", "file of 10 bytes"});
}

TEST_F(SafetensorsTempDir, RejectsAbsurdHeaderLength) {
  const fs::path path = dir_ / "absurd.safetensors";
  write_raw(path, "{}", 0, uint64_t{1} << 40);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"absurd.safetensors", std::to_string(uint64_t{1} << 40), "100000000"});
}

TEST_F(SafetensorsTempDir, RejectsInvalidJsonHeader) {
  const fs::path path = dir_ / "bad_json.safetensors";
  write_raw(path, R"({"a": {"dtype": "F32",)", 0);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"bad_json.safetensors", "not valid JSON"});
  // A number beyond a double: nlohmann's out_of_range, which once escaped as an untyped
  // exception (found by tests/fuzz/fuzz_safetensors).
  write_raw(path, "62e71114", 0);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"bad_json.safetensors", "not valid JSON", "number overflow"});
}

TEST_F(SafetensorsTempDir, RejectsNonObjectHeader) {
  const fs::path path = dir_ / "array.safetensors";
  write_raw(path, "[1,2]", 0);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"array.safetensors", "array", "object"});
}

TEST_F(SafetensorsTempDir, RejectsNonStringMetadata) {
  const fs::path path = dir_ / "meta.safetensors";
  write_raw(path, R"({"__metadata__":{"format":"pt","step":12}})", 0);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"meta.safetensors", "__metadata__", "step", "12"});
}

TEST_F(SafetensorsTempDir, RejectsOffsetsOutsideDataSection) {
  const fs::path path = dir_ / "model-00001-of-00004.safetensors";
  write_raw(path,
            R"({"model.layers.3.self_attn.kv_b_proj.weight":)"
            R"({"dtype":"F32","shape":[50],"data_offsets":[100,300]}})",
            200);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"model-00001-of-00004.safetensors: tensor "
                   "model.layers.3.self_attn.kv_b_proj.weight: data_offsets [100,300] end beyond "
                   "data section of 200 bytes"});
}

TEST_F(SafetensorsTempDir, RejectsOffsetsBeginAfterEnd) {
  const fs::path path = dir_ / "reversed.safetensors";
  write_raw(path, R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", 16);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"reversed.safetensors", "tensor w", "[8,4]"});
}

TEST_F(SafetensorsTempDir, RejectsOverlappingOffsets) {
  const fs::path path = dir_ / "overlap.safetensors";
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
            R"("b":{"dtype":"F32","shape":[4],"data_offsets":[32,48]},)"
            R"("c":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
            48);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"overlap.safetensors", "tensor c", "[8,24]", "tensor a", "[0,16]", "overlap"});
}

TEST_F(SafetensorsTempDir, RejectsDtypeShapeByteMismatch) {
  const fs::path path = dir_ / "mismatch.safetensors";
  write_raw(path, R"({"X":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,30]}})", 32);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"mismatch.safetensors: tensor X: dtype BF16 shape [4,4] needs 32 bytes, "
                   "data_offsets give 30"});
}

TEST_F(SafetensorsTempDir, RejectsUnknownDtype) {
  const fs::path path = dir_ / "fp8.safetensors";
  write_raw(path, R"({"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"fp8.safetensors", "tensor w", "unknown dtype \"F8_E4M3\""});
}

TEST_F(SafetensorsTempDir, RejectsBadShape) {
  const fs::path path = dir_ / "shape.safetensors";
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,4]}})", 4);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"shape.safetensors", "tensor w", "[2,-1]"});
  write_raw(path, R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"shape.safetensors", "tensor w", "shape"});
}

TEST_F(SafetensorsTempDir, RejectsMissingDataOffsets) {
  const fs::path path = dir_ / "offsets.safetensors";
  write_raw(path, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4);
  expect_contains(error_message<FormatError>([&] { SafetensorsFile::open(path); }),
                  {"offsets.safetensors", "tensor w", "data_offsets"});
}

TEST_F(SafetensorsTempDir, MissingFileIsIoError) {
  expect_contains(error_message<IoError>([&] { SafetensorsFile::open(dir_ / "nope.safetensors"); }),
                  {"nope.safetensors"});
}

// A two-shard directory whose index the tests below corrupt.
void write_sharded_model(const fs::path& dir, const std::string& index_text) {
  write_safetensors(dir / "model-00001-of-00002.safetensors",
                    {make_f32_tensor("a", {2}, std::vector<float>{1, 2})});
  write_safetensors(dir / "model-00002-of-00002.safetensors",
                    {make_f32_tensor("b", {1, 3}, std::vector<float>{3, 4, 5})});
  std::ofstream(dir / "model.safetensors.index.json") << index_text;
}

TEST_F(SafetensorsTempDir, LoadsShardedDirectory) {
  write_sharded_model(dir_, R"({"metadata":{},"weight_map":{)"
                            R"("a":"model-00001-of-00002.safetensors",)"
                            R"("b":"model-00002-of-00002.safetensors"}})");
  const TensorStore store = TensorStore::open_dir(dir_);
  EXPECT_EQ(store.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(to_f32(store.get("b", {1, 3})), (std::vector<float>{3, 4, 5}));
  EXPECT_EQ(store.dir(), dir_);
}

TEST_F(SafetensorsTempDir, IndexNamingMissingShard) {
  write_sharded_model(dir_, R"({"weight_map":{"a":"model-00001-of-00002.safetensors",)"
                            R"("b":"model-00009-of-00009.safetensors"}})");
  expect_contains(error_message<IoError>([&] { TensorStore::open_dir(dir_); }),
                  {(dir_ / "model-00009-of-00009.safetensors").string(), "tensor b",
                   "model.safetensors.index.json"});
}

TEST_F(SafetensorsTempDir, IndexNamingTensorAbsentFromShard) {
  write_sharded_model(dir_, R"({"weight_map":{"a":"model-00001-of-00002.safetensors",)"
                            R"("b":"model-00001-of-00002.safetensors"}})");
  expect_contains(error_message<FormatError>([&] { TensorStore::open_dir(dir_); }),
                  {"tensor b", "model-00001-of-00002.safetensors", "does not contain"});
}

TEST_F(SafetensorsTempDir, IndexWithInvalidJson) {
  write_sharded_model(dir_, R"({"weight_map":{"a":)");
  expect_contains(error_message<FormatError>([&] { TensorStore::open_dir(dir_); }),
                  {"model.safetensors.index.json", "not valid JSON"});
  write_sharded_model(dir_, R"({"metadata":{"total_size":1e400},"weight_map":{}})");
  expect_contains(error_message<FormatError>([&] { TensorStore::open_dir(dir_); }),
                  {"model.safetensors.index.json", "not valid JSON", "number overflow"});
}

TEST_F(SafetensorsTempDir, IndexWithoutWeightMap) {
  write_sharded_model(dir_, R"({"metadata":{"total_size":20}})");
  expect_contains(error_message<FormatError>([&] { TensorStore::open_dir(dir_); }),
                  {"model.safetensors.index.json", "weight_map"});
}

TEST_F(SafetensorsTempDir, CorruptShardIsReportedByName) {
  write_sharded_model(dir_, R"({"weight_map":{"a":"model-00001-of-00002.safetensors",)"
                            R"("b":"model-00002-of-00002.safetensors"}})");
  fs::resize_file(dir_ / "model-00002-of-00002.safetensors",
                  fs::file_size(dir_ / "model-00002-of-00002.safetensors") - 4);
  expect_contains(error_message<FormatError>([&] { TensorStore::open_dir(dir_); }),
                  {"model-00002-of-00002.safetensors", "tensor b", "data_offsets [0,12]"});
}

TEST_F(SafetensorsTempDir, GetMissingTensorNamesTensorAndDirectory) {
  write_safetensors(dir_ / "model.safetensors", {make_f32_tensor("a", {2}, std::vector<float>(2))});
  const TensorStore store = TensorStore::open_dir(dir_);
  expect_contains(error_message<FormatError>([&] { store.get("model.norm.weight"); }),
                  {"tensor model.norm.weight: missing from " + dir_.string()});
}

TEST_F(SafetensorsTempDir, GetWithWrongShapeNamesBothShapes) {
  write_safetensors(dir_ / "model.safetensors",
                    {make_f32_tensor("X", {4, 2}, std::vector<float>(8))});
  const TensorStore store = TensorStore::open_dir(dir_);
  EXPECT_EQ(store.get("X", {4, 2}).numel(), 8);
  expect_contains(
      error_message<ShapeError>([&] {
        store.get("X", {4, 3});
      }),
      {"tensor X: shape [4,2], expected [4,3] (in " + (dir_ / "model.safetensors").string() + ")"});
  expect_contains(error_message<ShapeError>([&] { store.get("X", {8}); }),
                  {"shape [4,2], expected [8]"});
}

TEST_F(SafetensorsTempDir, DirectoryWithoutWeights) {
  std::ofstream(dir_ / "config.json") << "{}";
  expect_contains(error_message<IoError>([&] { TensorStore::open_dir(dir_); }),
                  {dir_.string(), "model.safetensors"});
}

TEST(Safetensors, NonexistentDirectory) {
  const fs::path missing = fs::temp_directory_path() / "quantmla_no_such_model_dir";
  expect_contains(error_message<IoError>([&] { TensorStore::open_dir(missing); }),
                  {"model directory " + missing.string() + " does not exist"});
}

}  // namespace
}  // namespace quantmla
