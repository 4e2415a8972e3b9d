// Random-weight checkpoints with the shapes of real DeepSeek-family models (see random_model.h).
#include "quantmla/random_model.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <span>
#include <system_error>

#include "quantmla/config.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

struct Yarn {
  double factor;
  int64_t original_max_position_embeddings;
  double mscale;
  double mscale_all_dim;
  double beta_fast;
  double beta_slow;
};

// The numbers of the released checkpoints' config.json files.
struct Preset {
  const char* name;
  const char* model_type;
  const char* architecture;
  int64_t hidden_size;
  int64_t num_layers;
  int64_t num_heads;
  int64_t q_lora_rank;  // 0: none (q_proj), written as null
  int64_t kv_lora_rank;
  int64_t qk_nope_head_dim;
  int64_t qk_rope_head_dim;
  int64_t v_head_dim;
  int64_t intermediate_size;
  int64_t moe_intermediate_size;
  int64_t n_routed_experts;
  int64_t n_shared_experts;
  int64_t num_experts_per_tok;
  int64_t first_k_dense_replace;
  int64_t n_group;
  int64_t topk_group;
  const char* topk_method;
  const char* scoring_func;
  double routed_scaling_factor;
  bool norm_topk_prob;
  double rope_theta;
  std::optional<Yarn> yarn;
  int64_t max_position_embeddings;
  double rms_norm_eps;
  int64_t vocab_size;
  int64_t bos_token_id;
  int64_t eos_token_id;
};

const Preset kPresets[] = {
    {.name = "deepseek-v2-lite",
     .model_type = "deepseek_v2",
     .architecture = "DeepseekV2ForCausalLM",
     .hidden_size = 2048,
     .num_layers = 27,
     .num_heads = 16,
     .q_lora_rank = 0,
     .kv_lora_rank = 512,
     .qk_nope_head_dim = 128,
     .qk_rope_head_dim = 64,
     .v_head_dim = 128,
     .intermediate_size = 10944,
     .moe_intermediate_size = 1408,
     .n_routed_experts = 64,
     .n_shared_experts = 2,
     .num_experts_per_tok = 6,
     .first_k_dense_replace = 1,
     .n_group = 1,
     .topk_group = 1,
     .topk_method = "greedy",
     .scoring_func = "softmax",
     .routed_scaling_factor = 1.0,
     .norm_topk_prob = false,
     .rope_theta = 10000.0,
     .yarn = Yarn{40.0, 4096, 0.707, 0.707, 32.0, 1.0},
     .max_position_embeddings = 163840,
     .rms_norm_eps = 1e-6,
     .vocab_size = 102400,
     .bos_token_id = 100000,
     .eos_token_id = 100001},
    {.name = "moonlight-16b",
     .model_type = "deepseek_v3",
     .architecture = "DeepseekV3ForCausalLM",
     .hidden_size = 2048,
     .num_layers = 27,
     .num_heads = 16,
     .q_lora_rank = 0,
     .kv_lora_rank = 512,
     .qk_nope_head_dim = 128,
     .qk_rope_head_dim = 64,
     .v_head_dim = 128,
     .intermediate_size = 11264,
     .moe_intermediate_size = 1408,
     .n_routed_experts = 64,
     .n_shared_experts = 2,
     .num_experts_per_tok = 6,
     .first_k_dense_replace = 1,
     .n_group = 1,
     .topk_group = 1,
     .topk_method = "noaux_tc",
     .scoring_func = "sigmoid",
     .routed_scaling_factor = 2.446,
     .norm_topk_prob = true,
     .rope_theta = 50000.0,
     .yarn = std::nullopt,
     .max_position_embeddings = 8192,
     .rms_norm_eps = 1e-5,
     .vocab_size = 163840,
     .bos_token_id = 163584,
     .eos_token_id = 163585},
    {.name = "deepseek-v3",
     .model_type = "deepseek_v3",
     .architecture = "DeepseekV3ForCausalLM",
     .hidden_size = 7168,
     .num_layers = 61,
     .num_heads = 128,
     .q_lora_rank = 1536,
     .kv_lora_rank = 512,
     .qk_nope_head_dim = 128,
     .qk_rope_head_dim = 64,
     .v_head_dim = 128,
     .intermediate_size = 18432,
     .moe_intermediate_size = 2048,
     .n_routed_experts = 256,
     .n_shared_experts = 1,
     .num_experts_per_tok = 8,
     .first_k_dense_replace = 3,
     .n_group = 8,
     .topk_group = 4,
     .topk_method = "noaux_tc",
     .scoring_func = "sigmoid",
     .routed_scaling_factor = 2.5,
     .norm_topk_prob = true,
     .rope_theta = 10000.0,
     .yarn = Yarn{40.0, 4096, 1.0, 1.0, 32.0, 1.0},
     .max_position_embeddings = 163840,
     .rms_norm_eps = 1e-6,
     .vocab_size = 129280,
     .bos_token_id = 0,
     .eos_token_id = 1},
};

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const Preset& preset : kPresets) {
    if (name == preset.name) return preset;
    known += (known.empty() ? "" : ", ") + std::string(preset.name);
  }
  throw InvalidArgument("unknown preset \"" + name + "\" (known: " + known + ")");
}

// The preset with the layer count and the overrides applied.
Preset resolve(const RandomModelOptions& options) {
  Preset preset = find_preset(options.preset);
  if (options.layers) {
    if (*options.layers < 1) {
      throw InvalidArgument("layers (num_hidden_layers) must be >= 1, got " +
                            std::to_string(*options.layers));
    }
    preset.num_layers = *options.layers;
  }
  const RandomModelOverrides& o = options.overrides;
  const auto apply = [](const char* what, const std::optional<int64_t>& value, int64_t& field,
                        int64_t minimum) {
    if (!value) return;
    if (*value < minimum) {
      throw InvalidArgument(std::string("override ") + what + " must be >= " +
                            std::to_string(minimum) + ", got " + std::to_string(*value));
    }
    field = *value;
  };
  apply("hidden_size", o.hidden_size, preset.hidden_size, 1);
  apply("intermediate_size", o.intermediate_size, preset.intermediate_size, 1);
  apply("moe_intermediate_size", o.moe_intermediate_size, preset.moe_intermediate_size, 1);
  apply("num_heads", o.num_heads, preset.num_heads, 1);
  apply("q_lora_rank", o.q_lora_rank, preset.q_lora_rank, 0);
  apply("n_routed_experts", o.n_routed_experts, preset.n_routed_experts, 1);
  apply("num_experts_per_tok", o.num_experts_per_tok, preset.num_experts_per_tok, 1);
  apply("vocab_size", o.vocab_size, preset.vocab_size, 2);
  if (preset.bos_token_id >= preset.vocab_size || preset.eos_token_id >= preset.vocab_size) {
    preset.bos_token_id = 0;
    preset.eos_token_id = 1;
  }
  return preset;
}

ordered_json config_json(const Preset& p) {
  ordered_json rope_scaling = nullptr;
  if (p.yarn) {
    // The released checkpoints spell the type "type" (transformers reads it as rope_type).
    rope_scaling = {{"beta_fast", p.yarn->beta_fast},
                    {"beta_slow", p.yarn->beta_slow},
                    {"factor", p.yarn->factor},
                    {"mscale", p.yarn->mscale},
                    {"mscale_all_dim", p.yarn->mscale_all_dim},
                    {"original_max_position_embeddings", p.yarn->original_max_position_embeddings},
                    {"type", "yarn"}};
  }
  return {{"architectures", {p.architecture}},
          {"model_type", p.model_type},
          {"hidden_size", p.hidden_size},
          {"intermediate_size", p.intermediate_size},
          {"moe_intermediate_size", p.moe_intermediate_size},
          {"num_hidden_layers", p.num_layers},
          {"num_attention_heads", p.num_heads},
          {"num_key_value_heads", p.num_heads},
          {"q_lora_rank", p.q_lora_rank > 0 ? ordered_json(p.q_lora_rank) : ordered_json(nullptr)},
          {"kv_lora_rank", p.kv_lora_rank},
          {"qk_nope_head_dim", p.qk_nope_head_dim},
          {"qk_rope_head_dim", p.qk_rope_head_dim},
          {"v_head_dim", p.v_head_dim},
          {"n_routed_experts", p.n_routed_experts},
          {"n_shared_experts", p.n_shared_experts},
          {"num_experts_per_tok", p.num_experts_per_tok},
          {"first_k_dense_replace", p.first_k_dense_replace},
          {"moe_layer_freq", 1},
          {"topk_method", p.topk_method},
          {"scoring_func", p.scoring_func},
          {"n_group", p.n_group},
          {"topk_group", p.topk_group},
          {"norm_topk_prob", p.norm_topk_prob},
          {"routed_scaling_factor", p.routed_scaling_factor},
          {"hidden_act", "silu"},
          {"rope_theta", p.rope_theta},
          {"rope_scaling", rope_scaling},
          {"rms_norm_eps", p.rms_norm_eps},
          {"vocab_size", p.vocab_size},
          {"max_position_embeddings", p.max_position_embeddings},
          {"bos_token_id", p.bos_token_id},
          {"eos_token_id", p.eos_token_id},
          {"attention_bias", false},
          {"attention_dropout", 0.0},
          {"initializer_range", 0.02},
          {"use_cache", true},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

// ---- The tensors and their initialization ----
//
// Every weight is uniform in [-a, a] (a = sqrt(3) * std), norms are exactly 1. The scales keep the
// residual stream O(1) through any number of layers and the logits O(1):
// - embed_tokens: std 1, so the residual starts at RMS 1 (RMSNorm makes the scale of the stream
//   irrelevant to each block's input, but the blocks' additions are measured against it);
// - projections out of an RMSNorm'd (or RMS 1) input: std 1/sqrt(fan_in), outputs of RMS ~1 (q,
//   k, gate, up, the q/kv LoRA ranks, lm_head: logits ~N(0, 1), max over 100K ~4.5);
// - projections into the residual stream (o_proj, down_proj of MLPs and experts): std
//   1/sqrt(fan_in) / sqrt(2 * num_layers), so the 2L additions sum to a variance of about 1;
// - router (gate): std 1/sqrt(hidden), scores ~N(0, 1) that spread tokens over the experts;
// - e_score_correction_bias: uniform in [-0.01, 0.01], small beside sigmoid scores.
struct PlannedTensor {
  std::string name;
  std::vector<int64_t> shape;
  float half_width = 0.0f;  // 0: every element is 1 (norm weights)
  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t extent : shape) n *= static_cast<uint64_t>(extent);
    return n;
  }
  uint64_t bytes() const { return numel() * sizeof(uint16_t); }
};

float uniform_half_width(double std) { return static_cast<float>(std::sqrt(3.0) * std); }

// The tensors weights.cpp loads for `config`, in its order (a model of fewer layers is a prefix).
std::vector<PlannedTensor> plan_tensors(const ModelConfig& config) {
  std::vector<PlannedTensor> tensors;
  const double residual = 1.0 / std::sqrt(2.0 * static_cast<double>(config.num_layers));
  const auto linear = [&](const std::string& name, int64_t out, int64_t in, double gain = 1.0) {
    tensors.push_back({name + ".weight",
                       {out, in},
                       uniform_half_width(gain / std::sqrt(static_cast<double>(in)))});
  };
  const auto norm = [&](const std::string& name, int64_t size) {
    tensors.push_back({name + ".weight", {size}, 0.0f});
  };
  const auto mlp = [&](const std::string& prefix, int64_t hidden, int64_t intermediate) {
    linear(prefix + ".gate_proj", intermediate, hidden);
    linear(prefix + ".up_proj", intermediate, hidden);
    linear(prefix + ".down_proj", hidden, intermediate, residual);
  };
  const int64_t hidden = config.hidden_size;
  const int64_t heads = config.num_heads;
  tensors.push_back(
      {"model.embed_tokens.weight", {config.vocab_size, hidden}, uniform_half_width(1.0)});
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    norm(prefix + "input_layernorm", hidden);
    norm(prefix + "post_attention_layernorm", hidden);
    const std::string attention = prefix + "self_attn.";
    if (config.q_lora_rank > 0) {
      linear(attention + "q_a_proj", config.q_lora_rank, hidden);
      norm(attention + "q_a_layernorm", config.q_lora_rank);
      linear(attention + "q_b_proj", heads * config.qk_head_dim(), config.q_lora_rank);
    } else {
      linear(attention + "q_proj", heads * config.qk_head_dim(), hidden);
    }
    linear(attention + "kv_a_proj_with_mqa", config.cache_row_width(), hidden);
    norm(attention + "kv_a_layernorm", config.kv_lora_rank);
    linear(attention + "kv_b_proj", heads * (config.qk_nope_head_dim + config.v_head_dim),
           config.kv_lora_rank);
    linear(attention + "o_proj", hidden, heads * config.v_head_dim, residual);
    if (config.is_moe_layer(l)) {
      const std::string moe = prefix + "mlp.";
      linear(moe + "gate", config.n_routed_experts, hidden);
      if (config.topk_method == "noaux_tc") {
        tensors.push_back({moe + "gate.e_score_correction_bias", {config.n_routed_experts}, 0.01f});
      }
      for (int64_t e = 0; e < config.n_routed_experts; ++e) {
        mlp(moe + "experts." + std::to_string(e), hidden, config.moe_intermediate_size);
      }
      if (config.n_shared_experts > 0) {
        mlp(moe + "shared_experts", hidden, config.n_shared_experts * config.moe_intermediate_size);
      }
    } else {
      mlp(prefix + "mlp", hidden, config.intermediate_size);
    }
  }
  norm("model.norm", hidden);
  linear("lm_head", config.vocab_size, hidden);
  return tensors;
}

// ---- Counter-based generation ----

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The stream of one tensor: a function of the seed and the tensor's name (not its position), so a
// tensor has the same values in a model of any layer count.
uint64_t tensor_key(uint64_t seed, const std::string& name) {
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return splitmix64(splitmix64(seed) ^ hash);
}

// A bijective 32-bit mixer (Wellons' lowbias32): a few multiplies that vectorize (8 per AVX2 op).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// BF16 of a finite float, rounded to nearest even (f32_to_bf16 without its NaN branch).
inline uint16_t finite_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Integer operations and one float multiply (no contraction possible), so the AVX2 build of the
// loop gives the bits of the generic one.
inline void fill_body(uint16_t* data, int64_t count, uint32_t low, uint32_t k0, uint32_t k1,
                      float scale) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = mix32(mix32((low + static_cast<uint32_t>(i)) ^ k0) + k1);
    data[i] = finite_to_bf16(static_cast<float>(static_cast<int32_t>(bits)) * scale);
  }
}
void fill_generic(uint16_t* data, int64_t count, uint32_t low, uint32_t k0, uint32_t k1,
                  float scale) {
  fill_body(data, count, low, k0, k1, scale);
}
// 8 elements per instruction (vpmulld); about 7x the SSE2 build.
__attribute__((target("avx2"))) void fill_avx2(uint16_t* data, int64_t count, uint32_t low,
                                               uint32_t k0, uint32_t k1, float scale) {
  fill_body(data, count, low, k0, k1, scale);
}

// Elements [begin, begin + out.size()) of a tensor, as BF16 bits: element e is
//   mix32(mix32(low32(e) ^ k0) + k1), read as a signed 32-bit number scaled to [-1, 1),
// with (k0, k1) the halves of splitmix64(key + high32(e)). A piece never straddles a multiple of
// 2^32 elements, so each has one (k0, k1).
void generate(const PlannedTensor& tensor, uint64_t key, uint64_t begin, std::span<uint16_t> out) {
  const int64_t n = static_cast<int64_t>(out.size());
  if (tensor.half_width == 0.0f) {
    std::fill(out.begin(), out.end(), f32_to_bf16(1.0f));
    return;
  }
  const uint64_t keys = splitmix64(key + (begin >> 32));
  const auto k0 = static_cast<uint32_t>(keys);
  const auto k1 = static_cast<uint32_t>(keys >> 32);
  const auto low = static_cast<uint32_t>(begin);
  const float scale = tensor.half_width * 0x1p-31f;
  uint16_t* data = out.data();
  static const bool avx2 = __builtin_cpu_supports("avx2");
  constexpr int64_t kBlock = 1 << 14;
  // One core is left to the writer thread: on 2 cores a second generator only spins against it
  // while waiting for the write (measured: 2.2 GB/s with one generator, 0.4-0.8 GB/s with two).
  const int threads = std::max(1, omp_get_max_threads() - 1);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t block = 0; block < (n + kBlock - 1) / kBlock; ++block) {
    const int64_t first = block * kBlock;
    const int64_t count = std::min(n, first + kBlock) - first;
    (avx2 ? fill_avx2 : fill_generic)(data + first, count, low + static_cast<uint32_t>(first), k0,
                                      k1, scale);
  }
}

// ---- The output directory ----

fs::path without_trailing_separator(const fs::path& path) {
  fs::path normal = path.lexically_normal();
  if (!normal.has_filename() && normal.has_parent_path()) normal = normal.parent_path();
  return normal;
}

void check_io(const std::error_code& error, const std::string& what) {
  if (error) throw IoError(what + ": " + error.message());
}

void write_text_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError("cannot create " + path.string() + ": " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) throw IoError("cannot write " + path.string());
}

std::string shard_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

// Consecutive runs of tensors, each within max_bytes unless one tensor alone is larger.
std::vector<std::vector<size_t>> split_shards(const std::vector<PlannedTensor>& tensors,
                                              uint64_t max_bytes) {
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (shards.empty() || shard_bytes + tensors[i].bytes() > max_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += tensors[i].bytes();
  }
  return shards;
}

// Generates and writes every shard. Generation (all threads) of one piece overlaps the write of
// the previous one (a second thread), through two buffers.
void write_weights(const std::vector<PlannedTensor>& tensors, const fs::path& dir,
                   const RandomModelOptions& options, RandomModelSummary& summary) {
  // 8 MiB of BF16; a power of two, so no piece straddles a multiple of 2^32 elements.
  constexpr uint64_t kPieceElements = uint64_t{1} << 22;
  const auto shards = split_shards(tensors, static_cast<uint64_t>(options.max_shard_bytes));
  uint64_t total_bytes = 0;
  for (const PlannedTensor& tensor : tensors) total_bytes += tensor.bytes();

  std::vector<uint16_t> buffers[2] = {std::vector<uint16_t>(kPieceElements),
                                      std::vector<uint16_t>(kPieceElements)};
  std::future<void> pending;  // declared after the buffers: destroyed (joined) before them
  int current = 0;
  uint64_t bytes_done = 0;
  int64_t tensors_done = 0;
  const auto wait_pending = [&] {
    if (pending.valid()) pending.get();
  };

  ordered_json weight_map = ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_name(s, shards.size());
    std::vector<TensorSpec> specs;
    for (size_t i : shards[s]) {
      specs.push_back({tensors[i].name, DType::kBF16, tensors[i].shape});
      weight_map[tensors[i].name] = name;
    }
    SafetensorsWriter writer(dir / name, std::move(specs));
    // On an exception, the write in flight must end before the writer does.
    struct JoinPending {
      std::future<void>& future;
      ~JoinPending() {
        if (future.valid()) future.wait();
      }
    } join{pending};
    for (size_t i : shards[s]) {
      const PlannedTensor& tensor = tensors[i];
      const uint64_t key = tensor_key(options.seed, tensor.name);
      const uint64_t numel = tensor.numel();
      for (uint64_t begin = 0; begin < numel; begin += kPieceElements) {
        const uint64_t count = std::min(kPieceElements, numel - begin);
        std::span<uint16_t> piece(buffers[current].data(), count);
        generate(tensor, key, begin, piece);
        wait_pending();
        // The previous piece is on disk: report it.
        if (options.progress && bytes_done > 0) {
          options.progress(static_cast<int64_t>(bytes_done), static_cast<int64_t>(total_bytes),
                           tensors_done, static_cast<int64_t>(tensors.size()));
        }
        pending = std::async(std::launch::async,
                             [&writer, piece] { writer.append(std::as_bytes(piece)); });
        current ^= 1;
        bytes_done += count * sizeof(uint16_t);
        if (begin + count == numel) ++tensors_done;
      }
      if (numel == 0) ++tensors_done;
    }
    wait_pending();
    writer.finish();
  }
  if (options.progress) {
    options.progress(static_cast<int64_t>(bytes_done), static_cast<int64_t>(total_bytes),
                     tensors_done, static_cast<int64_t>(tensors.size()));
  }
  const ordered_json index = {{"metadata", {{"total_size", total_bytes}}},
                              {"weight_map", std::move(weight_map)}};
  write_text_file(dir / "model.safetensors.index.json", index.dump(2) + "\n");
  summary.bytes = static_cast<int64_t>(total_bytes);
  summary.shards = static_cast<int64_t>(shards.size());
}

void copy_tokenizer(const fs::path& tokenizer, const fs::path& dir) {
  std::error_code error;
  fs::copy_file(tokenizer, dir / "tokenizer.json", error);
  check_io(error, "cannot copy " + tokenizer.string() + " to " + (dir / "tokenizer.json").string());
  const fs::path config = tokenizer.parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(config)) {
    fs::copy_file(config, dir / "tokenizer_config.json", error);
    check_io(error, "cannot copy " + config.string());
  } else {
    write_text_file(dir / "tokenizer_config.json",
                    ordered_json({{"tokenizer_class", "PreTrainedTokenizerFast"}}).dump(2) + "\n");
  }
}

}  // namespace

std::vector<std::string> random_model_presets() {
  std::vector<std::string> names;
  for (const Preset& preset : kPresets) names.emplace_back(preset.name);
  return names;
}

std::string random_model_config_json(const RandomModelOptions& options) {
  const std::string text = config_json(resolve(options)).dump(2) + "\n";
  // What the engine will read, checked now rather than after the weights are written.
  ModelConfig::from_json(text, "preset " + options.preset);
  return text;
}

int64_t random_model_parameters(const RandomModelOptions& options) {
  const std::string text = random_model_config_json(options);
  int64_t parameters = 0;
  for (const PlannedTensor& tensor :
       plan_tensors(ModelConfig::from_json(text, "preset " + options.preset))) {
    parameters += static_cast<int64_t>(tensor.numel());
  }
  return parameters;
}

RandomModelSummary make_random_model(const RandomModelOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const std::string config_text = random_model_config_json(options);
  const ModelConfig config = ModelConfig::from_json(config_text, "preset " + options.preset);
  if (options.max_shard_bytes <= 0) {
    throw InvalidArgument("max_shard_bytes must be positive, got " +
                          std::to_string(options.max_shard_bytes));
  }
  if (options.out_dir.empty()) throw InvalidArgument("no output directory given");
  if (!fs::is_regular_file(options.tokenizer)) {
    throw IoError("tokenizer " + options.tokenizer.string() + " is not a file");
  }
  const fs::path out = without_trailing_separator(options.out_dir);
  fs::path partial = out;
  partial += ".partial";
  std::error_code error;
  // --force on ".", "..", or a directory holding the working directory would delete the caller's
  // files (the checkout): never.
  const fs::path cwd = fs::current_path(error);
  const fs::path target = fs::weakly_canonical(fs::absolute(out), error);
  if (!error && !cwd.empty()) {
    const auto [t, c] = std::mismatch(target.begin(), target.end(), cwd.begin(), cwd.end());
    if (t == target.end()) {
      throw InvalidArgument("output directory " + out.string() +
                            " is or contains the working directory");
    }
  }
  if (fs::exists(out) && !options.force) {
    throw InvalidArgument("output directory " + out.string() +
                          " exists; pass --force to replace it");
  }

  const std::vector<PlannedTensor> tensors = plan_tensors(config);
  RandomModelSummary summary;
  summary.tensors = static_cast<int64_t>(tensors.size());
  for (const PlannedTensor& tensor : tensors) {
    summary.parameters += static_cast<int64_t>(tensor.numel());
  }

  if (fs::exists(partial, error)) {  // a leftover of an interrupted run: the name is ours
    fs::remove_all(partial, error);
    check_io(error, "cannot remove " + partial.string());
  }
  fs::create_directories(partial, error);
  check_io(error, "cannot create output directory " + partial.string());
  try {
    write_text_file(partial / "config.json", config_text);
    write_weights(tensors, partial, options, summary);
    copy_tokenizer(options.tokenizer, partial);
    if (fs::exists(out)) {
      fs::remove_all(out, error);
      check_io(error, "cannot remove " + out.string());
    }
    fs::rename(partial, out, error);
    check_io(error, "cannot rename " + partial.string() + " to " + out.string());
  } catch (...) {
    fs::remove_all(partial, error);
    throw;
  }
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return summary;
}

}  // namespace quantmla
