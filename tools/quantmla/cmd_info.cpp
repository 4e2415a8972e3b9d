#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "quantmla/model.h"

namespace quantmla::cli {
namespace {

struct InfoOptions {
  std::string model = kDefaultModel;
  std::string cache;
  bool json = false;
};

void run_info(const InfoOptions& options) {
  const Model model = Model::load(options.model);
  const ModelConfig& c = model.config();
  const int64_t row = c.cache_row_width();
  const int64_t bf16_per_layer = row * 2;
  const int64_t f32_per_layer = row * 4;
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) moe_layers += c.is_moe_layer(l) ? 1 : 0;

  nlohmann::json info = {
      {"model", options.model},
      {"model_type", c.model_type},
      {"parameters", model.parameter_count()},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_layers", c.num_layers},
      {"moe_layers", moe_layers},
      {"num_heads", c.num_heads},
      {"q_lora_rank", c.q_lora_rank},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"n_routed_experts", c.n_routed_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"rope", c.rope.yarn ? "yarn" : "default"},
      {"rope_theta", c.rope.theta},
      {"max_position_embeddings", c.max_position_embeddings},
      {"softmax_scale", c.softmax_scale()},
      {"cache_values_per_token_per_layer", row},
      {"cache_bytes_per_token_per_layer", {{"bf16", bf16_per_layer}, {"f32", f32_per_layer}}},
      {"cache_bytes_per_token",
       {{"bf16", bf16_per_layer * c.num_layers}, {"f32", f32_per_layer * c.num_layers}}},
  };
  if (!options.cache.empty()) {
    const CacheFormat format = CacheFormat::parse(options.cache);
    const CacheShape shape = model.cache_shape();
    const int64_t physical = cache_physical_bytes(shape, format, kLongSequence);
    const int64_t physical_bf16 =
        cache_physical_bytes(shape, CacheFormat::parse("bf16"), kLongSequence);
    info["cache"] = {
        {"format", format.to_string()},
        {"bytes_per_token_per_layer", format.record_bytes(shape.kv_lora_rank, shape.rope_dim)},
        {"content_bytes_per_token_per_layer", format.content.encoded_bytes(shape.kv_lora_rank)},
        {"rope_bytes_per_token_per_layer", format.rope.encoded_bytes(shape.rope_dim)},
        {"tokens", kLongSequence},
        {"physical_bytes", physical},
        {"compression_vs_bf16", static_cast<double>(physical_bf16) / physical},
    };
  }
  if (options.json) {
    std::printf("%s\n", info.dump(2).c_str());
    return;
  }
  std::printf("model            %s\n", options.model.c_str());
  std::printf("architecture     %s, %lld layers (%lld MoE), hidden %lld, vocab %lld\n",
              c.model_type.c_str(), static_cast<long long>(c.num_layers),
              static_cast<long long>(moe_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.vocab_size));
  std::printf("parameters       %lld (%.1fM)\n", static_cast<long long>(model.parameter_count()),
              model.parameter_count() / 1e6);
  std::printf(
      "attention        MLA, %lld heads, q_lora_rank %lld, kv_lora_rank %lld, "
      "nope %lld + rope %lld, v %lld\n",
      static_cast<long long>(c.num_heads), static_cast<long long>(c.q_lora_rank),
      static_cast<long long>(c.kv_lora_rank), static_cast<long long>(c.qk_nope_head_dim),
      static_cast<long long>(c.qk_rope_head_dim), static_cast<long long>(c.v_head_dim));
  if (moe_layers > 0) {
    std::printf("experts          %lld routed (top-%lld, %s, %s) + %lld shared\n",
                static_cast<long long>(c.n_routed_experts),
                static_cast<long long>(c.num_experts_per_tok), c.scoring_func.c_str(),
                c.topk_method.c_str(), static_cast<long long>(c.n_shared_experts));
  }
  std::printf("rope             %s, theta %g, max positions %lld, softmax scale %.6f\n",
              c.rope.yarn ? "yarn" : "default", c.rope.theta,
              static_cast<long long>(c.max_position_embeddings), c.softmax_scale());
  std::printf(
      "cache per token  %lld values per layer: bf16 %lld B/layer (%lld B all layers), "
      "f32 %lld B/layer (%lld B all layers)\n",
      static_cast<long long>(row), static_cast<long long>(bf16_per_layer),
      static_cast<long long>(bf16_per_layer * c.num_layers), static_cast<long long>(f32_per_layer),
      static_cast<long long>(f32_per_layer * c.num_layers));
  if (info.contains("cache")) {
    const nlohmann::json& cache = info["cache"];
    std::printf("cache format     %s: %lld B/token/layer (content %lld + rope %lld)\n",
                cache["format"].get<std::string>().c_str(),
                cache["bytes_per_token_per_layer"].get<long long>(),
                cache["content_bytes_per_token_per_layer"].get<long long>(),
                cache["rope_bytes_per_token_per_layer"].get<long long>());
    std::printf(
        "128K tokens      %.1f MiB in pages of %lld tokens with block table, %.2fx smaller "
        "than bf16\n",
        cache["physical_bytes"].get<double>() / (1 << 20), static_cast<long long>(kPageTokens),
        cache["compression_vs_bf16"].get<double>());
  }
}

}  // namespace

void add_info(CLI::App& app) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand("info", "Architecture summary, parameters, cache bytes/token");
  cmd->add_option("--model", options->model, "Model directory")->capture_default_str();
  cmd->add_option("--cache", options->cache,
                  "Also size this cache format, e.g. content=int4:g64,rope=int4:g64");
  cmd->add_flag("--json", options->json, "Print one JSON object");
  cmd->callback([options] { run_info(*options); });
}

}  // namespace quantmla::cli
