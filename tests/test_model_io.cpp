// A model saved with transforms folded in is the same model when loaded back: bit-identical
// logits, the folded tensors in F32, every other tensor and file as the source had it, and no
// half-written or replaced directory when the save cannot finish.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "error_matchers.h"
#include "model_fixtures.h"
#include "quantmla/config.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/model.h"
#include "quantmla/model_io.h"
#include "quantmla/safetensors.h"
#include "quantmla/transform.h"
#include "test_paths.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::bundled_model;
using testing::error_message;
using testing::expect_contains;
using testing::shared_dir;

fs::path fresh_scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
                       ("quantmla-model-io-" + name + "-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  return dir;
}

std::vector<int32_t> prompt() {
  std::vector<int32_t> ids = read_ids_file(shared_dir() / "reference/wikitext2-test.ids.i32");
  ids.resize(40);
  return ids;
}

// Logits of a prefill of all but the last token, then of a one-token decode step: the two paths
// read the weights differently (GEMMs on FP32, GEMVs on BF16 bits where the checkpoint has them).
std::vector<float> logits_of(const Model& model) {
  const std::vector<int32_t> ids = prompt();
  const int64_t vocab = model.config().vocab_size;
  const auto n = static_cast<int64_t>(ids.size());
  auto cache = model.make_cache(n);
  std::vector<float> logits(static_cast<size_t>(n * vocab));
  model.forward(std::span(ids).first(ids.size() - 1), *cache,
                std::span(logits).first(static_cast<size_t>((n - 1) * vocab)));
  model.forward(std::span(ids).last(1), *cache, std::span(logits).last(static_cast<size_t>(vocab)));
  return logits;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float diff = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
  return diff;
}

// A content rotation in layer 0 and per-pair RoPE scales and angles in layer 1.
Model transformed_mla_tiny() {
  Model model = Model::load(bundled_model());
  fold_content_transform(model, 0, random_hadamard(512, 7));
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> log_scale(std::log(0.5f), std::log(2.0f));
  std::uniform_real_distribution<float> angle(-3.14159265f, 3.14159265f);
  RopeTransform rope;
  for (int i = 0; i < 32; ++i) {
    rope.scales.push_back(std::exp(log_scale(rng)));
    rope.angles.push_back(angle(rng));
  }
  fold_rope_transform(model, 1, rope);
  return model;
}

// What the two folds rewrite.
const std::set<std::string> kChangedTensors = {
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.kv_a_layernorm.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.1.self_attn.q_b_proj.weight",
};

// The transformed model, saved once for the tests that only read the result.
class SavedTransformedModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new fs::path(fresh_scratch("suite"));
    model_ = new Model(transformed_mla_tiny());
    save_model_dir(*model_, bundled_model(), saved());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*scratch_);
    delete model_;
    delete scratch_;
  }
  static fs::path saved() { return *scratch_ / "saved"; }

  static fs::path* scratch_;
  static Model* model_;
};
fs::path* SavedTransformedModel::scratch_ = nullptr;
Model* SavedTransformedModel::model_ = nullptr;

TEST_F(SavedTransformedModel, LoadsWithBitIdenticalLogits) {
  const Model reloaded = Model::load(saved());
  const std::vector<float> saved_logits = logits_of(reloaded);
  EXPECT_TRUE(bitwise_equal(saved_logits, logits_of(*model_)));
  // And the folds kept the function of the original model.
  EXPECT_LE(max_abs_diff(saved_logits, logits_of(testing::mla_tiny())), 1e-4f);
}

TEST_F(SavedTransformedModel, ChangedTensorsAreF32AndTheRestIsCopied) {
  const TensorStore source = TensorStore::open_dir(bundled_model());
  const TensorStore out = TensorStore::open_dir(saved());
  EXPECT_EQ(out.names(), source.names());
  for (const std::string& name : source.names()) {
    const TensorView& a = source.get(name);
    const TensorView& b = out.get(name);
    EXPECT_EQ(b.shape, a.shape) << name;
    if (kChangedTensors.contains(name)) {
      EXPECT_EQ(b.dtype, DType::kF32) << name;
      EXPECT_NE(to_f32(b), to_f32(a)) << name;
    } else {
      EXPECT_EQ(b.dtype, a.dtype) << name;
      ASSERT_EQ(b.nbytes, a.nbytes) << name;
      EXPECT_EQ(std::memcmp(b.data, a.data, a.nbytes), 0) << name;
    }
  }
}

// --folded-dtype bf16: the changed tensors rounded once to BF16 (to nearest even), every other
// tensor still the source's bytes, and the result loads.
TEST_F(SavedTransformedModel, ChangedTensorsCanBeWrittenAsBf16) {
  const fs::path out = *scratch_ / "bf16";
  SaveModelOptions options;
  options.changed_dtype = DType::kBF16;
  save_model_dir(*model_, bundled_model(), out, options);
  const TensorStore exact = TensorStore::open_dir(saved());
  const TensorStore rounded = TensorStore::open_dir(out);
  const TensorStore source = TensorStore::open_dir(bundled_model());
  ASSERT_EQ(rounded.names(), exact.names());
  for (const std::string& name : exact.names()) {
    const TensorView& b = rounded.get(name);
    if (kChangedTensors.contains(name)) {
      ASSERT_EQ(b.dtype, DType::kBF16) << name;
      const std::vector<float> values = to_f32(exact.get(name));
      ASSERT_EQ(b.nbytes, values.size() * 2) << name;
      size_t mismatches = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        uint16_t bits;
        std::memcpy(&bits, b.data + 2 * i, 2);
        mismatches += bits != f32_to_bf16(values[i]);
      }
      EXPECT_EQ(mismatches, 0u) << name;
    } else {
      const TensorView& a = source.get(name);
      EXPECT_EQ(b.dtype, a.dtype) << name;
      ASSERT_EQ(b.nbytes, a.nbytes) << name;
      EXPECT_EQ(std::memcmp(b.data, a.data, a.nbytes), 0) << name;
    }
  }
  for (const float logit : logits_of(Model::load(out))) ASSERT_TRUE(std::isfinite(logit));
}

TEST_F(SavedTransformedModel, OneShardByDefaultAndTheOtherFilesCopied) {
  const json index = json::parse(read_text_file(saved() / "model.safetensors.index.json"));
  uint64_t total = 0;
  const TensorStore out = TensorStore::open_dir(saved());
  for (const std::string& name : out.names()) {
    EXPECT_EQ(index["weight_map"][name], "model-00001-of-00001.safetensors") << name;
    total += out.get(name).nbytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(SafetensorsFile::open(saved() / "model-00001-of-00001.safetensors")->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}}));

  for (const char* file : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(read_text_file(saved() / file), read_text_file(bundled_model() / file)) << file;
  }
  const json config = json::parse(read_text_file(saved() / "config.json"));
  EXPECT_EQ(config, json::parse(read_text_file(bundled_model() / "config.json")));
  EXPECT_FALSE(config.contains("quantmla"));
  std::set<std::string> files;
  for (const auto& entry : fs::directory_iterator(saved())) {
    files.insert(entry.path().filename().string());
  }
  EXPECT_EQ(files, (std::set<std::string>{"config.json", "model-00001-of-00001.safetensors",
                                          "model.safetensors.index.json", "tokenizer.json",
                                          "tokenizer_config.json"}));
  EXPECT_FALSE(fs::exists(saved().string() + ".partial"));
}

class SaveModel : public ::testing::Test {
 protected:
  void SetUp() override { scratch_ = fresh_scratch("test"); }
  void TearDown() override { fs::remove_all(scratch_); }

  // A copy of the bundled model, for tests that must not risk the original.
  fs::path copy_of_bundled(const std::string& name) {
    const fs::path dir = scratch_ / name;
    fs::copy(bundled_model(), dir, fs::copy_options::recursive);
    return dir;
  }

  fs::path scratch_;
};

TEST_F(SaveModel, SmallShardsSplitAtTensorBoundaries) {
  const Model model = transformed_mla_tiny();
  const fs::path out = scratch_ / "sharded";
  SaveModelOptions options;
  options.max_shard_bytes = 8 << 20;
  save_model_dir(model, bundled_model(), out, options);

  const json index = json::parse(read_text_file(out / "model.safetensors.index.json"));
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : index["weight_map"].items()) shards.insert(shard);
  ASSERT_GT(shards.size(), 3u);
  std::string count = std::to_string(shards.size());
  count.insert(0, 5 - count.size(), '0');
  size_t listed = 0;
  for (const std::string& shard : shards) {
    EXPECT_TRUE(shard.ends_with("-of-" + count + ".safetensors")) << shard;
    const auto file = SafetensorsFile::open(out / shard);
    size_t bytes = 0;
    for (const TensorView& tensor : file->tensors()) bytes += tensor.nbytes;
    // Over the limit only when the shard is a single larger tensor.
    EXPECT_TRUE(bytes <= size_t{8} << 20 || file->tensors().size() == 1) << shard;
    listed += file->tensors().size();
  }
  EXPECT_EQ(listed, index["weight_map"].size());
  EXPECT_EQ(TensorStore::open_dir(out).names(), TensorStore::open_dir(bundled_model()).names());
  EXPECT_TRUE(bitwise_equal(logits_of(Model::load(out)), logits_of(model)));
}

TEST_F(SaveModel, ExistingOutputNeedsForceAndIsReplacedWhole) {
  const Model& model = testing::mla_tiny();
  const fs::path out = scratch_ / "out";
  fs::create_directories(out);
  std::ofstream(out / "old.txt") << "old";
  expect_contains(
      error_message<InvalidArgument>([&] { save_model_dir(model, bundled_model(), out, {}); }),
      {out.string(), "exists", "--force"});
  EXPECT_TRUE(fs::exists(out / "old.txt"));
  EXPECT_FALSE(fs::exists(scratch_ / "out.partial"));

  SaveModelOptions force;
  force.force = true;
  save_model_dir(model, bundled_model(), out.string() + "/", force);
  EXPECT_FALSE(fs::exists(out / "old.txt"));
  EXPECT_TRUE(fs::exists(out / "config.json"));
  EXPECT_FALSE(fs::exists(scratch_ / "out.partial"));
  EXPECT_EQ(TensorStore::open_dir(out).names(), TensorStore::open_dir(bundled_model()).names());
}

TEST_F(SaveModel, RefusesToReplaceTheSource) {
  const fs::path source = copy_of_bundled("source");
  const Model model = Model::load(source);
  SaveModelOptions force;
  force.force = true;
  for (const fs::path& out :
       {source, fs::path(source.string() + "/"), scratch_ / "." / "source", fs::path(scratch_)}) {
    expect_contains(
        error_message<InvalidArgument>([&] { save_model_dir(model, source, out, force); }),
        {"source model directory"});
  }
  EXPECT_NO_THROW(TensorStore::open_dir(source));
}

// A save that fails part way leaves neither a partial directory nor a damaged old output.
TEST_F(SaveModel, FailedSaveLeavesTheOldOutput) {
  const fs::path source = copy_of_bundled("source");
  const Model model = Model::load(source);
  std::ofstream(source / "config.json", std::ios::trunc) << "{ not json";
  const fs::path out = scratch_ / "out";
  fs::create_directories(out);
  std::ofstream(out / "old.txt") << "old";
  SaveModelOptions force;
  force.force = true;
  expect_contains(error_message<FormatError>([&] { save_model_dir(model, source, out, force); }),
                  {(source / "config.json").string(), "not valid JSON"});
  EXPECT_TRUE(fs::exists(out / "old.txt"));
  EXPECT_FALSE(fs::exists(scratch_ / "out.partial"));
}

TEST_F(SaveModel, QuantmlaKeyRoundTrips) {
  const fs::path out = scratch_ / "calibrated";
  SaveModelOptions options;
  options.quantmla_json = R"({"cache": "content=int4:g64,rope=int4:g64", "steps": 200})";
  save_model_dir(testing::mla_tiny(), bundled_model(), out, options);
  const ModelConfig config = ModelConfig::from_file(out / "config.json");
  EXPECT_EQ(config.quantmla_cache, "content=int4:g64,rope=int4:g64");
  EXPECT_EQ(json::parse(config.quantmla_json), json::parse(options.quantmla_json));
  const json written = json::parse(read_text_file(out / "config.json"));
  EXPECT_EQ(written["quantmla"]["steps"], 200);
  EXPECT_EQ(written["model_type"], "deepseek_v3");
  EXPECT_EQ(Model::load(out).config().quantmla_cache, config.quantmla_cache);

  // Saving a calibrated model again without a new record drops the old one.
  const fs::path again = scratch_ / "again";
  save_model_dir(Model::load(out), out, again, {});
  EXPECT_EQ(ModelConfig::from_file(again / "config.json").quantmla_cache, "");
}

TEST_F(SaveModel, ChangedTensorsOnlyAsF32OrBf16) {
  SaveModelOptions options;
  options.changed_dtype = DType::kF16;
  const fs::path out = scratch_ / "f16";
  expect_contains(error_message<InvalidArgument>(
                      [&] { save_model_dir(testing::mla_tiny(), bundled_model(), out, options); }),
                  {"as F32 or BF16, not F16"});
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(SaveModel, QuantmlaJsonMustBeAnObject) {
  for (const char* text : {"[1, 2]", "{\"cache\": ", "\"content=int4:g64\""}) {
    SaveModelOptions options;
    options.quantmla_json = text;
    EXPECT_THROW(save_model_dir(testing::mla_tiny(), bundled_model(), scratch_ / "out", options),
                 FormatError)
        << text;
    EXPECT_FALSE(fs::exists(scratch_ / "out")) << text;
    EXPECT_FALSE(fs::exists(scratch_ / "out.partial")) << text;
  }
}

TEST_F(SaveModel, RecordedCacheSpecIsChecked) {
  const fs::path source = copy_of_bundled("bad");
  json config = json::parse(read_text_file(source / "config.json"));
  config["quantmla"] = {{"cache", "content=int9"}};
  std::ofstream(source / "config.json", std::ios::trunc) << config.dump(2);
  expect_contains(error_message<FormatError>([&] { Model::load(source); }),
                  {(source / "config.json").string(), "content=int9"});
}

}  // namespace
}  // namespace quantmla
