#include "calib/rope_search.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "kernels/cpu/ops.h"
#include "quantmla/error.h"

namespace quantmla::calib {
namespace {

// One key through the folded, quantized cache: e = M^-1 Q(M k) - k (what the logit error sees).
class RopeQuantizer {
 public:
  RopeQuantizer(const PathFormat& format, const RopeTransform& transform, int64_t rope_dim)
      : format_(format),
        rope_dim_(rope_dim),
        encoded_(format.encoded_bytes(rope_dim)),
        forward_(rope_dim),
        decoded_(rope_dim) {
    const int64_t pairs = rope_dim / 2;
    cos_.resize(pairs), sin_.resize(pairs), scale_.resize(pairs);
    for (int64_t i = 0; i < pairs; ++i) {
      cos_[i] = std::cos(transform.angles[i]);
      sin_[i] = std::sin(transform.angles[i]);
      scale_[i] = transform.scales[i];
    }
  }

  // Writes M^-1 Q(M k) to out.
  void round_trip(const float* key, float* out) {
    const int64_t pairs = rope_dim_ / 2;
    for (int64_t i = 0; i < pairs; ++i) {
      const float a = key[2 * i], b = key[2 * i + 1];
      forward_[2 * i] = scale_[i] * (cos_[i] * a - sin_[i] * b);
      forward_[2 * i + 1] = scale_[i] * (sin_[i] * a + cos_[i] * b);
    }
    encode_path(format_, forward_.data(), rope_dim_, encoded_.data());
    decode_path(format_, encoded_.data(), rope_dim_, decoded_.data());
    for (int64_t i = 0; i < pairs; ++i) {
      // M^-1 = (1/s) Rot(-phi).
      const float a = decoded_[2 * i], b = decoded_[2 * i + 1];
      out[2 * i] = (cos_[i] * a + sin_[i] * b) / scale_[i];
      out[2 * i + 1] = (-sin_[i] * a + cos_[i] * b) / scale_[i];
    }
  }

 private:
  PathFormat format_;
  int64_t rope_dim_;
  std::vector<uint8_t> encoded_;
  std::vector<float> forward_, decoded_;
  std::vector<float> cos_, sin_, scale_;
};

double quadratic_form(const float* g, const float* e, int64_t n) {
  double total = 0.0;
  for (int64_t a = 0; a < n; ++a) {
    float row = 0.0f;
    for (int64_t b = 0; b < n; ++b) row += g[a * n + b] * e[b];
    total += static_cast<double>(row) * e[a];
  }
  return total;
}

double key_cost(const RopeProblem& problem, int64_t j, const float* e) {
  const int64_t n = problem.rope_dim;
  if (problem.weights.empty()) {
    double total = 0.0;
    for (int64_t a = 0; a < n; ++a) total += static_cast<double>(e[a]) * e[a];
    return total;
  }
  return quadratic_form(problem.weights.data() + j * n * n, e, n);
}

}  // namespace

const char* to_string(RopeObjective objective) {
  switch (objective) {
    case RopeObjective::kMse:
      return "mse";
    case RopeObjective::kUniform:
      return "uniform";
    case RopeObjective::kAttention:
      return "attention";
  }
  return "?";
}

RopeTransform identity_rope_transform(int64_t rope_dim) {
  return RopeTransform{std::vector<float>(rope_dim / 2, 1.0f), std::vector<float>(rope_dim / 2)};
}

RopeProblem build_rope_problem(std::span<const LayerWindow> windows, const LayerGeometry& geometry,
                               RopeObjective objective, int64_t keys_per_window) {
  const int64_t dr = geometry.rope_dim, heads = geometry.heads, r = geometry.rank;
  const int64_t qw = geometry.query_width(), qs = geometry.query_stride();
  RopeProblem problem;
  problem.rope_dim = dr;
  std::vector<float> probs, gathered, g(static_cast<size_t>(dr * dr));
  for (const LayerWindow& window : windows) {
    const int64_t n = window.length;
    const int64_t count = keys_per_window > 0 ? std::min(keys_per_window, n) : n;
    if (objective == RopeObjective::kAttention) {
      probs.resize(static_cast<size_t>(heads * n * n));
      for (int64_t h = 0; h < heads; ++h) {
        head_probabilities(window, geometry, h, window.latents.data(), window.rope_keys.data(),
                           probs.data() + h * n * n);
      }
    }
    for (int64_t k = 0; k < count; ++k) {
      const int64_t j = k * n / count;  // evenly spaced, position 0 (BOS) included
      const float* key = window.rope_keys.data() + j * dr;
      problem.keys.insert(problem.keys.end(), key, key + dr);
      if (objective == RopeObjective::kMse) {
        for (int64_t a = 0; a < dr; ++a) problem.signal += static_cast<double>(key[a]) * key[a];
        continue;
      }
      // G_j = X^T X with rows sqrt(w_h(t, j)) q_pe,h(t) for t >= j.
      const int64_t rows = (n - j) * heads;
      gathered.resize(static_cast<size_t>(rows * dr));
      for (int64_t t = j; t < n; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const float w =
              objective == RopeObjective::kAttention ? std::sqrt(probs[(h * n + t) * n + j]) : 1.0f;
          const float* q = window.queries.data() + t * qs + h * qw + r;
          float* out = gathered.data() + ((t - j) * heads + h) * dr;
          for (int64_t a = 0; a < dr; ++a) out[a] = w * q[a];
        }
      }
      cpu::matmul_tn(gathered.data(), dr, gathered.data(), dr, g.data(), dr, dr, dr, rows);
      problem.weights.insert(problem.weights.end(), g.begin(), g.end());
      problem.signal += quadratic_form(g.data(), key, dr);
    }
  }
  if (!(problem.signal > 0.0)) {
    throw InvalidArgument("RoPE calibration: the sampled keys carry no signal (all zero)");
  }
  return problem;
}

double rope_loss(const RopeProblem& problem, const PathFormat& format,
                 const RopeTransform& transform) {
  const int64_t n = problem.rope_dim, keys = problem.key_count();
  std::vector<double> per_key(static_cast<size_t>(keys));
  format.encoded_bytes(n);  // throws here for a bad width: exceptions cannot leave the region
#pragma omp parallel
  {
    RopeQuantizer quantizer(format, transform, n);
    std::vector<float> error(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t j = 0; j < keys; ++j) {
      const float* key = problem.keys.data() + j * n;
      quantizer.round_trip(key, error.data());
      for (int64_t a = 0; a < n; ++a) error[a] -= key[a];
      per_key[j] = key_cost(problem, j, error.data());
    }
  }
  double total = 0.0;  // summed in key order: the same result for any thread count
  for (double cost : per_key) total += cost;
  return total / problem.signal;
}

RopeTransform search_rope_transform(const RopeProblem& problem, const PathFormat& format,
                                    const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t pairs = problem.rope_dim / 2;
  RopeTransform best = identity_rope_transform(problem.rope_dim);
  double best_loss = rope_loss(problem, format, best);
  // Sweeps with shrinking steps: log2 scale steps and angle steps (radians), tried both ways.
  struct Sweep {
    std::vector<float> log2_scale_steps;
    std::vector<float> angle_steps;
  };
  constexpr float kPi = std::numbers::pi_v<float>;
  const std::vector<Sweep> sweeps = {
      {{0.5f, 1.0f, 1.5f, 2.0f}, {kPi / 8, kPi / 4, 3 * kPi / 8, kPi / 2}},
      {{0.25f}, {kPi / 32}},
      {{0.125f}, {kPi / 64}},
  };
  const int64_t total = static_cast<int64_t>(sweeps.size()) * pairs;
  int64_t done = 0;
  for (const Sweep& sweep : sweeps) {
    for (int64_t i = 0; i < pairs; ++i) {
      const auto try_candidate = [&](float scale, float angle) {
        RopeTransform candidate = best;
        candidate.scales[i] = scale;
        candidate.angles[i] = angle;
        const double loss = rope_loss(problem, format, candidate);
        if (loss < best_loss) {
          best_loss = loss;
          best = std::move(candidate);
        }
      };
      const float scale = best.scales[i];
      for (float step : sweep.log2_scale_steps) {
        try_candidate(scale * std::exp2(step), best.angles[i]);
        try_candidate(scale * std::exp2(-step), best.angles[i]);
      }
      const float angle = best.angles[i];
      for (float step : sweep.angle_steps) {
        try_candidate(best.scales[i], angle + step);
        if (step < kPi / 2) try_candidate(best.scales[i], angle - step);
      }
      if (progress) progress(++done, total);
    }
  }
  return best;
}

void quantize_rope_keys(const PathFormat& format, const RopeTransform& transform, const float* keys,
                        int64_t rows, int64_t rope_dim, float* out) {
  RopeQuantizer quantizer(format, transform, rope_dim);
  for (int64_t j = 0; j < rows; ++j) quantizer.round_trip(keys + j * rope_dim, out + j * rope_dim);
}

}  // namespace quantmla::calib
