#include "model/weights.h"

#include <cstring>
#include <string>

namespace quantmla {
namespace {

class WeightReader {
 public:
  WeightReader(const TensorStore& store, int64_t& parameter_count)
      : store_(store), parameter_count_(parameter_count) {}

  std::vector<float> vector(const std::string& name, int64_t size) { return read(name, {size}); }

  Linear linear(const std::string& name, int64_t out, int64_t in) {
    const TensorView& view = store_.get(name + ".weight", {out, in});
    Linear linear{to_f32(view), {}, out, in};
    if (view.dtype == DType::kBF16) {
      linear.weight_bf16.resize(static_cast<size_t>(view.numel()));
      std::memcpy(linear.weight_bf16.data(), view.data, view.nbytes);
    }
    parameter_count_ += view.numel();
    return linear;
  }

  Mlp mlp(const std::string& prefix, int64_t hidden, int64_t intermediate) {
    return Mlp{linear(prefix + ".gate_proj", intermediate, hidden),
               linear(prefix + ".up_proj", intermediate, hidden),
               linear(prefix + ".down_proj", hidden, intermediate)};
  }

 private:
  std::vector<float> read(const std::string& name, std::initializer_list<int64_t> shape) {
    std::vector<float> values = to_f32(store_.get(name, shape));
    parameter_count_ += static_cast<int64_t>(values.size());
    return values;
  }

  const TensorStore& store_;
  int64_t& parameter_count_;
};

AttentionWeights load_attention(const ModelConfig& config, WeightReader& reader,
                                const std::string& prefix) {
  const int64_t hidden = config.hidden_size;
  const int64_t heads = config.num_heads;
  AttentionWeights attention;
  if (config.q_lora_rank > 0) {
    attention.q_a = reader.linear(prefix + "q_a_proj", config.q_lora_rank, hidden);
    attention.q_a_norm = reader.vector(prefix + "q_a_layernorm.weight", config.q_lora_rank);
    attention.q_b =
        reader.linear(prefix + "q_b_proj", heads * config.qk_head_dim(), config.q_lora_rank);
  } else {
    attention.q = reader.linear(prefix + "q_proj", heads * config.qk_head_dim(), hidden);
  }
  attention.kv_a = reader.linear(prefix + "kv_a_proj_with_mqa", config.cache_row_width(), hidden);
  attention.kv_a_norm = reader.vector(prefix + "kv_a_layernorm.weight", config.kv_lora_rank);
  attention.kv_b =
      reader.linear(prefix + "kv_b_proj", heads * (config.qk_nope_head_dim + config.v_head_dim),
                    config.kv_lora_rank);
  attention.o = reader.linear(prefix + "o_proj", hidden, heads * config.v_head_dim);
  return attention;
}

Moe load_moe(const ModelConfig& config, WeightReader& reader, const std::string& prefix) {
  Moe moe;
  moe.router = reader.linear(prefix + "gate", config.n_routed_experts, config.hidden_size);
  if (config.topk_method == "noaux_tc") {
    moe.correction_bias =
        reader.vector(prefix + "gate.e_score_correction_bias", config.n_routed_experts);
  }
  for (int64_t e = 0; e < config.n_routed_experts; ++e) {
    moe.experts.push_back(reader.mlp(prefix + "experts." + std::to_string(e), config.hidden_size,
                                     config.moe_intermediate_size));
  }
  if (config.n_shared_experts > 0) {
    moe.has_shared = true;
    moe.shared = reader.mlp(prefix + "shared_experts", config.hidden_size,
                            config.n_shared_experts * config.moe_intermediate_size);
  }
  return moe;
}

}  // namespace

ModelWeights load_weights(const ModelConfig& config, const TensorStore& store) {
  ModelWeights weights;
  WeightReader reader(store, weights.parameter_count);
  weights.embed = reader.linear("model.embed_tokens", config.vocab_size, config.hidden_size).weight;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    DecoderLayer layer;
    layer.input_norm = reader.vector(prefix + "input_layernorm.weight", config.hidden_size);
    layer.post_attention_norm =
        reader.vector(prefix + "post_attention_layernorm.weight", config.hidden_size);
    layer.attention = load_attention(config, reader, prefix + "self_attn.");
    layer.is_moe = config.is_moe_layer(l);
    if (layer.is_moe) {
      layer.moe = load_moe(config, reader, prefix + "mlp.");
    } else {
      layer.mlp = reader.mlp(prefix + "mlp", config.hidden_size, config.intermediate_size);
    }
    weights.layers.push_back(std::move(layer));
  }
  weights.final_norm = reader.vector("model.norm.weight", config.hidden_size);
  weights.rope.emplace(config);
  if (config.tie_word_embeddings && !store.contains("lm_head.weight")) {
    weights.lm_head = Linear{weights.embed, {}, config.vocab_size, config.hidden_size};
  } else {
    weights.lm_head = reader.linear("lm_head", config.vocab_size, config.hidden_size);
  }
  return weights;
}

}  // namespace quantmla
