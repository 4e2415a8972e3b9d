// Parsing and validation of DeepSeek-V2/V3 `config.json` files.
#include "quantmla/config.h"

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include "quantmla/cache_format.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

using nlohmann::json;

// Typed access to one JSON object of a config file. A key holding null counts as absent, the way
// transformers treats `"q_lora_rank": null`.
class ConfigReader {
 public:
  ConfigReader(const json& object, std::string source, std::string prefix = "")
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  bool has(std::string_view key) const {
    const auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }
  // Written out as null, as opposed to left out.
  bool is_null(std::string_view key) const {
    const auto it = object_.find(key);
    return it != object_.end() && it->is_null();
  }
  void require(std::string_view key) const {
    if (!has(key)) {
      throw FormatError(source_ + ": missing key \"" + prefix_ + std::string(key) + "\"");
    }
  }

  int64_t required_int(std::string_view key) const {
    require(key);
    return int_value(key);
  }
  int64_t optional_int(std::string_view key, int64_t fallback) const {
    return has(key) ? int_value(key) : fallback;
  }
  double optional_double(std::string_view key, double fallback) const {
    if (!has(key)) return fallback;
    const json& value = at(key);
    if (!value.is_number()) throw type_error(key, "a number");
    return value.get<double>();
  }
  bool optional_bool(std::string_view key, bool fallback) const {
    if (!has(key)) return fallback;
    const json& value = at(key);
    if (!value.is_boolean()) throw type_error(key, "true or false");
    return value.get<bool>();
  }
  std::string required_string(std::string_view key) const {
    require(key);
    return string_value(key);
  }
  std::optional<std::string> optional_string(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return string_value(key);
  }
  // Token ids may be a list (several end-of-sequence tokens); the first one is the primary.
  int64_t optional_token_id(std::string_view key, int64_t fallback) const {
    if (has(key) && at(key).is_array() && !at(key).empty()) {
      const json& first = at(key).front();
      if (!first.is_number_integer()) throw type_error(key, "an integer or a list of integers");
      return first.get<int64_t>();
    }
    return optional_int(key, fallback);
  }
  // A nested object such as `rope_scaling`; nullopt when absent or null.
  std::optional<ConfigReader> optional_object(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    if (!at(key).is_object()) throw type_error(key, "an object or null");
    return ConfigReader(at(key), source_, prefix_ + std::string(key) + ".");
  }

  const std::string& source() const { return source_; }

 private:
  const json& at(std::string_view key) const { return *object_.find(key); }

  int64_t int_value(std::string_view key) const {
    const json& value = at(key);
    if (!value.is_number_integer()) throw type_error(key, "an integer");
    return value.get<int64_t>();
  }
  std::string string_value(std::string_view key) const {
    const json& value = at(key);
    if (!value.is_string()) throw type_error(key, "a string");
    return value.get<std::string>();
  }
  FormatError type_error(std::string_view key, std::string_view expected) const {
    return FormatError(source_ + ": key \"" + prefix_ + std::string(key) + "\" is " +
                       at(key).dump() + ", expected " + std::string(expected));
  }

  const json& object_;
  std::string source_;
  std::string prefix_;
};

// The values transformers' DeepseekV2Config / DeepseekV3Config use when a key is absent.
struct FamilyDefaults {
  int64_t moe_intermediate_size;
  int64_t q_lora_rank;
  int64_t n_routed_experts;
  int64_t n_shared_experts;
  int64_t num_experts_per_tok;
  int64_t n_group;
  int64_t topk_group;
  int64_t first_k_dense_replace;
  double routed_scaling_factor;
  bool norm_topk_prob;
  const char* scoring_func;
  const char* topk_method;
  int64_t max_position_embeddings;
  int64_t bos_token_id;
  int64_t eos_token_id;
};

constexpr FamilyDefaults kDeepseekV2Defaults = {
    .moe_intermediate_size = 1407,
    .q_lora_rank = 1536,
    .n_routed_experts = 0,  // None: a dense model
    .n_shared_experts = 0,
    .num_experts_per_tok = 0,
    .n_group = 1,
    .topk_group = 1,
    .first_k_dense_replace = 0,
    .routed_scaling_factor = 1.0,
    .norm_topk_prob = false,
    .scoring_func = "softmax",
    .topk_method = "greedy",
    .max_position_embeddings = 2048,
    .bos_token_id = 100000,
    .eos_token_id = 100001,
};

constexpr FamilyDefaults kDeepseekV3Defaults = {
    .moe_intermediate_size = 2048,
    .q_lora_rank = 1536,
    .n_routed_experts = 256,
    .n_shared_experts = 1,
    .num_experts_per_tok = 8,
    .n_group = 8,
    .topk_group = 4,
    .first_k_dense_replace = 3,
    .routed_scaling_factor = 2.5,
    .norm_topk_prob = true,
    .scoring_func = "sigmoid",
    .topk_method = "noaux_tc",
    .max_position_embeddings = 4096,
    .bos_token_id = 0,
    .eos_token_id = 1,
};

// Reads the YaRN / plain RoPE settings from one rope_scaling or rope_parameters object.
void read_rope_object(const ConfigReader& rope_object, bool type_required, RopeConfig& rope) {
  std::optional<std::string> type = rope_object.optional_string("rope_type");
  if (!type) type = rope_object.optional_string("type");
  if (!type) {
    if (type_required) rope_object.require("rope_type");  // absent, so this throws
    type = "default";
  }
  if (*type != "default" && *type != "yarn") {
    throw InvalidArgument(rope_object.source() + ": unsupported rope_type \"" + *type +
                          "\" (supported: default, yarn)");
  }
  rope.theta = rope_object.optional_double("rope_theta", rope.theta);
  rope.yarn = *type == "yarn";
  if (!rope.yarn) return;
  rope.factor = rope_object.optional_double("factor", rope.factor);
  rope.original_max_position_embeddings = rope_object.optional_int(
      "original_max_position_embeddings", rope.original_max_position_embeddings);
  rope.beta_fast = rope_object.optional_double("beta_fast", rope.beta_fast);
  rope.beta_slow = rope_object.optional_double("beta_slow", rope.beta_slow);
  rope.mscale = rope_object.optional_double("mscale", rope.mscale);
  rope.mscale_all_dim = rope_object.optional_double("mscale_all_dim", rope.mscale_all_dim);
  rope.attention_factor = rope_object.optional_double("attention_factor", rope.attention_factor);
  rope.truncate = rope_object.optional_bool("truncate", rope.truncate);
}

RopeConfig read_rope(const ConfigReader& config, int64_t max_position_embeddings) {
  RopeConfig rope;
  // DeepSeek checkpoints rotate interleaved pairs (2i, 2i + 1); transformers names that layout
  // rope_interleave: true. The half-split layout would pass every shape check and silently
  // misplace every RoPE dimension (and every calibrated pair), so it is refused.
  if (!config.optional_bool("rope_interleave", true)) {
    throw InvalidArgument(config.source() +
                          ": rope_interleave is false (half-split RoPE layout); quantmla runs and "
                          "calibrates only DeepSeek's interleaved pairs (2i, 2i+1)");
  }
  rope.theta = config.optional_double("rope_theta", rope.theta);
  // Newer transformers write `rope_parameters` (with rope_theta inside); older ones `rope_scaling`.
  if (const auto parameters = config.optional_object("rope_parameters")) {
    read_rope_object(*parameters, /*type_required=*/false, rope);
  } else if (const auto scaling = config.optional_object("rope_scaling")) {
    read_rope_object(*scaling, /*type_required=*/true, rope);
  }
  // transformers falls back to max_position_embeddings when the pre-extension length is absent.
  if (rope.yarn && rope.original_max_position_embeddings == 0) {
    rope.original_max_position_embeddings = max_position_embeddings;
  }
  return rope;
}

// The "quantmla" object that `quantmla calibrate` writes. A spec the tools could not run is
// refused here, where the file can be named, rather than when a tool first parses it.
void read_quantmla(const json& root, const ConfigReader& reader, ModelConfig& config) {
  const auto quantmla = reader.optional_object("quantmla");
  if (!quantmla) return;
  config.quantmla_json = root.at("quantmla").dump();
  const std::optional<std::string> cache = quantmla->optional_string("cache");
  if (!cache) return;
  try {
    CacheFormat::parse(*cache);
  } catch (const InvalidArgument& error) {
    throw FormatError(reader.source() + ": key \"quantmla.cache\" is \"" + *cache +
                      "\", not a cache format: " + error.what());
  }
  config.quantmla_cache = *cache;
}

template <typename Number>
void require_positive(const std::string& source, std::string_view key, Number value) {
  if (!(value > 0)) {
    std::ostringstream message;
    message << source << ": " << key << " must be positive, got " << value;
    throw InvalidArgument(message.str());
  }
}

void require_non_negative(const std::string& source, std::string_view key, int64_t value) {
  if (value < 0) {
    throw InvalidArgument(source + ": " + std::string(key) + " must not be negative, got " +
                          std::to_string(value));
  }
}

void require_one_of(const std::string& source, std::string_view key, const std::string& value,
                    std::initializer_list<std::string_view> allowed) {
  std::string allowed_text;
  for (std::string_view option : allowed) {
    if (option == value) return;
    allowed_text += (allowed_text.empty() ? "" : ", ") + std::string(option);
  }
  throw InvalidArgument(source + ": unknown " + std::string(key) + " \"" + value +
                        "\" (supported: " + allowed_text + ")");
}

void validate_moe(const ModelConfig& config, const std::string& source) {
  const auto fail = [&](const std::string& what) { throw InvalidArgument(source + ": " + what); };
  require_positive(source, "moe_intermediate_size", config.moe_intermediate_size);
  require_non_negative(source, "n_shared_experts", config.n_shared_experts);
  require_non_negative(source, "first_k_dense_replace", config.first_k_dense_replace);
  require_positive(source, "moe_layer_freq", config.moe_layer_freq);
  require_positive(source, "n_group", config.n_group);
  require_positive(source, "topk_group", config.topk_group);
  require_positive(source, "num_experts_per_tok", config.num_experts_per_tok);
  require_positive(source, "routed_scaling_factor", config.routed_scaling_factor);
  if (config.num_experts_per_tok > config.n_routed_experts) {
    fail("num_experts_per_tok " + std::to_string(config.num_experts_per_tok) +
         " exceeds n_routed_experts " + std::to_string(config.n_routed_experts));
  }
  if (config.n_routed_experts % config.n_group != 0) {
    fail("n_routed_experts " + std::to_string(config.n_routed_experts) +
         " is not divisible by n_group " + std::to_string(config.n_group));
  }
  if (config.topk_group > config.n_group) {
    fail("topk_group " + std::to_string(config.topk_group) + " exceeds n_group " +
         std::to_string(config.n_group));
  }
  // Group-limited routing picks experts only from the topk_group best groups.
  const int64_t reachable = config.topk_group * (config.n_routed_experts / config.n_group);
  if (config.topk_method != "greedy" && config.num_experts_per_tok > reachable) {
    fail("num_experts_per_tok " + std::to_string(config.num_experts_per_tok) + " exceeds the " +
         std::to_string(reachable) + " experts in topk_group " + std::to_string(config.topk_group) +
         " of n_group " + std::to_string(config.n_group) + " groups");
  }
}

void validate(const ModelConfig& config, const std::string& source) {
  require_positive(source, "vocab_size", config.vocab_size);
  require_positive(source, "hidden_size", config.hidden_size);
  require_positive(source, "intermediate_size", config.intermediate_size);
  require_positive(source, "num_hidden_layers", config.num_layers);
  require_positive(source, "num_attention_heads", config.num_heads);
  require_positive(source, "kv_lora_rank", config.kv_lora_rank);
  require_positive(source, "qk_rope_head_dim", config.qk_rope_head_dim);
  require_positive(source, "qk_nope_head_dim", config.qk_nope_head_dim);
  require_positive(source, "v_head_dim", config.v_head_dim);
  require_positive(source, "max_position_embeddings", config.max_position_embeddings);
  require_positive(source, "rms_norm_eps", config.rms_norm_eps);
  require_non_negative(source, "q_lora_rank", config.q_lora_rank);
  require_non_negative(source, "n_routed_experts", config.n_routed_experts);
  if (config.qk_rope_head_dim % 2 != 0) {
    // RoPE rotates pairs of dimensions.
    throw InvalidArgument(source + ": qk_rope_head_dim must be even, got " +
                          std::to_string(config.qk_rope_head_dim));
  }
  if (!config.torch_dtype.empty()) {
    require_one_of(source, "torch_dtype", config.torch_dtype, {"bfloat16", "float16", "float32"});
  }
  require_one_of(source, "scoring_func", config.scoring_func, {"softmax", "sigmoid"});
  require_one_of(source, "topk_method", config.topk_method,
                 {"greedy", "group_limited_greedy", "noaux_tc"});
  if (config.n_routed_experts > 0) validate_moe(config, source);

  require_positive(source, "rope_theta", config.rope.theta);
  if (config.rope.yarn) {
    require_positive(source, "rope factor", config.rope.factor);
    require_positive(source, "rope original_max_position_embeddings",
                     config.rope.original_max_position_embeddings);
  }
}

}  // namespace

ModelConfig ModelConfig::from_json(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& error) {  // parse errors, numbers beyond a double
    throw FormatError(source + ": not valid JSON: " + error.what());
  }
  if (!root.is_object()) {
    throw FormatError(source + ": top level is a JSON " + std::string(root.type_name()) +
                      ", expected an object");
  }
  const ConfigReader reader(root, source);

  ModelConfig config;
  config.model_type = reader.required_string("model_type");
  const FamilyDefaults* defaults = nullptr;
  if (config.model_type == "deepseek_v2") {
    defaults = &kDeepseekV2Defaults;
  } else if (config.model_type == "deepseek_v3") {
    defaults = &kDeepseekV3Defaults;
  } else {
    throw InvalidArgument(source + ": unknown model_type \"" + config.model_type +
                          "\" (supported: deepseek_v2, deepseek_v3)");
  }

  config.vocab_size = reader.required_int("vocab_size");
  config.hidden_size = reader.required_int("hidden_size");
  config.intermediate_size = reader.required_int("intermediate_size");
  config.num_layers = reader.required_int("num_hidden_layers");
  config.num_heads = reader.required_int("num_attention_heads");
  config.kv_lora_rank = reader.required_int("kv_lora_rank");
  config.qk_rope_head_dim = reader.required_int("qk_rope_head_dim");
  config.qk_nope_head_dim = reader.required_int("qk_nope_head_dim");
  config.v_head_dim = reader.required_int("v_head_dim");
  // null means "no q LoRA"; a missing key takes transformers' default rank.
  config.q_lora_rank =
      reader.is_null("q_lora_rank") ? 0 : reader.optional_int("q_lora_rank", defaults->q_lora_rank);

  config.moe_intermediate_size =
      reader.optional_int("moe_intermediate_size", defaults->moe_intermediate_size);
  config.n_routed_experts = reader.optional_int("n_routed_experts", defaults->n_routed_experts);
  config.n_shared_experts = reader.optional_int("n_shared_experts", defaults->n_shared_experts);
  config.num_experts_per_tok =
      reader.optional_int("num_experts_per_tok", defaults->num_experts_per_tok);
  // null groups mean ungrouped routing: one group holding every expert.
  config.n_group =
      reader.is_null("n_group") ? 1 : reader.optional_int("n_group", defaults->n_group);
  config.topk_group =
      reader.is_null("topk_group") ? 1 : reader.optional_int("topk_group", defaults->topk_group);
  config.first_k_dense_replace =
      reader.optional_int("first_k_dense_replace", defaults->first_k_dense_replace);
  config.moe_layer_freq = reader.optional_int("moe_layer_freq", 1);
  config.routed_scaling_factor =
      reader.optional_double("routed_scaling_factor", defaults->routed_scaling_factor);
  config.norm_topk_prob = reader.optional_bool("norm_topk_prob", defaults->norm_topk_prob);
  config.scoring_func = reader.optional_string("scoring_func").value_or(defaults->scoring_func);
  config.topk_method = reader.optional_string("topk_method").value_or(defaults->topk_method);

  config.rms_norm_eps = reader.optional_double("rms_norm_eps", 1e-6);
  config.max_position_embeddings =
      reader.optional_int("max_position_embeddings", defaults->max_position_embeddings);
  config.bos_token_id = reader.optional_token_id("bos_token_id", defaults->bos_token_id);
  config.eos_token_id = reader.optional_token_id("eos_token_id", defaults->eos_token_id);
  config.tie_word_embeddings = reader.optional_bool("tie_word_embeddings", false);
  // Newer transformers renamed `torch_dtype` to `dtype`.
  config.torch_dtype =
      reader.optional_string("dtype").value_or(reader.optional_string("torch_dtype").value_or(""));
  config.rope = read_rope(reader, config.max_position_embeddings);
  read_quantmla(root, reader, config);

  validate(config, source);
  return config;
}

ModelConfig ModelConfig::from_file(const std::filesystem::path& config_json) {
  std::ifstream in(config_json, std::ios::binary);
  if (!in) throw IoError("cannot open " + config_json.string());
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) throw IoError("cannot read " + config_json.string());
  return from_json(text.str(), config_json.string());
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

double ModelConfig::softmax_scale() const {
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  // YaRN stretches attention logits; DeepseekV3Attention compensates with mscale squared.
  if (rope.yarn && rope.mscale_all_dim != 0 && rope.factor > 1) {
    const double mscale = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= mscale * mscale;
  }
  return scale;
}

}  // namespace quantmla
