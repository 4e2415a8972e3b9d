#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "error_matchers.h"
#include "quantmla/config.h"
#include "quantmla/error.h"
#include "test_paths.h"

namespace quantmla {
namespace {

using nlohmann::json;

using testing::error_message;
using testing::expect_contains;

// The smallest config that parses: every required key, nothing else.
json minimal_config(const std::string& model_type) {
  return {{"model_type", model_type}, {"vocab_size", 64},       {"hidden_size", 32},
          {"intermediate_size", 48},  {"num_hidden_layers", 2}, {"num_attention_heads", 2},
          {"kv_lora_rank", 16},       {"qk_rope_head_dim", 8},  {"qk_nope_head_dim", 8},
          {"v_head_dim", 8}};
}

ModelConfig parse(const json& config) { return ModelConfig::from_json(config.dump(), "test.json"); }

TEST(Config, ParsesClassicDenseConfig) {
  const auto path = testing::shared_dir() / "models" / "mla-tiny" / "config.json";
  const ModelConfig config = ModelConfig::from_file(path);
  EXPECT_EQ(config.model_type, "deepseek_v3");
  EXPECT_EQ(config.vocab_size, 4096);
  EXPECT_EQ(config.hidden_size, 512);
  EXPECT_EQ(config.intermediate_size, 1408);
  EXPECT_EQ(config.moe_intermediate_size, 256);
  EXPECT_EQ(config.num_layers, 6);
  EXPECT_EQ(config.num_heads, 8);
  EXPECT_EQ(config.kv_lora_rank, 512);
  EXPECT_EQ(config.q_lora_rank, 256);
  EXPECT_EQ(config.qk_rope_head_dim, 64);
  EXPECT_EQ(config.qk_nope_head_dim, 64);
  EXPECT_EQ(config.v_head_dim, 64);
  EXPECT_EQ(config.qk_head_dim(), 128);
  EXPECT_EQ(config.cache_row_width(), 576);
  EXPECT_EQ(config.n_routed_experts, 8);
  EXPECT_EQ(config.first_k_dense_replace, 6);
  EXPECT_EQ(config.routed_scaling_factor, 1.0);
  EXPECT_EQ(config.scoring_func, "sigmoid");
  EXPECT_EQ(config.topk_method, "noaux_tc");
  EXPECT_EQ(config.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-6);
  EXPECT_FALSE(config.tie_word_embeddings);
  EXPECT_EQ(config.torch_dtype, "bfloat16");
  EXPECT_EQ(config.rope.theta, 10000.0);
  EXPECT_FALSE(config.rope.yarn);
  // first_k_dense_replace equals the layer count: no layer routes.
  for (int64_t layer = 0; layer < config.num_layers; ++layer)
    EXPECT_FALSE(config.is_moe_layer(layer));
  EXPECT_DOUBLE_EQ(config.softmax_scale(), 1.0 / std::sqrt(128.0));
}

TEST(Config, ParsesRopeParametersMoeConfig) {
  const auto path = testing::shared_dir() / "models" / "mla-tiny-moe" / "config.json";
  const ModelConfig config = ModelConfig::from_file(path);
  EXPECT_EQ(config.model_type, "deepseek_v3");
  EXPECT_EQ(config.hidden_size, 128);
  EXPECT_EQ(config.num_layers, 3);
  EXPECT_EQ(config.num_heads, 4);
  EXPECT_EQ(config.kv_lora_rank, 64);
  EXPECT_EQ(config.q_lora_rank, 48);
  EXPECT_EQ(config.qk_rope_head_dim, 32);
  EXPECT_EQ(config.qk_nope_head_dim, 32);
  EXPECT_EQ(config.v_head_dim, 32);
  EXPECT_EQ(config.moe_intermediate_size, 64);
  EXPECT_EQ(config.n_routed_experts, 8);
  EXPECT_EQ(config.n_shared_experts, 1);
  EXPECT_EQ(config.num_experts_per_tok, 2);
  EXPECT_EQ(config.n_group, 4);
  EXPECT_EQ(config.topk_group, 2);
  EXPECT_EQ(config.first_k_dense_replace, 1);
  EXPECT_EQ(config.moe_layer_freq, 1);
  EXPECT_EQ(config.routed_scaling_factor, 2.5);
  EXPECT_TRUE(config.norm_topk_prob);
  EXPECT_EQ(config.torch_dtype, "float32");  // spelled `dtype` in this newer file
  // Absent from this file: the DeepSeek-V3 defaults apply.
  EXPECT_EQ(config.scoring_func, "sigmoid");
  EXPECT_EQ(config.topk_method, "noaux_tc");
  EXPECT_FALSE(config.is_moe_layer(0));
  EXPECT_TRUE(config.is_moe_layer(1));
  EXPECT_TRUE(config.is_moe_layer(2));

  EXPECT_TRUE(config.rope.yarn);
  EXPECT_EQ(config.rope.theta, 10000.0);
  EXPECT_EQ(config.rope.factor, 4.0);
  EXPECT_EQ(config.rope.original_max_position_embeddings, 128);
  EXPECT_EQ(config.rope.beta_fast, 32.0);
  EXPECT_EQ(config.rope.beta_slow, 1.0);
  EXPECT_EQ(config.rope.mscale, 1.0);
  EXPECT_EQ(config.rope.mscale_all_dim, 1.0);
  EXPECT_EQ(config.rope.attention_factor, 0.0);
  EXPECT_TRUE(config.rope.truncate);

  const double mscale = 0.1 * 1.0 * std::log(4.0) + 1.0;
  EXPECT_DOUBLE_EQ(config.softmax_scale(), mscale * mscale / std::sqrt(64.0));
  EXPECT_NEAR(config.softmax_scale(), 0.162059, 1e-6);
}

TEST(Config, ParsesDeepseekV2Config) {
  const auto path = testing::shared_dir() / "models" / "mla-tiny-v2-4k" / "config.json";
  const ModelConfig config = ModelConfig::from_file(path);
  EXPECT_EQ(config.model_type, "deepseek_v2");
  EXPECT_EQ(config.q_lora_rank, 0);  // null: plain q_proj
  EXPECT_EQ(config.n_group, 1);      // null: ungrouped routing
  EXPECT_EQ(config.topk_group, 1);
  EXPECT_EQ(config.topk_method, "greedy");
  EXPECT_EQ(config.scoring_func, "softmax");
  EXPECT_FALSE(config.norm_topk_prob);
  EXPECT_EQ(config.n_routed_experts, 8);
  EXPECT_EQ(config.num_experts_per_tok, 2);
  EXPECT_EQ(config.kv_lora_rank, 512);
  EXPECT_EQ(config.max_position_embeddings, 4096);
  EXPECT_FALSE(config.rope.yarn);
}

TEST(Config, FamilyDefaultsForMissingKeys) {
  json v2 = minimal_config("deepseek_v2");
  const ModelConfig dense_v2 = parse(v2);
  EXPECT_EQ(dense_v2.n_routed_experts, 0);  // DeepseekV2Config: n_routed_experts None
  EXPECT_FALSE(dense_v2.is_moe_layer(1));
  EXPECT_EQ(dense_v2.scoring_func, "softmax");
  EXPECT_EQ(dense_v2.routed_scaling_factor, 1.0);
  EXPECT_FALSE(dense_v2.norm_topk_prob);
  EXPECT_EQ(dense_v2.q_lora_rank, 1536);
  EXPECT_DOUBLE_EQ(dense_v2.rms_norm_eps, 1e-6);
  EXPECT_EQ(dense_v2.torch_dtype, "");

  json v3 = minimal_config("deepseek_v3");
  v3["n_routed_experts"] = 16;
  v3["num_experts_per_tok"] = 2;
  v3["n_group"] = 4;
  v3["topk_group"] = 2;
  const ModelConfig moe_v3 = parse(v3);
  EXPECT_EQ(moe_v3.scoring_func, "sigmoid");
  EXPECT_EQ(moe_v3.topk_method, "noaux_tc");
  EXPECT_EQ(moe_v3.routed_scaling_factor, 2.5);
  EXPECT_TRUE(moe_v3.norm_topk_prob);
  EXPECT_EQ(moe_v3.moe_layer_freq, 1);
  EXPECT_EQ(moe_v3.first_k_dense_replace, 3);
  EXPECT_EQ(moe_v3.eos_token_id, 1);
}

TEST(Config, MoeLayerFrequency) {
  json v2 = minimal_config("deepseek_v2");
  v2["num_hidden_layers"] = 8;
  v2["n_routed_experts"] = 4;
  v2["num_experts_per_tok"] = 2;
  v2["first_k_dense_replace"] = 1;
  v2["moe_layer_freq"] = 2;
  const ModelConfig config = parse(v2);
  EXPECT_FALSE(config.is_moe_layer(0));
  EXPECT_FALSE(config.is_moe_layer(1));
  EXPECT_TRUE(config.is_moe_layer(2));
  EXPECT_FALSE(config.is_moe_layer(3));
  EXPECT_TRUE(config.is_moe_layer(4));
}

TEST(Config, ClassicYarnRopeScaling) {
  json config = minimal_config("deepseek_v3");
  config["n_routed_experts"] = 0;
  config["rope_theta"] = 50000.0;
  config["max_position_embeddings"] = 4096;
  config["rope_scaling"] = {{"type", "yarn"},
                            {"factor", 40},
                            {"beta_fast", 16},
                            {"beta_slow", 2},
                            {"mscale", 0.707},
                            {"mscale_all_dim", 0.707},
                            {"original_max_position_embeddings", 1024}};
  const ModelConfig parsed = parse(config);
  EXPECT_TRUE(parsed.rope.yarn);
  EXPECT_EQ(parsed.rope.theta, 50000.0);
  EXPECT_EQ(parsed.rope.factor, 40.0);
  EXPECT_EQ(parsed.rope.beta_fast, 16.0);
  EXPECT_EQ(parsed.rope.beta_slow, 2.0);
  EXPECT_EQ(parsed.rope.mscale, 0.707);
  EXPECT_EQ(parsed.rope.original_max_position_embeddings, 1024);
  const double mscale = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(parsed.softmax_scale(), mscale * mscale / std::sqrt(16.0));

  // "rope_type" is the newer spelling of the same key; a missing pre-extension length falls back
  // to max_position_embeddings, and mscale_all_dim absent leaves the scale alone.
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  const ModelConfig without_mscale = parse(config);
  EXPECT_TRUE(without_mscale.rope.yarn);
  EXPECT_EQ(without_mscale.rope.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(without_mscale.softmax_scale(), 1.0 / std::sqrt(16.0));
}

TEST(Config, UnknownModelType) {
  json config = minimal_config("llama");
  expect_contains(
      error_message<InvalidArgument>([&] { parse(config); }),
      {"test.json: unknown model_type \"llama\" (supported: deepseek_v2, deepseek_v3)"});
}

TEST(Config, MissingKey) {
  for (const char* key : {"model_type", "hidden_size", "kv_lora_rank", "qk_rope_head_dim"}) {
    json config = minimal_config("deepseek_v3");
    config.erase(key);
    expect_contains(error_message<FormatError>([&] { parse(config); }),
                    {"test.json", std::string("missing key \"") + key + "\""});
  }
  json null_size = minimal_config("deepseek_v3");
  null_size["vocab_size"] = nullptr;
  expect_contains(error_message<FormatError>([&] { parse(null_size); }),
                  {"missing key \"vocab_size\""});
}

TEST(Config, MissingFileIsIoError) {
  expect_contains(
      error_message<IoError>([] { ModelConfig::from_file("/nonexistent/config.json"); }),
      {"/nonexistent/config.json"});
}

TEST(Config, WrongValueType) {
  json config = minimal_config("deepseek_v3");
  config["hidden_size"] = "512";
  expect_contains(error_message<FormatError>([&] { parse(config); }),
                  {"test.json", "hidden_size", "\"512\"", "integer"});
}

TEST(Config, BadRopeType) {
  json config = minimal_config("deepseek_v3");
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_contains(error_message<InvalidArgument>([&] { parse(config); }),
                  {"test.json", "\"linear\"", "default, yarn"});

  config.erase("rope_scaling");
  config["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 10000.0}};
  expect_contains(error_message<InvalidArgument>([&] { parse(config); }), {"\"dynamic\""});

  config.erase("rope_parameters");
  config["rope_scaling"] = {{"factor", 2.0}};
  expect_contains(error_message<FormatError>([&] { parse(config); }),
                  {"missing key \"rope_scaling.rope_type\""});
}

TEST(Config, MalformedJson) {
  expect_contains(error_message<FormatError>([] {
                    ModelConfig::from_json(R"({"model_type": "deepseek_v3",)", "cfg.json");
                  }),
                  {"cfg.json", "not valid JSON"});
  expect_contains(error_message<FormatError>([] { ModelConfig::from_json("[1]", "cfg.json"); }),
                  {"cfg.json", "array"});
  // A number beyond a double is nlohmann's out_of_range, not a parse_error (found by fuzzing).
  expect_contains(error_message<FormatError>(
                      [] { ModelConfig::from_json(R"({"hidden_size": 1e999})", "cfg.json"); }),
                  {"cfg.json", "not valid JSON", "number overflow"});
}

TEST(Config, RejectsInconsistentValues) {
  const auto expect_invalid = [](json config, std::initializer_list<std::string> parts) {
    expect_contains(error_message<InvalidArgument>([&] { parse(config); }), parts);
  };
  json base = minimal_config("deepseek_v3");
  base["n_routed_experts"] = 8;
  base["num_experts_per_tok"] = 2;
  base["n_group"] = 4;
  base["topk_group"] = 2;
  EXPECT_NO_THROW(parse(base));

  json odd_rope = base;
  odd_rope["qk_rope_head_dim"] = 7;
  expect_invalid(odd_rope, {"qk_rope_head_dim", "even", "7"});

  json zero_hidden = base;
  zero_hidden["hidden_size"] = 0;
  expect_invalid(zero_hidden, {"hidden_size", "positive", "0"});

  json indivisible = base;
  indivisible["n_group"] = 3;
  indivisible["topk_group"] = 1;
  expect_invalid(indivisible, {"n_routed_experts 8", "n_group 3"});

  json topk_group = base;
  topk_group["topk_group"] = 5;
  expect_invalid(topk_group, {"topk_group 5", "n_group 4"});

  json too_many = base;
  too_many["num_experts_per_tok"] = 9;
  expect_invalid(too_many, {"num_experts_per_tok 9", "n_routed_experts 8"});

  json unreachable = base;
  unreachable["num_experts_per_tok"] = 5;  // two groups of two experts hold only 4
  expect_invalid(unreachable, {"num_experts_per_tok 5", "4 experts"});

  json scoring = base;
  scoring["scoring_func"] = "relu";
  expect_invalid(scoring, {"scoring_func", "\"relu\""});

  json method = base;
  method["topk_method"] = "random";
  expect_invalid(method, {"topk_method", "\"random\""});

  json dtype = base;
  dtype["torch_dtype"] = "int8";
  expect_invalid(dtype, {"torch_dtype", "\"int8\""});

  json negative_q = base;
  negative_q["q_lora_rank"] = -1;
  expect_invalid(negative_q, {"q_lora_rank", "-1"});
}

// The cache spec `quantmla calibrate` records, read back for the tools' default.
TEST(Config, ReadsRecordedCacheSpec) {
  EXPECT_EQ(parse(minimal_config("deepseek_v3")).quantmla_cache, "");
  EXPECT_EQ(parse(minimal_config("deepseek_v3")).quantmla_json, "");
  json config = minimal_config("deepseek_v3");
  config["quantmla"] = {{"cache", "content=int4:g64,rope=int4:g64"}, {"version", 1}};
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.quantmla_cache, "content=int4:g64,rope=int4:g64");
  EXPECT_EQ(json::parse(parsed.quantmla_json), config["quantmla"]);
  config["quantmla"] = json::object();
  EXPECT_EQ(parse(config).quantmla_cache, "");
}

TEST(Config, RejectsBadRecordedCacheSpec) {
  json config = minimal_config("deepseek_v3");
  config["quantmla"] = {{"cache", "content=int9"}};
  expect_contains(error_message<FormatError>([&] { parse(config); }),
                  {"test.json", "quantmla.cache", "content=int9"});
  config["quantmla"] = {{"cache", 4}};
  expect_contains(error_message<FormatError>([&] { parse(config); }),
                  {"test.json", "quantmla.cache", "4", "a string"});
  config["quantmla"] = "content=int4:g64";
  expect_contains(error_message<FormatError>([&] { parse(config); }),
                  {"test.json", "quantmla", "an object"});
}

}  // namespace
}  // namespace quantmla
