// measure_error_model: one forward with the exact FP32 cache records every layer's queries,
// attention outputs and cache rows; then, per layer and path, the path's rows are quantized alone
// (a layered cache, FP32 everywhere else) and the forward is run again.
#include "quantmla/error_model.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "eval/windows.h"
#include "kernels/cpu/ops.h"
#include "quantmla/error.h"

namespace quantmla {
namespace {

struct Sums {
  double cache_err = 0, cache_norm = 0;
  double score_sq = 0, score_count = 0, score_max = 0, score_rows = 0;
  double attn_err = 0, attn_norm = 0;  // single-layer rows: summed squares at the layer
  double attn_rel_sum = 0;             // every-layer rows: sum over windows of the layer mean
  double kld = 0, logit_sq = 0, positions = 0, logits = 0;
};

// ||a - b||^2 and ||b||^2 added to err and norm.
void add_difference(std::span<const float> a, std::span<const float> b, double& err, double& norm) {
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    err += d * d;
    norm += static_cast<double>(b[i]) * b[i];
  }
}

}  // namespace

const char* to_string(CachePath path) { return path == CachePath::kContent ? "content" : "rope"; }

std::vector<Injection> measure_error_model(const Model& model, std::span<const int32_t> ids,
                                           const ErrorModelOptions& options) {
  const CacheShape shape = model.cache_shape();
  const PathFormat& format = options.format;
  format.encoded_bytes(shape.kv_lora_rank);  // throws for a group that does not divide a path
  format.encoded_bytes(shape.rope_dim);
  const int64_t ctx = options.ctx;
  const int64_t windows = count_windows(model, ids.size(), ctx, options.max_windows);
  const int64_t layers = shape.num_layers;
  const int64_t heads = model.config().num_heads;
  const int64_t vocab = model.config().vocab_size;
  const int64_t width = shape.row_width();
  const auto scale = static_cast<float>(model.config().softmax_scale());
  const PathFormat exact{Codec::kF32};
  const auto sz = [](int64_t count) { return static_cast<size_t>(count); };

  // Injection i < 2 * layers: layer i / 2, path i % 2; then every layer, content and rope.
  const int64_t injections = 2 * layers + 2;
  std::vector<Sums> sums(sz(injections));
  std::vector<int32_t> window;
  std::vector<float> ref_logits(sz(ctx * vocab)), logits(sz(ctx * vocab));
  // The exact run's log-probabilities and probabilities, once per window for every injection.
  std::vector<double> ref_logp(sz(ctx * vocab)), ref_p(sz(ctx * vocab)), logp(sz(vocab));
  std::vector<std::vector<float>> rows(sz(layers), std::vector<float>(sz(ctx * width)));
  std::vector<float> errors(sz(ctx * shape.kv_lora_rank)), decoded(sz(shape.kv_lora_rank));
  std::vector<uint8_t> encoded(sz(format.encoded_bytes(shape.kv_lora_rank)));
  std::vector<float> scores(sz(ctx * heads * ctx));

  // Runs the window with a cache of `formats`; adds the output and attention errors to `s`.
  const auto run_injected = [&](const std::vector<CacheFormat>& formats, int64_t layer, Sums& s,
                                const AttentionTrace& ref) {
    auto cache = make_layered_cache(shape, formats, ctx);
    AttentionTrace trace;
    model.forward(window, *cache, logits, true, &trace);
    for (int64_t l = 0; l < layers; ++l) {
      if (layer >= 0 && l != layer) continue;
      double err = 0, norm = 0;
      add_difference(trace.outputs[l], ref.outputs[l], err, norm);
      // Every-layer rows average the per-layer relative errors.
      if (layer >= 0) {
        s.attn_err += err;
        s.attn_norm += norm;
      } else {
        s.attn_rel_sum += std::sqrt(err / norm) / static_cast<double>(layers);
      }
    }
    for (int64_t t = 0; t + 1 < ctx; ++t) {
      log_softmax(logits.data() + t * vocab, vocab, logp.data());
      const double* p_logp = ref_logp.data() + t * vocab;
      const double* p = ref_p.data() + t * vocab;
      double kld = 0;
      for (int64_t v = 0; v < vocab; ++v) kld += p[v] * (p_logp[v] - logp[v]);
      s.kld += std::max(kld, 0.0);
      s.positions += 1;
      for (int64_t v = 0; v < vocab; ++v) {
        const double d = static_cast<double>(logits[t * vocab + v]) - ref_logits[t * vocab + v];
        s.logit_sq += d * d;
      }
      s.logits += static_cast<double>(vocab);
    }
  };

  for (int64_t w = 0; w < windows; ++w) {
    fill_window(model, ids, ctx, w, window);
    auto ref_cache = model.make_cache(ctx);
    AttentionTrace ref;
    ref.record_queries = true;
    model.forward(window, *ref_cache, ref_logits, true, &ref);
    for (int64_t t = 0; t < ctx; ++t) {
      log_softmax(ref_logits.data() + t * vocab, vocab, ref_logp.data() + t * vocab);
      for (int64_t v = t * vocab; v < (t + 1) * vocab; ++v) ref_p[v] = std::exp(ref_logp[v]);
      for (int64_t l = 0; l < layers; ++l) {
        float* row = rows[l].data() + t * width;
        ref_cache->read_row(l, t, row, row + shape.kv_lora_rank);
      }
    }

    for (int64_t l = 0; l < layers; ++l) {
      for (int path = 0; path < 2; ++path) {
        Sums& s = sums[sz(2 * l + path)];
        const int64_t offset = path == 0 ? 0 : shape.kv_lora_rank;
        const int64_t path_width = path == 0 ? shape.kv_lora_rank : shape.rope_dim;
        // The quantizer's error on this layer's exact rows.
        for (int64_t t = 0; t < ctx; ++t) {
          const float* x = rows[l].data() + t * width + offset;
          encode_path(format, x, path_width, encoded.data());
          decode_path(format, encoded.data(), path_width, decoded.data());
          for (int64_t i = 0; i < path_width; ++i) {
            errors[t * path_width + i] = decoded[i] - x[i];
            s.cache_err +=
                static_cast<double>(errors[t * path_width + i]) * errors[t * path_width + i];
            s.cache_norm += static_cast<double>(x[i]) * x[i];
          }
        }
        // Attention logits move by scale * q . e over this path's channels (queries unchanged:
        // the layers before are exact).
        cpu::matmul_nt(ref.queries[l].data() + offset, width, errors.data(), path_width,
                       scores.data(), ctx, ctx * heads, ctx, path_width);
        for (int64_t r = 0; r < ctx * heads; ++r) {
          const int64_t visible = r / heads + 1;
          double row_max = 0;
          for (int64_t j = 0; j < visible; ++j) {
            const double d = std::abs(static_cast<double>(scale) * scores[r * ctx + j]);
            s.score_sq += d * d;
            row_max = std::max(row_max, d);
          }
          s.score_count += static_cast<double>(visible);
          s.score_max += row_max;
          s.score_rows += 1;
        }
        std::vector<CacheFormat> formats(sz(layers), CacheFormat{exact, exact});
        (path == 0 ? formats[l].content : formats[l].rope) = format;
        run_injected(formats, l, s, ref);
      }
    }
    for (int path = 0; path < 2; ++path) {
      const CacheFormat everywhere =
          path == 0 ? CacheFormat{format, exact} : CacheFormat{exact, format};
      run_injected(std::vector<CacheFormat>(sz(layers), everywhere), -1,
                   sums[sz(2 * layers + path)], ref);
    }
    if (options.progress) options.progress(w + 1, windows);
  }

  std::vector<Injection> results;
  for (int64_t i = 0; i < injections; ++i) {
    const Sums& s = sums[sz(i)];
    Injection r;
    r.layer = i < 2 * layers ? i / 2 : -1;
    r.path = i % 2 == 0 ? CachePath::kContent : CachePath::kRope;
    r.kld_mean = s.kld / s.positions;
    r.logit_rms_error = std::sqrt(s.logit_sq / s.logits);
    if (r.layer >= 0) {
      r.cache_rel_error = std::sqrt(s.cache_err / s.cache_norm);
      r.score_rms_error = std::sqrt(s.score_sq / s.score_count);
      r.score_max_error = s.score_max / s.score_rows;
      r.attention_rel_error = std::sqrt(s.attn_err / s.attn_norm);
    } else {
      r.attention_rel_error = s.attn_rel_sum / static_cast<double>(windows);
      for (int64_t l = 0; l < layers; ++l) {
        const Injection& one = results[sz(2 * l + i % 2)];
        r.cache_rel_error += one.cache_rel_error / static_cast<double>(layers);
        r.score_rms_error += one.score_rms_error / static_cast<double>(layers);
        r.score_max_error += one.score_max_error / static_cast<double>(layers);
      }
    }
    results.push_back(r);
  }
  return results;
}

}  // namespace quantmla
