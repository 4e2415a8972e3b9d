// Random-weight Hugging Face checkpoints with the shapes of real DeepSeek-family models, for
// benchmarks and tests at scale: `quantmla make-random-model`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace quantmla {

// Shrinks a preset (for tests): each value set replaces the preset's. The MLA head dimensions
// (kv_lora_rank, qk_nope/rope_head_dim, v_head_dim) are always the preset's. A vocabulary too small
// for the preset's bos/eos ids gets bos 0 and eos 1 (the bundled tokenizer's).
struct RandomModelOverrides {
  std::optional<int64_t> hidden_size;
  std::optional<int64_t> intermediate_size;
  std::optional<int64_t> moe_intermediate_size;
  std::optional<int64_t> num_heads;         // num_attention_heads (and num_key_value_heads)
  std::optional<int64_t> q_lora_rank;       // 0 = no q LoRA (q_proj)
  std::optional<int64_t> n_routed_experts;  // groups and top-k stay the preset's
  std::optional<int64_t> num_experts_per_tok;
  std::optional<int64_t> vocab_size;
};

struct RandomModelOptions {
  std::string preset;             // one of random_model_presets()
  std::filesystem::path out_dir;  // written as out_dir.partial, renamed when complete
  std::optional<int64_t> layers;  // num_hidden_layers (>= 1); unset = the preset's
  uint64_t seed = 0;
  // Copied as out_dir/tokenizer.json (its sibling tokenizer_config.json too, when there is one).
  std::filesystem::path tokenizer = "models/mla-tiny/tokenizer.json";
  bool force = false;  // replace an existing out_dir (at the end)
  int64_t max_shard_bytes = int64_t{4} << 30;
  RandomModelOverrides overrides;
  // Called after every piece of data written: (bytes done, bytes total, tensors done, total).
  std::function<void(int64_t, int64_t, int64_t, int64_t)> progress;
};

struct RandomModelSummary {
  int64_t tensors = 0;
  int64_t parameters = 0;
  int64_t bytes = 0;  // tensor data (BF16), the index's total_size
  int64_t shards = 0;
  double seconds = 0.0;
};

// The preset names: "deepseek-v2-lite", "moonlight-16b", "deepseek-v3".
std::vector<std::string> random_model_presets();

// The config.json (2-space indented JSON text) that make_random_model writes for these options:
// the preset's numbers with the layer count and overrides applied, checked by
// ModelConfig::from_json. Throws InvalidArgument for an unknown preset (listing the known ones),
// layers < 1 or an override that leaves an invalid config.
std::string random_model_config_json(const RandomModelOptions& options);

// The number of parameters (tensor elements) make_random_model would write for these options.
int64_t random_model_parameters(const RandomModelOptions& options);

// Writes the checkpoint: config.json, every tensor the engine loads for that config (BF16, in
// shards model-0000i-of-0000N.safetensors of at most max_shard_bytes unless one tensor alone is
// larger, split at tensor boundaries) with model.safetensors.index.json, and the tokenizer. The
// weights are generated and written a piece at a time (never the whole model in memory), in
// parallel, and are a function of (seed, tensor name, element index) only: the same seed gives
// byte-identical files whatever the thread count. Throws InvalidArgument (options, an existing
// out_dir without force), IoError (the tokenizer, the output directory).
RandomModelSummary make_random_model(const RandomModelOptions& options);

}  // namespace quantmla
