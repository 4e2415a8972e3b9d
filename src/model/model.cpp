#include "quantmla/model.h"

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cpu/gemv_bf16.h"
#include "kernels/cpu/ops.h"
#include "model/moe_router.h"
#include "model/rope.h"
#include "model/weights.h"
#include "quantmla/error.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

using cpu::matmul_nn;
using cpu::matmul_nt;

// y[m, out] (+)= x[m, in] W^T, with leading dimensions; one row takes the BF16 GEMV when it can.
void linear(const Linear& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
            bool accumulate = false) {
  if (m == 1 && !w.weight_bf16.empty()) {
    cpu::gemv_bf16(w.weight_bf16.data(), w.in, x, y, w.out, w.in, accumulate);
  } else {
    matmul_nt(x, ldx, w.weight.data(), w.in, y, ldy, m, w.out, w.in, accumulate);
  }
}

// Queries of a block at least this long (prefill) take the expanded form of MLA attention.
constexpr int64_t kExpandedMinQueries = 64;
constexpr int64_t kExpandedQueryBlock = 256;

// Prefill attention in the expanded form: the cache rows are read back (the values attention sees,
// quantized formats included), up-projected once (K_nope = C W_UK^T, V = C W_UV^T), then every
// head attends over [k_nope ; k_pe] with values V. The same function as the absorbed form that
// decoding uses, at (qk_dim + v_dim) multiply-adds per key and head instead of
// (kv_lora_rank + rope) + kv_lora_rank: about a fifth for DeepSeek's shapes.
// q: [n, heads, qk_dim] with RoPE applied to the q_pe part; out: [n, heads, v_dim].
void expanded_attention(const MlaCache& cache, int64_t layer, const Linear& kv_b, const float* q,
                        int64_t n, int64_t pos0, int64_t heads, int64_t nope, int64_t rope_dim,
                        int64_t v_dim, float softmax_scale, float* out) {
  const int64_t rank = kv_b.in;
  const int64_t keys = pos0 + n;
  const int64_t qk_dim = nope + rope_dim;
  const int64_t up_width = heads * (nope + v_dim);
  std::vector<float> latents(static_cast<size_t>(keys * rank));
  std::vector<float> rope_keys(static_cast<size_t>(keys * rope_dim));
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < keys; ++j) {
    cache.read_row(layer, j, latents.data() + j * rank, rope_keys.data() + j * rope_dim);
  }
  std::vector<float> up(static_cast<size_t>(keys * up_width));
  matmul_nt(latents.data(), rank, kv_b.weight.data(), rank, up.data(), up_width, keys, up_width,
            rank);
  std::vector<float> head_keys(static_cast<size_t>(keys * qk_dim));
  std::vector<float> scores;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const float* head_up = up.data() + hd * (nope + v_dim);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < keys; ++j) {
      std::copy_n(head_up + j * up_width, nope, head_keys.data() + j * qk_dim);
      std::copy_n(rope_keys.data() + j * rope_dim, rope_dim, head_keys.data() + j * qk_dim + nope);
    }
    for (int64_t begin = 0; begin < n; begin += kExpandedQueryBlock) {
      const int64_t rows = std::min(kExpandedQueryBlock, n - begin);
      const int64_t visible = pos0 + begin + rows;  // keys the block's last query sees
      scores.resize(static_cast<size_t>(rows * visible));
      matmul_nt(q + (begin * heads + hd) * qk_dim, heads * qk_dim, head_keys.data(), qk_dim,
                scores.data(), visible, rows, visible, qk_dim);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        cpu::softmax_row(scores.data() + r * visible, pos0 + begin + r + 1, visible, softmax_scale);
      }
      matmul_nn(scores.data(), visible, head_up + nope, up_width,
                out + (begin * heads + hd) * v_dim, heads * v_dim, rows, v_dim, visible);
    }
  }
}

// out[n, d] (+)= down(silu(gate x) * up x)
void run_mlp(const Mlp& mlp, const float* x, int64_t n, float* out, bool accumulate) {
  const int64_t hidden = mlp.gate.in;
  const int64_t inner = mlp.gate.out;
  std::vector<float> gate(static_cast<size_t>(n * inner));
  std::vector<float> up(static_cast<size_t>(n * inner));
  linear(mlp.gate, x, hidden, n, gate.data(), inner);
  linear(mlp.up, x, hidden, n, up.data(), inner);
  cpu::silu_mul(gate.data(), up.data(), n * inner);
  linear(mlp.down, gate.data(), inner, n, out, hidden, accumulate);
}

// x[n, d] += MoE(h[n, d]): tokens are grouped by expert so each expert runs one GEMM.
void run_moe(const ModelConfig& config, const Moe& moe, const float* h, int64_t n, float* x) {
  const int64_t hidden = config.hidden_size;
  const int64_t num_experts = config.n_routed_experts;
  std::vector<float> router_logits(static_cast<size_t>(n * num_experts));
  linear(moe.router, h, hidden, n, router_logits.data(), num_experts);

  std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < n; ++t) {
    const ExpertChoice choice =
        route_token(config, router_logits.data() + t * num_experts, moe.correction_bias);
    for (size_t k = 0; k < choice.experts.size(); ++k) {
      assigned[choice.experts[k]].emplace_back(t, choice.weights[k]);
    }
  }

  std::vector<float> gathered, expert_out;
  for (int64_t e = 0; e < num_experts; ++e) {
    const auto& tokens = assigned[e];
    if (tokens.empty()) continue;
    const int64_t m = static_cast<int64_t>(tokens.size());
    gathered.resize(static_cast<size_t>(m * hidden));
    expert_out.resize(static_cast<size_t>(m * hidden));
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(h + tokens[i].first * hidden, hidden, gathered.data() + i * hidden);
    }
    run_mlp(moe.experts[e], gathered.data(), m, expert_out.data(), false);
    for (int64_t i = 0; i < m; ++i) {
      float* target = x + tokens[i].first * hidden;
      const float* source = expert_out.data() + i * hidden;
      const float weight = tokens[i].second;
      for (int64_t d = 0; d < hidden; ++d) target[d] += weight * source[d];
    }
  }
  if (moe.has_shared) run_mlp(moe.shared, h, n, x, /*accumulate=*/true);
}

}  // namespace

Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

Model Model::load(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir)) {
    throw IoError("model directory " + dir.string() + " does not exist");
  }
  const std::filesystem::path config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path)) {
    throw IoError("model directory " + dir.string() + " has no config.json");
  }
  Model model;
  model.config_ = ModelConfig::from_file(config_path);
  const TensorStore store = TensorStore::open_dir(dir);
  model.weights_ = std::make_unique<ModelWeights>(load_weights(model.config_, store));
  return model;
}

int64_t Model::parameter_count() const { return weights_->parameter_count; }

CacheShape Model::cache_shape() const {
  return CacheShape{config_.num_layers, config_.kv_lora_rank, config_.qk_rope_head_dim};
}

std::unique_ptr<MlaCache> Model::make_cache(int64_t capacity, const CacheFormat& format) const {
  return quantmla::make_cache(cache_shape(), format, capacity);
}

void Model::forward(std::span<const int32_t> tokens, MlaCache& cache, std::span<float> logits,
                    bool all_logits, AttentionTrace* trace) const {
  const ModelConfig& c = config_;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) throw InvalidArgument("forward: empty input, no tokens to run");
  for (int64_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size) {
      throw InvalidArgument("token id " + std::to_string(tokens[t]) + " at index " +
                            std::to_string(t) + " is outside the vocabulary [0, " +
                            std::to_string(c.vocab_size) + ")");
    }
  }
  const CacheShape expected = cache_shape();
  const CacheShape& actual = cache.shape();
  if (actual != expected) {
    throw ShapeError(
        "cache shape (layers " + std::to_string(actual.num_layers) + ", rank " +
        std::to_string(actual.kv_lora_rank) + ", rope " + std::to_string(actual.rope_dim) +
        ") does not match the model (" + std::to_string(expected.num_layers) + ", " +
        std::to_string(expected.kv_lora_rank) + ", " + std::to_string(expected.rope_dim) + ")");
  }
  const int64_t pos0 = cache.length();
  if (pos0 + n > cache.capacity()) {
    throw CapacityError("cache full: " + std::to_string(pos0) + " tokens cached + " +
                        std::to_string(n) + " new > capacity " + std::to_string(cache.capacity()));
  }
  const int64_t logit_rows = all_logits ? n : 1;
  if (static_cast<int64_t>(logits.size()) != logit_rows * c.vocab_size) {
    throw ShapeError("forward: logits buffer holds " + std::to_string(logits.size()) +
                     " floats, expected " + std::to_string(logit_rows * c.vocab_size));
  }

  const int64_t d = c.hidden_size;
  const int64_t heads = c.num_heads;
  const int64_t rank = c.kv_lora_rank;
  const int64_t rope_dim = c.qk_rope_head_dim;
  const int64_t nope = c.qk_nope_head_dim;
  const int64_t v_dim = c.v_head_dim;
  const int64_t qk_dim = c.qk_head_dim();
  const int64_t row_width = rank + rope_dim;
  const int64_t kv_b_head_rows = nope + v_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float softmax_scale = static_cast<float>(c.softmax_scale());
  const Rope& rope = *weights_->rope;
  const auto sz = [](int64_t count) { return static_cast<size_t>(count); };

  std::vector<float> x(sz(n * d)), h(sz(n * d));
  std::vector<float> q(sz(n * heads * qk_dim)), q_low(sz(n * std::max<int64_t>(c.q_lora_rank, 1)));
  std::vector<float> kv(sz(n * row_width)), latent(sz(n * rank)), k_pe(sz(n * rope_dim));
  std::vector<float> q_absorbed(sz(n * heads * row_width)), attended(sz(n * heads * rank));
  std::vector<float> head_out(sz(n * heads * v_dim));

  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(weights_->embed.data() + tokens[t] * d, d, x.data() + t * d);
  }
  if (trace != nullptr) {
    trace->outputs.resize(sz(c.num_layers));
    trace->queries.resize(trace->record_queries ? sz(c.num_layers) : 0);
    trace->latents.resize(trace->record_cache_rows ? sz(c.num_layers) : 0);
    trace->rope_keys.resize(trace->record_cache_rows ? sz(c.num_layers) : 0);
  }

  // Decode (and traced prefill): the absorbed form, attention inside the cache, then W_UV.
  const auto absorbed_attention = [&](int64_t l, const DecoderLayer& layer) {
    const AttentionWeights& attn = layer.attention;
    // Absorbed queries: [W_UK_h^T q_nope_h ; RoPE(q_pe_h)] per head.
    // One token: the per-head products are too small to split, so the heads run in parallel.
    const bool bf16_decode = n == 1 && !attn.kv_b.weight_bf16.empty();
#pragma omp parallel for schedule(static) if (n == 1)
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t w_uk = hd * kv_b_head_rows * rank;
      if (bf16_decode) {
        cpu::gemv_t_bf16(attn.kv_b.weight_bf16.data() + w_uk, rank, q.data() + hd * qk_dim,
                         q_absorbed.data() + hd * row_width, nope, rank, false);
      } else {
        matmul_nn(q.data() + hd * qk_dim, heads * qk_dim, attn.kv_b.weight.data() + w_uk, rank,
                  q_absorbed.data() + hd * row_width, heads * row_width, n, rank, nope);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      float* q_pe_out = q_absorbed.data() + t * heads * row_width + rank;
      for (int64_t hd = 0; hd < heads; ++hd) {
        std::copy_n(q.data() + (t * heads + hd) * qk_dim + nope, rope_dim,
                    q_pe_out + hd * row_width);
      }
      rope.apply(q_pe_out, heads, row_width, pos0 + t);
    }

    const CacheQuery query{q_absorbed.data(), n, heads, pos0, softmax_scale};
    cache.attend(l, query, attended.data(), nullptr);

    // Values: o_h = W_UV_h * attended_h.
#pragma omp parallel for schedule(static) if (n == 1)
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t w_uv = (hd * kv_b_head_rows + nope) * rank;
      if (bf16_decode) {
        cpu::gemv_bf16(attn.kv_b.weight_bf16.data() + w_uv, rank, attended.data() + hd * rank,
                       head_out.data() + hd * v_dim, v_dim, rank, false);
      } else {
        matmul_nt(attended.data() + hd * rank, heads * rank, attn.kv_b.weight.data() + w_uv, rank,
                  head_out.data() + hd * v_dim, heads * v_dim, n, v_dim, rank);
      }
    }
    if (trace != nullptr) {
      trace->outputs[l] = head_out;
      if (trace->record_queries) trace->queries[l] = q_absorbed;
      if (trace->record_cache_rows) {
        trace->latents[l] = latent;
        trace->rope_keys[l] = k_pe;
      }
    }
  };

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const DecoderLayer& layer = weights_->layers[l];
    const AttentionWeights& attn = layer.attention;
    cpu::rms_norm(x.data(), d, layer.input_norm.data(), n, d, eps, h.data(), d);

    // Queries: [n, heads, nope + rope].
    if (c.q_lora_rank > 0) {
      const int64_t q_rank = c.q_lora_rank;
      linear(attn.q_a, h.data(), d, n, q_low.data(), q_rank);
      cpu::rms_norm(q_low.data(), q_rank, attn.q_a_norm.data(), n, q_rank, eps, q_low.data(),
                    q_rank);
      linear(attn.q_b, q_low.data(), q_rank, n, q.data(), heads * qk_dim);
    } else {
      linear(attn.q, h.data(), d, n, q.data(), heads * qk_dim);
    }

    // Cache rows: c = kv_a_layernorm(kv[:rank]), k_pe = RoPE(kv[rank:]).
    linear(attn.kv_a, h.data(), d, n, kv.data(), row_width);
    cpu::rms_norm(kv.data(), row_width, attn.kv_a_norm.data(), n, rank, eps, latent.data(), rank);
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(kv.data() + t * row_width + rank, rope_dim, k_pe.data() + t * rope_dim);
      rope.apply(k_pe.data() + t * rope_dim, 1, rope_dim, pos0 + t);
    }
    cache.write(l, pos0, n, latent.data(), k_pe.data());

    // Prefill without a trace (whose queries and outputs calibration reads in the absorbed form)
    // takes the expanded form.
    if (n >= kExpandedMinQueries && trace == nullptr) {
      for (int64_t t = 0; t < n; ++t) {
        rope.apply(q.data() + t * heads * qk_dim + nope, heads, qk_dim, pos0 + t);
      }
      expanded_attention(cache, l, attn.kv_b, q.data(), n, pos0, heads, nope, rope_dim, v_dim,
                         softmax_scale, head_out.data());
    } else {
      absorbed_attention(l, layer);
    }
    linear(attn.o, head_out.data(), heads * v_dim, n, x.data(), d, /*accumulate=*/true);

    cpu::rms_norm(x.data(), d, layer.post_attention_norm.data(), n, d, eps, h.data(), d);
    if (layer.is_moe) {
      run_moe(c, layer.moe, h.data(), n, x.data());
    } else {
      run_mlp(layer.mlp, h.data(), n, x.data(), /*accumulate=*/true);
    }
  }
  cache.set_length(pos0 + n);

  const float* final_rows = x.data() + (n - logit_rows) * d;
  cpu::rms_norm(final_rows, d, weights_->final_norm.data(), logit_rows, d, eps, h.data(), d);
  linear(weights_->lm_head, h.data(), d, logit_rows, logits.data(), c.vocab_size);
}

}  // namespace quantmla
