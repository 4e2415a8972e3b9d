// make_random_model / `quantmla make-random-model`: the presets' configs, shrunk random models that
// the engine loads and runs, determinism, the streaming safetensors writer and the errors.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli_runner.h"
#include "error_matchers.h"
#include "quantmla/config.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/model.h"
#include "quantmla/random_model.h"
#include "quantmla/safetensors.h"
#include "test_paths.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using testing::error_message;
using testing::expect_contains;
using testing::slurp;

class RandomModel : public ::testing::Test {
 protected:
  void SetUp() override {
    scratch_ = fs::temp_directory_path() / ("quantmla-random-model-" + std::to_string(::getpid()) +
                                            "-" + std::to_string(std::random_device{}()));
    fs::create_directories(scratch_);
  }
  void TearDown() override { fs::remove_all(scratch_); }

  // A few-MB model of `preset`'s kind: real MLA head dims, small everything else.
  RandomModelOptions shrunk(const std::string& preset, int64_t layers, const std::string& out) {
    RandomModelOptions options;
    options.preset = preset;
    options.layers = layers;
    options.out_dir = scratch_ / out;
    options.tokenizer = testing::bundled_model() / "tokenizer.json";
    options.overrides.hidden_size = 64;
    options.overrides.intermediate_size = 128;
    options.overrides.moe_intermediate_size = 32;
    options.overrides.num_heads = 2;
    options.overrides.vocab_size = 512;
    // V3's 8 groups with top-4 groups and top-8 experts need at least 2 experts per group.
    options.overrides.n_routed_experts = 16;
    if (preset == "deepseek-v3") options.overrides.q_lora_rank = 32;
    return options;
  }

  ModelConfig config_of(const RandomModelOptions& options) {
    const fs::path file = scratch_ / (options.preset + ".json");
    std::ofstream(file) << random_model_config_json(options);
    return ModelConfig::from_file(file);
  }

  fs::path scratch_;
};

TEST_F(RandomModel, PresetConfigsParseWithTheirNumbers) {
  EXPECT_EQ(random_model_presets(),
            (std::vector<std::string>{"deepseek-v2-lite", "moonlight-16b", "deepseek-v3"}));
  RandomModelOptions options;
  options.layers = 2;

  options.preset = "deepseek-v2-lite";
  ModelConfig c = config_of(options);
  EXPECT_EQ(c.model_type, "deepseek_v2");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 16);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 10944);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.vocab_size, 102400);
  EXPECT_EQ(c.scoring_func, "softmax");
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 1.0);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_DOUBLE_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.mscale, 0.707);
  EXPECT_DOUBLE_EQ(c.rope.mscale_all_dim, 0.707);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.bos_token_id, 100000);
  EXPECT_EQ(c.eos_token_id, 100001);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_TRUE(c.is_moe_layer(1));
  const auto json = nlohmann::json::parse(random_model_config_json(options));
  EXPECT_TRUE(json["q_lora_rank"].is_null());
  EXPECT_EQ(json["architectures"], nlohmann::json::array({"DeepseekV2ForCausalLM"}));
  EXPECT_EQ(json["moe_layer_freq"], 1);
  EXPECT_EQ(json["num_key_value_heads"], 16);
  EXPECT_EQ(json["tie_word_embeddings"], false);

  options.preset = "moonlight-16b";
  c = config_of(options);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_heads, 16);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 11264);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.n_routed_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.n_shared_experts, 2);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.446);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rope.theta, 50000.0);
  EXPECT_FALSE(c.rope.yarn);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_id, 163585);
  EXPECT_TRUE(nlohmann::json::parse(random_model_config_json(options))["rope_scaling"].is_null());

  options.preset = "deepseek-v3";
  options.layers = 4;
  c = config_of(options);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.num_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_TRUE(c.rope.yarn);
  EXPECT_DOUBLE_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.mscale, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));

  // Fewer layers than first_k_dense_replace: an all-dense model, still a valid config.
  options.layers = 2;
  EXPECT_FALSE(config_of(options).is_moe_layer(1));

  // The full presets: their layer counts and the published parameter counts (without V3's
  // multi-token-prediction layer).
  options.layers.reset();
  options.preset = "deepseek-v2-lite";
  EXPECT_EQ(config_of(options).num_layers, 27);
  EXPECT_NEAR(random_model_parameters(options) * 1e-9, 15.7, 0.05);
  options.preset = "moonlight-16b";
  EXPECT_EQ(config_of(options).num_layers, 27);
  EXPECT_NEAR(random_model_parameters(options) * 1e-9, 16.0, 0.1);
  options.preset = "deepseek-v3";
  EXPECT_EQ(config_of(options).num_layers, 61);
  EXPECT_NEAR(random_model_parameters(options) * 1e-9, 671.0, 1.0);
}

// Every routing kind: V2 softmax greedy, Moonlight sigmoid noaux_tc, V3 sigmoid noaux_tc in groups
// (with q LoRA).
TEST_F(RandomModel, ShrunkModelsLoadAndRunWithModerateLogits) {
  for (const auto& [preset, layers] : std::vector<std::pair<std::string, int64_t>>{
           {"deepseek-v2-lite", 2}, {"moonlight-16b", 2}, {"deepseek-v3", 4}}) {
    SCOPED_TRACE(preset);
    RandomModelOptions options = shrunk(preset, layers, preset);
    options.max_shard_bytes = 1 << 20;  // several shards
    const RandomModelSummary summary = make_random_model(options);
    EXPECT_GT(summary.shards, 1);
    EXPECT_LT(summary.bytes, 8 << 20);
    EXPECT_EQ(summary.bytes, 2 * summary.parameters);
    EXPECT_EQ(summary.parameters, random_model_parameters(options));
    EXPECT_FALSE(fs::exists(scratch_ / (preset + ".partial")));

    const fs::path dir = options.out_dir;
    const auto index = nlohmann::json::parse(read_text_file(dir / "model.safetensors.index.json"));
    EXPECT_EQ(index["metadata"]["total_size"], summary.bytes);
    EXPECT_EQ(static_cast<int64_t>(index["weight_map"].size()), summary.tensors);
    const std::string first_shard =
        "model-00001-of-0000" + std::to_string(summary.shards) + ".safetensors";
    EXPECT_EQ(SafetensorsFile::open(dir / first_shard)->metadata().at("format"), "pt");
    EXPECT_EQ(slurp(dir / "tokenizer.json"), slurp(options.tokenizer));
    const TensorStore store = TensorStore::open_dir(dir);
    const std::string moe = "model.layers." + std::to_string(layers - 1) + ".mlp.";
    EXPECT_EQ(store.contains(moe + "gate.e_score_correction_bias"), preset != "deepseek-v2-lite");
    EXPECT_TRUE(store.contains(moe + "experts.15.down_proj.weight"));
    EXPECT_TRUE(store.contains("lm_head.weight"));
    EXPECT_EQ(store.get("model.norm.weight").dtype, DType::kBF16);
    for (float w : to_f32(store.get("model.norm.weight"))) ASSERT_EQ(w, 1.0f);

    const Model model = Model::load(dir);
    EXPECT_EQ(model.parameter_count(), summary.parameters);
    EXPECT_EQ(model.config().num_layers, layers);
    EXPECT_TRUE(model.config().is_moe_layer(layers - 1));
    const std::vector<int32_t> tokens = {0, 17, 300, 5, 511, 42, 42, 9};
    auto cache = model.make_cache(static_cast<int64_t>(tokens.size()));
    std::vector<float> logits(tokens.size() * 512);
    model.forward(tokens, *cache, logits);
    double sum = 0.0, sum_squares = 0.0, largest = 0.0;
    for (float logit : logits) {
      ASSERT_TRUE(std::isfinite(logit));
      sum += logit;
      sum_squares += static_cast<double>(logit) * logit;
      largest = std::max(largest, std::abs(static_cast<double>(logit)));
    }
    const double mean = sum / static_cast<double>(logits.size());
    const double stddev = std::sqrt(sum_squares / static_cast<double>(logits.size()) - mean * mean);
    EXPECT_LT(largest, 100.0);
    EXPECT_GT(stddev, 0.1);  // not a constant
    EXPECT_LT(stddev, 10.0);
  }
}

TEST_F(RandomModel, SameSeedSameBytesWhateverTheThreads) {
  const int threads = omp_get_max_threads();
  const auto files = [](const fs::path& dir) {
    std::map<std::string, std::string> contents;
    for (const auto& entry : fs::directory_iterator(dir)) {
      contents[entry.path().filename().string()] = slurp(entry.path());
    }
    return contents;
  };
  RandomModelOptions options = shrunk("deepseek-v3", 4, "a");
  options.seed = 7;
  options.max_shard_bytes = 1 << 20;
  omp_set_num_threads(1);
  make_random_model(options);
  omp_set_num_threads(std::max(2, threads));
  options.out_dir = scratch_ / "b";
  make_random_model(options);
  options.seed = 8;
  options.out_dir = scratch_ / "c";
  make_random_model(options);
  omp_set_num_threads(threads);

  const auto a = files(scratch_ / "a");
  const auto b = files(scratch_ / "b");
  const auto c = files(scratch_ / "c");
  ASSERT_GT(a.size(), 5u);
  EXPECT_TRUE(a == b);
  ASSERT_EQ(a.size(), c.size());
  EXPECT_EQ(a.at("config.json"), c.at("config.json"));
  EXPECT_EQ(a.at("model.safetensors.index.json"), c.at("model.safetensors.index.json"));
  for (const auto& [name, bytes] : a) {
    if (name.ends_with(".safetensors")) EXPECT_NE(bytes, c.at(name)) << name;
  }

  // A tensor's values depend on the seed and its name only: the 2-layer model is a prefix.
  RandomModelOptions fewer = shrunk("deepseek-v3", 2, "d");
  fewer.seed = 7;
  make_random_model(fewer);
  const TensorStore four = TensorStore::open_dir(scratch_ / "a");
  const TensorStore two = TensorStore::open_dir(scratch_ / "d");
  const TensorView& x = four.get("model.layers.1.self_attn.kv_b_proj.weight");
  const TensorView& y = two.get("model.layers.1.self_attn.kv_b_proj.weight");
  ASSERT_EQ(x.nbytes, y.nbytes);
  EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes), 0);
  // Uniform values of the documented scale: kv_b has std 1/sqrt(kv_lora_rank).
  const std::vector<float> values = to_f32(x);
  double sum_squares = 0.0;
  for (float v : values) sum_squares += static_cast<double>(v) * v;
  EXPECT_NEAR(std::sqrt(sum_squares / static_cast<double>(values.size())), 1.0 / std::sqrt(512.0),
              0.002);
}

TEST_F(RandomModel, BadOptionsAreRefusedWithTheirValues) {
  RandomModelOptions options = shrunk("deepseek-v2-lite", 1, "model");
  options.preset = "deepseek-v4";
  expect_contains(
      error_message<InvalidArgument>([&] { make_random_model(options); }),
      {"unknown preset \"deepseek-v4\"", "deepseek-v2-lite", "moonlight-16b", "deepseek-v3"});
  options.preset = "deepseek-v2-lite";
  for (int64_t layers : {0, -3}) {
    options.layers = layers;
    expect_contains(error_message<InvalidArgument>([&] { make_random_model(options); }),
                    {"layers", ">= 1", "got " + std::to_string(layers)});
  }
  options.layers = 1;
  // V3's groups cannot reach top-8 among 4 experts.
  RandomModelOptions v3 = shrunk("deepseek-v3", 1, "v3");
  v3.overrides.n_routed_experts = 4;
  expect_contains(error_message<InvalidArgument>([&] { random_model_config_json(v3); }),
                  {"preset deepseek-v3", "num_experts_per_tok 8", "n_routed_experts 4"});
  options.overrides.hidden_size = 0;
  expect_contains(error_message<InvalidArgument>([&] { make_random_model(options); }),
                  {"hidden_size", "got 0"});
  options.overrides.hidden_size = 64;

  options.tokenizer = scratch_ / "no-such-tokenizer.json";
  expect_contains(error_message<IoError>([&] { make_random_model(options); }),
                  {"no-such-tokenizer.json"});
  options.tokenizer = testing::bundled_model() / "tokenizer.json";

  // Under a regular file: no directory can be made there.
  std::ofstream(scratch_ / "file") << "x";
  options.out_dir = scratch_ / "file" / "model";
  expect_contains(error_message<IoError>([&] { make_random_model(options); }),
                  {"cannot create output directory", (scratch_ / "file").string()});

  // An existing directory is replaced only with force.
  options.out_dir = scratch_ / "model";
  fs::create_directories(options.out_dir);
  std::ofstream(options.out_dir / "old") << "x";
  expect_contains(error_message<InvalidArgument>([&] { make_random_model(options); }),
                  {options.out_dir.string(), "exists; pass --force"});
  EXPECT_TRUE(fs::exists(options.out_dir / "old"));
  options.force = true;
  make_random_model(options);
  EXPECT_FALSE(fs::exists(options.out_dir / "old"));
  EXPECT_TRUE(fs::exists(options.out_dir / "config.json"));
  EXPECT_FALSE(fs::exists(scratch_ / "model.partial"));
}

TEST_F(RandomModel, StreamingWriterMatchesWriteSafetensors) {
  const std::vector<float> a = {1.0f, -2.0f, 3.5f, 0.25f, 8.0f, -1.0f};
  const std::vector<float> b = {0.5f, 7.0f};
  const std::vector<TensorData> whole = {make_bf16_tensor("a", {2, 3}, a),
                                         make_f32_tensor("b", {2}, b)};
  write_safetensors(scratch_ / "whole.safetensors", whole);
  {
    SafetensorsWriter writer(scratch_ / "streamed.safetensors",
                             {{"a", DType::kBF16, {2, 3}}, {"b", DType::kF32, {2}}});
    EXPECT_EQ(writer.data_bytes(), 12u + 8u);
    const std::span<const std::byte> first(whole[0].bytes);
    writer.append(first.subspan(0, 5));  // pieces need not be whole elements or tensors
    std::vector<std::byte> rest(first.begin() + 5, first.end());
    rest.insert(rest.end(), whole[1].bytes.begin(), whole[1].bytes.end());
    writer.append(rest);
    EXPECT_EQ(writer.written_bytes(), 20u);
    expect_contains(error_message<ShapeError>([&] { writer.append(rest); }),
                    {"streamed.safetensors", "at offset 20", "of 20 bytes"});
    writer.finish();
  }
  EXPECT_EQ(slurp(scratch_ / "whole.safetensors"), slurp(scratch_ / "streamed.safetensors"));
  EXPECT_EQ(to_f32(*SafetensorsFile::open(scratch_ / "streamed.safetensors")->find("a")), a);

  SafetensorsWriter short_file(scratch_ / "short.safetensors", {{"a", DType::kBF16, {2, 3}}});
  short_file.append(std::span<const std::byte>(whole[0].bytes).subspan(0, 4));
  expect_contains(error_message<ShapeError>([&] { short_file.finish(); }),
                  {"short.safetensors", "after 4 of 12 data bytes"});
  expect_contains(error_message<InvalidArgument>([&] {
                    SafetensorsWriter(scratch_ / "dup.safetensors",
                                      {{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}});
                  }),
                  {"\"a\"", "reserved or repeated"});
  expect_contains(
      error_message<IoError>([&] {
        SafetensorsWriter(scratch_ / "no-dir" / "x.safetensors", {{"a", DType::kF32, {1}}});
      }),
      {"cannot create", "no-dir"});
}

class CliMakeRandomModel : public RandomModel {};

TEST_F(CliMakeRandomModel, WritesAModelTheToolsRun) {
  const fs::path out = scratch_ / "v3";
  const std::string shrink =
      " --hidden-size 64 --intermediate-size 128 --moe-intermediate-size 32 --num-heads 2 "
      "--q-lora-rank 32 --num-experts 16 --vocab-size 4096 --max-shard-mb 1";
  const std::string args =
      "make-random-model --preset deepseek-v3 --layers 4 --seed 3 --threads 2 --out '" +
      out.string() + "'" + shrink;
  const testing::CliResult run = testing::run_cli(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.out.find("wrote " + out.string()), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("GB/s"), std::string::npos) << run.out;
  EXPECT_NE(run.err.find("writing MiB"), std::string::npos) << run.err;  // progress
  // The default tokenizer, relative to the working directory.
  EXPECT_EQ(slurp(out / "tokenizer.json"), slurp(testing::bundled_model() / "tokenizer.json"));
  int shards = 0;
  for (const auto& entry : fs::directory_iterator(out)) {
    shards += entry.path().extension() == ".safetensors";
  }
  EXPECT_GT(shards, 1);

  const testing::CliResult info = testing::run_cli("info --json --model '" + out.string() + "'");
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const testing::CliResult generate = testing::run_cli(
      "generate --model '" + out.string() + "' --prompt 'The Debian package' --max-tokens 4");
  ASSERT_EQ(generate.exit_code, 0) << generate.err;

  const testing::CliResult again = testing::run_cli(args);
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.err.find("exists; pass --force"), std::string::npos) << again.err;
  EXPECT_EQ(testing::run_cli(args + " --force").exit_code, 0);

  const testing::CliResult bad_preset =
      testing::run_cli("make-random-model --preset llama --out '" + out.string() + "x'");
  EXPECT_NE(bad_preset.exit_code, 0);
  EXPECT_NE(bad_preset.err.find("unknown preset \"llama\""), std::string::npos) << bad_preset.err;
  const testing::CliResult bad_layers = testing::run_cli(
      "make-random-model --preset moonlight-16b --layers 0 --out '" + out.string() + "x'");
  EXPECT_NE(bad_layers.exit_code, 0);
  EXPECT_NE(bad_layers.err.find("must be >= 1, got 0"), std::string::npos) << bad_layers.err;
  EXPECT_FALSE(fs::exists(out.string() + "x"));

  const testing::CliResult config = testing::run_cli(
      "make-random-model --preset deepseek-v2-lite --layers 3 --config-only --out unused");
  ASSERT_EQ(config.exit_code, 0) << config.err;
  const auto json = nlohmann::json::parse(config.out);
  EXPECT_EQ(json["num_hidden_layers"], 3);
  EXPECT_EQ(json["vocab_size"], 102400);
  EXPECT_FALSE(fs::exists(testing::source_dir() / "unused"));
  // --config-only needs no --out; writing a model does.
  const testing::CliResult no_out_needed =
      testing::run_cli("make-random-model --preset deepseek-v2-lite --layers 3 --config-only");
  ASSERT_EQ(no_out_needed.exit_code, 0) << no_out_needed.err;
  EXPECT_EQ(no_out_needed.out, config.out);
  const testing::CliResult no_out = testing::run_cli("make-random-model --preset deepseek-v2-lite");
  EXPECT_NE(no_out.exit_code, 0);
  EXPECT_NE(no_out.err.find("--out"), std::string::npos) << no_out.err;
}

}  // namespace
}  // namespace quantmla
