#include "model/forward.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/gemv_bf16.h"
#include "kernels/cpu/ops.h"
#include "model/moe_router.h"
#include "model/rope.h"
#include "model/weights.h"
#include "quantmla/error.h"

namespace quantmla::detail {
namespace {

using cpu::matmul_nn;
using cpu::matmul_nt;

size_t sz(int64_t count) { return static_cast<size_t>(count); }

// `count` floats of `buffer`, grown if it is smaller (never shrunk: later, smaller steps reuse it).
// The contents are whatever an earlier step left: every user writes before it reads.
float* take(std::vector<float>& buffer, int64_t count) {
  if (buffer.size() < sz(count)) buffer.resize(sz(count));
  return buffer.data();
}

// y[m, out] (+)= x[m, in] W^T, with leading dimensions; one row takes the BF16 GEMV when it can.
void linear(const Linear& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
            bool accumulate = false) {
  if (m == 1 && !w.weight_bf16.empty()) {
    cpu::gemv_bf16(w.weight_bf16.data(), w.in, x, y, w.out, w.in, accumulate);
  } else {
    matmul_nt(x, ldx, w.weight.data(), w.in, y, ldy, m, w.out, w.in, accumulate);
  }
}

// A segment of at least this many queries (prefill) takes the expanded form of MLA attention.
constexpr int64_t kExpandedMinQueries = 64;
constexpr int64_t kExpandedQueryBlock = 256;

// Prefill attention in the expanded form: the cache rows are read back (the values attention sees,
// quantized formats included), up-projected once (K_nope = C W_UK^T, V = C W_UV^T), then every
// head attends over [k_nope ; k_pe] with values V. The same function as the absorbed form that
// decoding uses, at (qk_dim + v_dim) multiply-adds per key and head instead of
// (kv_lora_rank + rope) + kv_lora_rank: about a fifth for DeepSeek's shapes.
// q: [n, heads, qk_dim] rows ldq apart, RoPE applied to the q_pe part; out: [n, heads, v_dim].
void expanded_attention(const RowStore& store, int64_t segment, int64_t layer, const Linear& kv_b,
                        const float* q, int64_t n, int64_t pos0, int64_t heads, int64_t nope,
                        int64_t rope_dim, int64_t v_dim, float softmax_scale, float* out,
                        ForwardWorkspace& ws) {
  const int64_t rank = kv_b.in;
  const int64_t keys = pos0 + n;
  const int64_t width = rank + rope_dim;
  const int64_t qk_dim = nope + rope_dim;
  const int64_t up_width = heads * (nope + v_dim);
  float* rows = take(ws.key_rows, keys * width);
  store.read_rows(segment, layer, keys, rows);
  float* up = take(ws.up_keys, keys * up_width);
  matmul_nt(rows, width, kv_b.weight.data(), rank, up, up_width, keys, up_width, rank);
  float* head_keys = take(ws.head_keys, keys * qk_dim);
  for (int64_t hd = 0; hd < heads; ++hd) {
    const float* head_up = up + hd * (nope + v_dim);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < keys; ++j) {
      std::copy_n(head_up + j * up_width, nope, head_keys + j * qk_dim);
      std::copy_n(rows + j * width + rank, rope_dim, head_keys + j * qk_dim + nope);
    }
    for (int64_t begin = 0; begin < n; begin += kExpandedQueryBlock) {
      const int64_t block = std::min(kExpandedQueryBlock, n - begin);
      const int64_t visible = pos0 + begin + block;  // keys the block's last query sees
      float* scores = take(ws.scores, block * visible);
      matmul_nt(q + (begin * heads + hd) * qk_dim, heads * qk_dim, head_keys, qk_dim, scores,
                visible, block, visible, qk_dim);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < block; ++r) {
        cpu::softmax_row(scores + r * visible, pos0 + begin + r + 1, visible, softmax_scale);
      }
      matmul_nn(scores, visible, head_up + nope, up_width, out + (begin * heads + hd) * v_dim,
                heads * v_dim, block, v_dim, visible);
    }
  }
}

// out[n, d] (+)= down(silu(gate x) * up x)
void run_mlp(const Mlp& mlp, const float* x, int64_t n, float* out, bool accumulate,
             ForwardWorkspace& ws) {
  const int64_t hidden = mlp.gate.in;
  const int64_t inner = mlp.gate.out;
  float* gate = take(ws.gate, n * inner);
  float* up = take(ws.up, n * inner);
  linear(mlp.gate, x, hidden, n, gate, inner);
  linear(mlp.up, x, hidden, n, up, inner);
  cpu::silu_mul(gate, up, n * inner);
  linear(mlp.down, gate, inner, n, out, hidden, accumulate);
}

// x[n, d] += MoE(h[n, d]): tokens are grouped by expert so each expert runs one GEMM.
void run_moe(const ModelConfig& config, const Moe& moe, const float* h, int64_t n, float* x,
             ForwardWorkspace& ws) {
  const int64_t hidden = config.hidden_size;
  const int64_t num_experts = config.n_routed_experts;
  float* router_logits = take(ws.router_logits, n * num_experts);
  linear(moe.router, h, hidden, n, router_logits, num_experts);

  std::vector<std::vector<std::pair<int64_t, float>>> assigned(sz(num_experts));
  for (int64_t t = 0; t < n; ++t) {
    const ExpertChoice choice =
        route_token(config, router_logits + t * num_experts, moe.correction_bias);
    for (size_t k = 0; k < choice.experts.size(); ++k) {
      assigned[choice.experts[k]].emplace_back(t, choice.weights[k]);
    }
  }

  for (int64_t e = 0; e < num_experts; ++e) {
    const auto& tokens = assigned[e];
    if (tokens.empty()) continue;
    const int64_t m = static_cast<int64_t>(tokens.size());
    float* gathered = take(ws.gathered, m * hidden);
    float* expert_out = take(ws.expert_out, m * hidden);
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(h + tokens[i].first * hidden, hidden, gathered + i * hidden);
    }
    run_mlp(moe.experts[e], gathered, m, expert_out, false, ws);
    for (int64_t i = 0; i < m; ++i) {
      float* target = x + tokens[i].first * hidden;
      const float* source = expert_out + i * hidden;
      const float weight = tokens[i].second;
      for (int64_t d = 0; d < hidden; ++d) target[d] += weight * source[d];
    }
  }
  if (moe.has_shared) run_mlp(moe.shared, h, n, x, /*accumulate=*/true, ws);
}

}  // namespace

void run_forward(const ModelConfig& c, const ModelWeights& weights, std::span<const int32_t> tokens,
                 std::span<const ForwardSegment> segments, RowStore& store,
                 std::span<const int64_t> logit_tokens, std::span<float> logits,
                 AttentionTrace* trace, ForwardWorkspace& ws) {
  const int64_t n = static_cast<int64_t>(tokens.size());
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
  const Rope& rope = *weights.rope;
  if (trace != nullptr && segments.size() != 1) {
    throw InvalidArgument("forward: a trace records one sequence, the batch has " +
                          std::to_string(segments.size()));
  }

  // Each token's position, and the segments that attend in the absorbed form (decode steps, short
  // chunks, traced runs) with their tokens gathered in segment order.
  std::vector<int64_t> position(sz(n));
  std::vector<bool> expanded(segments.size());
  std::vector<int64_t> absorbed_tokens;
  std::vector<int64_t> absorbed_first(segments.size());
  for (size_t s = 0; s < segments.size(); ++s) {
    const ForwardSegment& seg = segments[s];
    for (int64_t i = 0; i < seg.num_tokens; ++i) position[sz(seg.first_token + i)] = seg.pos0 + i;
    expanded[s] = seg.num_tokens >= kExpandedMinQueries && trace == nullptr;
    absorbed_first[s] = static_cast<int64_t>(absorbed_tokens.size());
    if (!expanded[s]) {
      for (int64_t i = 0; i < seg.num_tokens; ++i) absorbed_tokens.push_back(seg.first_token + i);
    }
  }
  const int64_t m = static_cast<int64_t>(absorbed_tokens.size());
  // The absorbed segments of one token (decode tokens), attended side by side below.
  std::vector<size_t> single_token_segments;
  for (size_t s = 0; s < segments.size(); ++s) {
    if (segments[s].num_tokens == 1 && !expanded[s]) single_token_segments.push_back(s);
  }

  float* x = take(ws.x, n * d);
  float* h = take(ws.h, n * d);
  float* q = take(ws.q, n * heads * qk_dim);
  float* q_low = take(ws.q_low, n * std::max<int64_t>(c.q_lora_rank, 1));
  float* kv = take(ws.kv, n * row_width);
  float* latent = take(ws.latent, n * rank);
  float* k_pe = take(ws.k_pe, n * rope_dim);
  float* q_gathered = take(ws.q_gathered, m * heads * qk_dim);
  float* q_absorbed = take(ws.q_absorbed, m * heads * row_width);
  float* attended = take(ws.attended, m * heads * rank);
  float* absorbed_out = take(ws.absorbed_out, m * heads * v_dim);
  float* head_out = take(ws.head_out, n * heads * v_dim);

  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(weights.embed.data() + tokens[t] * d, d, x + t * d);
  }
  if (trace != nullptr) {
    trace->outputs.resize(sz(c.num_layers));
    trace->queries.resize(trace->record_queries ? sz(c.num_layers) : 0);
    trace->latents.resize(trace->record_cache_rows ? sz(c.num_layers) : 0);
    trace->rope_keys.resize(trace->record_cache_rows ? sz(c.num_layers) : 0);
  }

  // The absorbed form for the gathered tokens: [W_UK_h^T q_nope_h ; RoPE(q_pe_h)] per head, the
  // attention inside the row store per segment, then W_UV per head.
  const auto absorbed_attention = [&](int64_t l, const AttentionWeights& attn) {
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(q + absorbed_tokens[i] * heads * qk_dim, heads * qk_dim,
                  q_gathered + i * heads * qk_dim);
    }
    // The heads in parallel, each head's product on one thread (BLAS inside a parallel region
    // runs single-threaded): at one token the products are too small to split, and at a decode
    // batch's few rows a BLAS call that splits each small product across the threads costs more
    // than it computes.
    const bool bf16_decode = m == 1 && !attn.kv_b.weight_bf16.empty();
#pragma omp parallel for schedule(static)
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t w_uk = hd * kv_b_head_rows * rank;
      if (bf16_decode) {
        cpu::gemv_t_bf16(attn.kv_b.weight_bf16.data() + w_uk, rank, q_gathered + hd * qk_dim,
                         q_absorbed + hd * row_width, nope, rank, false);
      } else {
        matmul_nn(q_gathered + hd * qk_dim, heads * qk_dim, attn.kv_b.weight.data() + w_uk, rank,
                  q_absorbed + hd * row_width, heads * row_width, m, rank, nope);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      float* q_pe_out = q_absorbed + i * heads * row_width + rank;
      for (int64_t hd = 0; hd < heads; ++hd) {
        std::copy_n(q_gathered + (i * heads + hd) * qk_dim + nope, rope_dim,
                    q_pe_out + hd * row_width);
      }
      rope.apply(q_pe_out, heads, row_width, position[sz(absorbed_tokens[i])]);
    }

    const auto attend_segment = [&](size_t s) {
      if (expanded[s]) return;
      const int64_t first = absorbed_first[s];
      const CacheQuery query{q_absorbed + first * heads * row_width, segments[s].num_tokens, heads,
                             segments[s].pos0, softmax_scale};
      store.attend(static_cast<int64_t>(s), l, query, attended + first * heads * rank);
    };
    // Chunks of several tokens one after the other, each attention parallel inside; then the
    // single-token segments (a decode batch) one a thread, each attention single-threaded inside
    // (a nested region): a parallel region per decode token forks and joins for more time than
    // one token's attention over a short cache takes. The attention's split of the keys depends
    // on the thread count only (omp_get_max_threads, the same inside the nested region unless
    // OMP_NUM_THREADS lists a second level), so a token's result does not depend on its batch.
    for (size_t s = 0; s < segments.size(); ++s) {
      if (segments[s].num_tokens > 1) attend_segment(s);
    }
    const auto singles = static_cast<int64_t>(single_token_segments.size());
    if (singles > 1) {  // not an `if` clause: a serialized region makes each inner one a new team
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t i = 0; i < singles; ++i) attend_segment(single_token_segments[sz(i)]);
    } else if (singles == 1) {
      attend_segment(single_token_segments[0]);
    }

#pragma omp parallel for schedule(static)
    for (int64_t hd = 0; hd < heads; ++hd) {
      const int64_t w_uv = (hd * kv_b_head_rows + nope) * rank;
      if (bf16_decode) {
        cpu::gemv_bf16(attn.kv_b.weight_bf16.data() + w_uv, rank, attended + hd * rank,
                       absorbed_out + hd * v_dim, v_dim, rank, false);
      } else {
        matmul_nt(attended + hd * rank, heads * rank, attn.kv_b.weight.data() + w_uv, rank,
                  absorbed_out + hd * v_dim, heads * v_dim, m, v_dim, rank);
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      std::copy_n(absorbed_out + i * heads * v_dim, heads * v_dim,
                  head_out + absorbed_tokens[i] * heads * v_dim);
    }
    if (trace != nullptr) {
      trace->outputs[l].assign(head_out, head_out + n * heads * v_dim);
      if (trace->record_queries) {
        trace->queries[l].assign(q_absorbed, q_absorbed + m * heads * row_width);
      }
      if (trace->record_cache_rows) {
        trace->latents[l].assign(latent, latent + n * rank);
        trace->rope_keys[l].assign(k_pe, k_pe + n * rope_dim);
      }
    }
  };

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const DecoderLayer& layer = weights.layers[l];
    const AttentionWeights& attn = layer.attention;
    cpu::rms_norm(x, d, layer.input_norm.data(), n, d, eps, h, d);

    // Queries: [n, heads, nope + rope].
    if (c.q_lora_rank > 0) {
      const int64_t q_rank = c.q_lora_rank;
      linear(attn.q_a, h, d, n, q_low, q_rank);
      cpu::rms_norm(q_low, q_rank, attn.q_a_norm.data(), n, q_rank, eps, q_low, q_rank);
      linear(attn.q_b, q_low, q_rank, n, q, heads * qk_dim);
    } else {
      linear(attn.q, h, d, n, q, heads * qk_dim);
    }

    // Cache rows: c = kv_a_layernorm(kv[:rank]), k_pe = RoPE(kv[rank:]).
    linear(attn.kv_a, h, d, n, kv, row_width);
    cpu::rms_norm(kv, row_width, attn.kv_a_norm.data(), n, rank, eps, latent, rank);
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(kv + t * row_width + rank, rope_dim, k_pe + t * rope_dim);
      rope.apply(k_pe + t * rope_dim, 1, rope_dim, position[sz(t)]);
    }
    for (size_t s = 0; s < segments.size(); ++s) {
      const ForwardSegment& seg = segments[s];
      store.write(static_cast<int64_t>(s), l, seg.pos0, seg.num_tokens,
                  latent + seg.first_token * rank, k_pe + seg.first_token * rope_dim);
    }

    if (m > 0) absorbed_attention(l, attn);
    for (size_t s = 0; s < segments.size(); ++s) {
      if (!expanded[s]) continue;
      const ForwardSegment& seg = segments[s];
      float* seg_q = q + seg.first_token * heads * qk_dim;
      for (int64_t i = 0; i < seg.num_tokens; ++i) {
        rope.apply(seg_q + i * heads * qk_dim + nope, heads, qk_dim, seg.pos0 + i);
      }
      expanded_attention(store, static_cast<int64_t>(s), l, attn.kv_b, seg_q, seg.num_tokens,
                         seg.pos0, heads, nope, rope_dim, v_dim, softmax_scale,
                         head_out + seg.first_token * heads * v_dim, ws);
    }
    linear(attn.o, head_out, heads * v_dim, n, x, d, /*accumulate=*/true);

    cpu::rms_norm(x, d, layer.post_attention_norm.data(), n, d, eps, h, d);
    if (layer.is_moe) {
      run_moe(c, layer.moe, h, n, x, ws);
    } else {
      run_mlp(layer.mlp, h, n, x, /*accumulate=*/true, ws);
    }
  }

  const int64_t rows = static_cast<int64_t>(logit_tokens.size());
  if (rows == 0) return;
  float* final_rows = take(ws.final_rows, rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x + logit_tokens[r] * d, d, final_rows + r * d);
  }
  cpu::rms_norm(final_rows, d, weights.final_norm.data(), rows, d, eps, h, d);
  linear(weights.lm_head, h, d, rows, logits.data(), c.vocab_size);
}

}  // namespace quantmla::detail
