// Model hyper-parameters read from a Hugging Face `config.json` (DeepSeek-V2 / V3 families).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace quantmla {

// Rotary embedding settings. Both the classic (`rope_theta` + `rope_scaling`) and the newer
// (`rope_parameters`) spellings of config.json parse into this.
struct RopeConfig {
  double theta = 10000.0;
  bool yarn = false;  // rope_type "yarn"; otherwise plain RoPE
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;            // 0 = absent
  double mscale_all_dim = 0.0;    // 0 = absent
  double attention_factor = 0.0;  // 0 = absent (derived from mscale, as transformers does)
  bool truncate = true;
};

struct ModelConfig {
  std::string model_type;  // "deepseek_v2" | "deepseek_v3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t moe_intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t kv_lora_rank = 0;      // r: width of the cached content latent
  int64_t q_lora_rank = 0;       // 0 = no LoRA on q (q_proj)
  int64_t qk_rope_head_dim = 0;  // d_r: width of the cached RoPE key
  int64_t qk_nope_head_dim = 0;  // d_n
  int64_t v_head_dim = 0;        // d_v
  // Mixture of experts (n_routed_experts == 0: every layer dense).
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = false;
  std::string scoring_func = "softmax";  // "softmax" | "sigmoid"
  std::string topk_method = "greedy";    // "greedy" | "group_limited_greedy" | "noaux_tc"
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 1;
  bool tie_word_embeddings = false;
  // Storage dtype of the checkpoint (`torch_dtype`, or `dtype` in newer configs): "bfloat16",
  // "float16", "float32", or "" when absent.
  std::string torch_dtype;
  RopeConfig rope;
  // The cache spec `quantmla calibrate` recorded under the "quantmla" key ("" when absent), which
  // the tools use when no --cache is given; already checked by CacheFormat::parse.
  std::string quantmla_cache;
  std::string quantmla_json;  // the whole "quantmla" object, serialized ("" when absent)

  // Parses and validates (positive sizes, known model_type, consistent MoE settings). Throws
  // FormatError for malformed JSON, InvalidArgument for unknown model_type or inconsistent values;
  // `source` names the file in messages.
  static ModelConfig from_json(const std::string& json_text, const std::string& source);
  static ModelConfig from_file(const std::filesystem::path& config_json);

  bool is_moe_layer(int64_t layer) const;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Width of one cache row: content latent + RoPE key.
  int64_t cache_row_width() const { return kv_lora_rank + qk_rope_head_dim; }
  // Softmax scale 1/sqrt(d_n + d_r), times YaRN's mscale(factor, mscale_all_dim)^2 when configured.
  double softmax_scale() const;
};

}  // namespace quantmla
