// FP32 weights of a DeepSeek-V2/V3 model as the CPU engine runs them (internal).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/rope.h"
#include "quantmla/config.h"
#include "quantmla/safetensors.h"

namespace quantmla {

// Row-major [out, in]: y = W x. BF16 checkpoints also keep their original bits, which single-row
// (decode) products read at half the bytes of FP32; multi-row products use the FP32 copy in GEMMs.
struct Linear {
  std::vector<float> weight;
  std::vector<uint16_t> weight_bf16;  // empty unless the checkpoint stores this tensor in BF16
  int64_t out = 0;
  int64_t in = 0;
};

struct Mlp {
  Linear gate, up, down;
};

struct Moe {
  Linear router;                       // [n_routed_experts, hidden]
  std::vector<float> correction_bias;  // [n_routed_experts]; V3 noaux_tc only
  std::vector<Mlp> experts;
  Mlp shared;  // n_shared_experts * moe_intermediate_size wide; absent when n_shared_experts == 0
  bool has_shared = false;
};

struct AttentionWeights {
  Linear q_a;                    // q_lora_rank > 0
  std::vector<float> q_a_norm;   // q_lora_rank > 0
  Linear q_b;                    // q_lora_rank > 0: [H * qk_head_dim, q_lora_rank]
  Linear q;                      // q_lora_rank == 0: [H * qk_head_dim, hidden]
  Linear kv_a;                   // [kv_lora_rank + rope_dim, hidden]
  std::vector<float> kv_a_norm;  // [kv_lora_rank]
  Linear kv_b;                   // per head: W_UK_h [d_n, r] rows, then W_UV_h [d_v, r] rows
  Linear o;                      // [hidden, H * d_v]
};

struct DecoderLayer {
  std::vector<float> input_norm;
  std::vector<float> post_attention_norm;
  AttentionWeights attention;
  bool is_moe = false;
  Mlp mlp;  // dense layers
  Moe moe;  // MoE layers
};

struct ModelWeights {
  std::vector<float> embed;  // [vocab, hidden]
  std::vector<DecoderLayer> layers;
  std::vector<float> final_norm;
  Linear lm_head;
  std::optional<Rope> rope;  // frequencies depend only on the config: built once at load
  int64_t parameter_count = 0;
};

// Reads every tensor the config implies, checking its shape; extra tensors (e.g. multi-token
// prediction layers) are ignored.
ModelWeights load_weights(const ModelConfig& config, const TensorStore& store);

}  // namespace quantmla
