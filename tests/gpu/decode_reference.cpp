// See decode_reference.h.
#include "decode_reference.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/cuda/fragment_maps.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"

namespace quantmla::testing {

using gpu::kKeyDim;
using gpu::kLatentDim;
using gpu::kPageTokens;
using gpu::kRopeDim;

// Round to nearest even at BF16's 8 significant bits, from double in one step (normal range).
double bf16_round(double v) {
  if (v == 0.0) return v;
  int exponent = 0;
  const double mantissa = std::frexp(v, &exponent);  // [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(mantissa, 8)), exponent - 8);
}

// The unit in the last place of BF16 at |v| (the subnormal step below the normal range).
double bf16_ulp(double v) {
  const double a = std::max(std::fabs(v), 0x1.0p-126);
  return std::ldexp(1.0, std::ilogb(a) - 7);
}

uint8_t* PagedRecords::record(int b, int pos) {
  const int64_t page = block_table[static_cast<size_t>(b) * max_pages + pos / kPageTokens];
  return pool.data() + (page * kPageTokens + pos % kPageTokens) * record_bytes;
}
const uint8_t* PagedRecords::record(int b, int pos) const {
  return const_cast<PagedRecords*>(this)->record(b, pos);
}

PagedRecords random_paged_records(const CacheFormat& format, const std::vector<int32_t>& lens,
                                  std::mt19937_64& rng, std::vector<std::vector<float>>* rows) {
  PagedRecords c;
  c.format = format;
  c.record_bytes = format.record_bytes(kLatentDim, kRopeDim);
  c.content_bytes = format.content.encoded_bytes(kLatentDim);
  c.lens = lens;
  int total_pages = 0;
  for (const int32_t len : lens) {
    c.max_pages = std::max(c.max_pages, (len + kPageTokens - 1) / kPageTokens);
    total_pages += (len + kPageTokens - 1) / kPageTokens;
  }
  std::vector<int32_t> physical(static_cast<size_t>(total_pages));
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  c.block_table.assign(lens.size() * c.max_pages, -1);
  size_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int page = 0; page < (lens[b] + kPageTokens - 1) / kPageTokens; ++page) {
      c.block_table[b * c.max_pages + page] = physical[next++];
    }
  }
  c.pool.assign(static_cast<size_t>(total_pages) * kPageTokens * c.record_bytes, 0xff);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t b = 0; b < lens.size(); ++b) {
    std::vector<float> values(static_cast<size_t>(lens[b]) * kKeyDim);
    for (int pos = 0; pos < lens[b]; ++pos) {
      float* row = values.data() + static_cast<size_t>(pos) * kKeyDim;
      for (int i = 0; i < kLatentDim; ++i) row[i] = normal(rng) * (i % 37 == 0 ? 6.0f : 1.0f);
      for (int i = 0; i < kRopeDim; ++i) {
        row[kLatentDim + i] = normal(rng) * (i / 2 == 21 ? 8.0f : 2.0f);
      }
      uint8_t* rec = c.record(static_cast<int>(b), pos);
      encode_path(format.content, row, kLatentDim, rec);
      encode_path(format.rope, row + kLatentDim, kRopeDim, rec + c.content_bytes);
    }
    if (rows != nullptr) rows->push_back(std::move(values));
  }
  return c;
}

void kernel_path_values(const PathFormat& f, const uint8_t* rec, int width, float* out,
                        bool wrong_scale) {
  const auto u16 = [](const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); };
  if (f.codec == Codec::kBF16) {
    for (int i = 0; i < width; ++i) out[i] = bf16_to_f32(u16(rec + 2 * i));
    return;
  }
  if (f.codec == Codec::kFP8) {
    for (int i = 0; i < width; ++i) {
      float scale;
      std::memcpy(&scale, rec + width + 4 * (i / f.group), 4);
      if (i / f.group == 0 && wrong_scale) scale *= 2.0f;
      out[i] = bf16_to_f32(f32_to_bf16(e4m3_to_f32(rec[i]) * scale));
    }
    return;
  }
  const int bits = f.bits();
  const int64_t code_bytes = static_cast<int64_t>(width) * bits / 8;
  for (int i = 0; i < width; ++i) {
    const int code = (rec[i * bits / 8] >> (i * bits % 8)) & ((1 << bits) - 1);
    const uint8_t* sm = rec + code_bytes + 4 * (i / f.group);
    const double scale = bf16_to_f32(f32_to_bf16(f16_to_f32(u16(sm)))) *
                         (i / f.group == 0 && wrong_scale ? 2.0 : 1.0);
    const double minimum = bf16_to_f32(f32_to_bf16(f16_to_f32(u16(sm + 2))));
    out[i] = static_cast<float>(bf16_round(code * scale + minimum));  // exact in double
  }
  const int64_t kept = code_bytes + 4 * (width / f.group);
  for (size_t n = 0; n < f.bf16_pairs.size(); ++n) {
    const int pair = f.bf16_pairs[n];
    out[2 * pair] = bf16_to_f32(u16(rec + kept + 4 * n));
    out[2 * pair + 1] = bf16_to_f32(u16(rec + kept + 4 * n + 2));
  }
}

namespace {

// Key `pos` of sequence b as the kernel decodes it (kKeyDim values at `row`): its content with
// `wrong_scale` as kernel_path_values takes it, its RoPE key as stored.
void kernel_key_values(const PagedRecords& cache, int b, int pos, float* row,
                       bool wrong_scale = false) {
  const uint8_t* rec = cache.record(b, pos);
  kernel_path_values(cache.format.content, rec, kLatentDim, row, wrong_scale);
  kernel_path_values(cache.format.rope, rec + cache.content_bytes, kRopeDim, row + kLatentDim);
}

}  // namespace

void aim_row0_at_mutated_keys(const PagedRecords& cache, std::vector<uint16_t>& q) {
  if (cache.lens[0] <= kPageTokens + 1) {
    throw InvalidArgument("aim_row0_at_mutated_keys: sequence 0 has " +
                          std::to_string(cache.lens[0]) + " keys, needs more than " +
                          std::to_string(kPageTokens + 1));
  }
  // Each key divided by its squared norm, so that the two scores come out about alike (the
  // records' outlier channels make the norms differ by far more than the keys' overlap).
  std::vector<double> aim(kKeyDim, 0.0);
  double mean_norm2 = 0.0;
  for (const int pos : {kPageTokens, cache.lens[0] - 1}) {
    std::vector<float> key(kKeyDim);
    kernel_key_values(cache, 0, pos, key.data());
    double norm2 = 0.0;
    for (const float v : key) norm2 += static_cast<double>(v) * v;
    for (int d = 0; d < kKeyDim; ++d) aim[d] += key[d] / norm2;
    mean_norm2 += norm2 / 2.0;
  }
  for (int d = 0; d < kKeyDim; ++d)
    q[d] = f32_to_bf16(static_cast<float>(0.1 * mean_norm2 * aim[d]));
}

void scale_fp8_record(uint8_t* record, float factor) {
  for (int group = 0; group < kLatentDim / 128; ++group) {
    float scale;
    std::memcpy(&scale, record + kLatentDim + 4 * group, sizeof scale);
    scale *= factor;
    std::memcpy(record + kLatentDim + 4 * group, &scale, sizeof scale);
  }
}

namespace {

// Round to FP16 (nearest even, subnormals kept), through float: exact for a BF16 value times a
// power of two and for a product of two FP16 values.
double f16_round(double v) { return f16_to_f32(f32_to_f16(static_cast<float>(v))); }

// The unit in the last place of FP16 at |v| (2^-24 below the normal range).
double f16_ulp(double v) {
  return std::ldexp(1.0, std::max(std::ilogb(std::max(std::fabs(v), 0x1.0p-40)), -14) - 10);
}

// One key of int g64 or fp8 content as the fragment kernel multiplies it: its codes (an int code,
// or an e4m3 code's exact value) and each group's scale (FP16 for int, FP32 for fp8) and minimum
// (0 for fp8). Groups of 64 channels (int) or 128 (fp8).
struct CodedKey {
  double codes[kLatentDim];
  double scale[kLatentDim / 64], minimum[kLatentDim / 64];
  uint32_t scale_bits[kLatentDim / 128];  // fp8: the FP32 scales' bits (their exponents)
};

CodedKey coded_key(const PathFormat& f, const uint8_t* rec, bool wrong_scale) {
  const auto u16 = [](const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); };
  CodedKey key{};
  if (f.codec == Codec::kFP8) {
    for (int i = 0; i < kLatentDim; ++i) key.codes[i] = e4m3_to_f32(rec[i]);
    for (int g = 0; g < kLatentDim / 128; ++g) {
      std::memcpy(&key.scale_bits[g], rec + kLatentDim + 4 * g, 4);
      // The mutation's wrong scale: group 0's doubled (kernel_path_values).
      if (g == 0 && wrong_scale) {
        key.scale_bits[g] = std::bit_cast<uint32_t>(2.0f * std::bit_cast<float>(key.scale_bits[g]));
      }
      key.scale[g] = std::bit_cast<float>(key.scale_bits[g]);
    }
    return key;
  }
  const int bits = f.bits();
  for (int i = 0; i < kLatentDim; ++i) {
    key.codes[i] = (rec[i * bits / 8] >> (i * bits % 8)) & ((1 << bits) - 1);
  }
  for (int g = 0; g < kLatentDim / 64; ++g) {
    const uint8_t* sm = rec + kLatentDim * bits / 8 + 4 * g;
    key.scale[g] = f16_to_f32(u16(sm)) * (g == 0 && wrong_scale ? 2.0f : 1.0f);
    key.minimum[g] = f16_to_f32(u16(sm + 2));
  }
  return key;
}

// One run of keys of one query row, as one block of the kernel takes it.
struct RunResult {
  std::vector<double> out, flip, magnitude;  // [kLatentDim]: acc / sum, and the allowances' parts
  double lse = -INFINITY;
  double score_error = 0.0;  // a scaled logit's FP32 error, largest over the keys (log2 units)
  // What P's roundings near a tie may move the log-sum-exp by (natural-log units): FP16 P, whose
  // row sums add the rounded P (int and fp8 codes), only.
  double lse_flip = 0.0;
  int keys = 0;
};

}  // namespace

FaithfulResult faithful_decode(const PagedRecords& cache, const std::vector<uint16_t>& q, int s_q,
                               int num_heads, float softmax_scale,
                               const std::vector<gpu::MlaDecodePlan::Block>& blocks, int step_keys,
                               Mutation mutation, Arithmetic arithmetic, Operands operands) {
  const bool codes = operands == Operands::kFp16Codes;
  const PathFormat& content = cache.format.content;
  const bool int2 = content.codec == Codec::kInt2;
  const bool fp8 = content.codec == Codec::kFP8;
  if (codes && !((content.codec == Codec::kInt4 || int2) && content.group == 64) && !fp8) {
    throw InvalidArgument("faithful_decode: FP16 code operands need int g64 or fp8 content, not " +
                          cache.format.to_string());
  }
  // The groups the fragment kernel scales by: 64 channels (int), 128 (fp8).
  const int group_size = fp8 ? 128 : 64;
  const int groups = kLatentDim / group_size;
  const int batch = static_cast<int>(cache.lens.size());
  const int rows_per_seq = s_q * num_heads;
  // FP32 arithmetic: every sum rounded to FP32 after each addition (exact in double first).
  const bool fp32 = arithmetic == Arithmetic::kFp32;
  const auto round = [fp32](double v) {
    return fp32 ? static_cast<double>(static_cast<float>(v)) : v;
  };
  const float scale_log2 = softmax_scale * 1.4426950408889634f;  // as mla_decode computes it
  const auto q_value = [&](int b, int r, int d) {
    return static_cast<double>(
        bf16_to_f32(q[(static_cast<size_t>(b) * rows_per_seq + r) * kKeyDim + d]));
  };
  // Every sequence's keys as the kernel decodes them.
  std::vector<std::vector<float>> keys(static_cast<size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    keys[b].resize(static_cast<size_t>(cache.lens[b]) * kKeyDim);
    for (int pos = 0; pos < cache.lens[b]; ++pos) {
      const bool moved = mutation == Mutation::kWrongPage && b == 0 && pos / kPageTokens == 1;
      kernel_key_values(cache, moved ? 1 : b, moved ? pos % kPageTokens : pos,
                        keys[b].data() + static_cast<size_t>(pos) * kKeyDim);
    }
  }
  // Row 0's heaviest visible key, for the mutations that need one.
  int heavy = -1;
  double heavy_score = -INFINITY;
  for (int j = 0; j < cache.lens[0] - s_q + 1; ++j) {
    double s = 0.0;
    for (int d = 0; d < kKeyDim; ++d) {
      s += q_value(0, 0, d) * keys[0][static_cast<size_t>(j) * kKeyDim + d];
    }
    if (s > heavy_score) heavy_score = s, heavy = j;
  }
  if (mutation == Mutation::kGroupScale) {
    kernel_key_values(cache, 0, heavy, keys[0].data() + static_cast<size_t>(heavy) * kKeyDim, true);
  }
  // The fragment kernel's operands: every key's codes, scales and minimums (the RoPE key as above).
  std::vector<std::vector<CodedKey>> coded(static_cast<size_t>(batch));
  if (codes) {
    for (int b = 0; b < batch; ++b) {
      for (int pos = 0; pos < cache.lens[b]; ++pos) {
        const bool moved = mutation == Mutation::kWrongPage && b == 0 && pos / kPageTokens == 1;
        const bool wrong_scale = mutation == Mutation::kGroupScale && b == 0 && pos == heavy;
        coded[b].push_back(coded_key(
            content, cache.record(moved ? 1 : b, moved ? pos % kPageTokens : pos), wrong_scale));
      }
    }
  }

  // The steps from first_key, one every key_stride keys (a chain of a block: MlaDecodePlan::Block).
  const auto run_keys = [&](int b, int r, int first_key, int end_key, int key_stride) {
    const int len = cache.lens[b];
    const int limit =
        len - s_q + r / num_heads + 1 + (mutation == Mutation::kCausal && b == 0 && r == 0);
    RunResult run;
    run.out.assign(kLatentDim, 0.0);
    run.flip.assign(kLatentDim, 0.0);
    run.magnitude.assign(kLatentDim, 0.0);
    // The fragment kernel's Q: content channels in FP16 after scaling by 2^(e_r - p) (exact
    // unless below FP16's normal range), and each group's sum of Q.
    std::vector<double> q_codes(kLatentDim), q_sums(kLatentDim / 64, 0.0),
        q_squares(kLatentDim / 64, 0.0);
    if (codes) {
      double peak = 0.0;
      for (int d = 0; d < kLatentDim; ++d) peak = std::max(peak, std::fabs(q_value(b, r, d)));
      const int e_r = peak > 0.0 ? std::clamp(8 - std::ilogb(peak), -100, 100) : 0;
      for (int d = 0; d < kLatentDim; ++d) {
        const int position = fp8    ? 0
                             : int2 ? gpu::int2_key_code_position(d % 64)
                                    : gpu::int4_code_position(d % 64);
        q_codes[d] =
            std::ldexp(f16_round(std::ldexp(q_value(b, r, d), e_r - position)), position - e_r);
        q_sums[d / group_size] += q_value(b, r, d);
        q_squares[d / group_size] += q_value(b, r, d) * q_value(b, r, d);
      }
    }
    float row_max = -INFINITY;
    double row_sum = 0.0;
    double sum_flip = 0.0;                // the row sum's part that P's near-tie roundings may move
    int exponent[kLatentDim / 128] = {};  // fp8: each group's running scale exponent (biased)
    std::vector<float> x(static_cast<size_t>(step_keys));
    std::vector<double> score(static_cast<size_t>(step_keys));  // each key's score error
    // The scaled scores x (log2 domain, -inf where masked) and score errors of the step's keys
    // from key0, and their maximum.
    const auto step_scores = [&](int key0, std::vector<float>& step_x,
                                 std::vector<double>& step_score) {
      float tile_max = -INFINITY;
      for (int j = 0; j < step_keys; ++j) {
        const int key = key0 + j;
        step_x[j] = -INFINITY;
        if (key >= std::min(limit, len)) continue;
        if (mutation == Mutation::kDroppedKey && b == 0 && r == 0 && key == heavy) continue;
        const float* k = keys[b].data() + static_cast<size_t>(key) * kKeyDim;
        double s = 0.0, squares = 0.0;
        double subnormal_window = 0.0;  // int codes: sum over groups of |scale| sum |terms|
        if (codes) {
          // Each group's scale (Q . codes) + min sum(Q); the terms of both sums add to the squares.
          const CodedKey& c = coded[b][static_cast<size_t>(key)];
          for (int g = 0; g < groups; ++g) {
            double part = 0.0, magnitude = 0.0;
            for (int d = group_size * g; d < group_size * (g + 1); ++d) {
              const double term = q_codes[d] * c.codes[d];
              part = round(part + term);
              magnitude += std::fabs(term);
              squares += term * term * c.scale[g] * c.scale[g];
            }
            if (!fp8) subnormal_window += std::fabs(c.scale[g]) * magnitude;
            s = round(round(s + round(c.scale[g] * part)) + c.minimum[g] * q_sums[g]);
            squares += c.minimum[g] * c.minimum[g] * q_squares[g];
          }
        }
        for (int d = codes ? kLatentDim : 0; d < kKeyDim; ++d) {
          const double term = q_value(b, r, d) * k[d];
          s = round(s + term), squares += term * term;
        }
        // The FP32 sum of kKeyDim products, each addition off by at most an ulp of a partial sum
        // (truncating tensor cores: one-sided), partial sums of random-sign terms growing as
        // sqrt(n) rms: n^1.5 rms 2^-23 in all. Not a worst case (every product of one sign),
        // which would allow 20x more.
        step_score[j] = scale_log2 * std::pow(kKeyDim, 1.5) * std::sqrt(squares / kKeyDim) *
                        std::ldexp(1.0, -23);
        // Int codes enter the scores' MMAs as FP16 subnormals, whose products keep bits only in
        // a window below the largest addend (the probe: 2^-17.3 of an MMA's sum of magnitudes at
        // worst). 2^-16 of each MMA's products and accumulator, the accumulator of a group's
        // four k-steps at most the sum of its products: 2^-14 of the group's sum of magnitudes.
        step_score[j] += scale_log2 * std::ldexp(subnormal_window, -14);
        step_x[j] = static_cast<float>(s) * scale_log2;
        tile_max = std::max(tile_max, step_x[j]);
      }
      return tile_max;
    };
    std::vector<float> next_x(static_cast<size_t>(step_keys));
    std::vector<double> next_score(static_cast<size_t>(step_keys));
    for (int key0 = first_key; key0 < end_key; key0 += key_stride) {
      const float tile_max = step_scores(key0, x, score);
      for (int j = 0; j < step_keys; ++j) {
        if (x[j] == -INFINITY) continue;
        run.score_error = std::max(run.score_error, score[j]);
        ++run.keys;
      }
      const float new_max = std::max(row_max, tile_max);
      const float reference = new_max == -INFINITY ? 0.0f : new_max;
      // kBf16TileScaledPairs: the first page of each pair of the run (with a second) has the
      // right half's P rounded after the rescale to the pair's second maximum, 2^(m_a - m_b).
      const bool scaled_pair = operands == Operands::kBf16TileScaledPairs &&
                               (key0 - first_key) / step_keys % 2 == 0 &&
                               key0 + step_keys < end_key;
      float pair_scale = 1.0f;
      if (scaled_pair) {
        const float next_max = std::max(new_max, step_scores(key0 + step_keys, next_x, next_score));
        pair_scale = std::exp2f(new_max - (next_max == -INFINITY ? 0.0f : next_max));
      }
      const double alpha = fp32 ? std::exp2f(row_max - reference)
                                : std::exp2(static_cast<double>(row_max - reference));
      for (int d = 0; d < kLatentDim; ++d) {
        run.out[d] = round(run.out[d] * alpha), run.flip[d] *= alpha, run.magnitude[d] *= alpha;
      }
      double sum = 0.0, step_flip = 0.0;
      // The largest P scale of the step's keys a group (the subnormal products' window): the
      // kernel's 16-key tiles may take the keys in any order, so each tile is bounded by it.
      std::vector<double> window(kLatentDim / 64, 0.0);
      // fp8: P times each key's FP32 scale over 2^E, E the largest scale exponent of the group in
      // this run's pages so far over the keys that some row of the kernel's 16-row tile sees (the
      // FP16 operand's range), the output times 2^E at the end.
      if (codes && fp8) {
        const int tile_end = std::min(r / 16 * 16 + 16, s_q * num_heads);
        const int tile_limit = len - s_q + (tile_end - 1) / num_heads + 1;
        for (int j = 0; j < step_keys && key0 + j < std::min(len, tile_limit); ++j) {
          const CodedKey& c = coded[b][static_cast<size_t>(key0 + j)];
          for (int g = 0; g < groups; ++g) {
            exponent[g] = std::max<int>(exponent[g], c.scale_bits[g] >> 23 & 0xff);
          }
        }
      }
      for (int j = 0; j < step_keys; ++j) {
        if (x[j] == -INFINITY) continue;
        const float p = fp32 ? std::exp2f(x[j] - reference)
                             : static_cast<float>(std::exp2(static_cast<double>(x[j] - reference)));
        // Near a rounding tie the kernel's p may round the other way: within exp2f's 2 ulp (4
        // here) plus what the FP32 scores move it by (both the logit and the maximum), in units
        // of p's FP32 ulp.
        const double near = 4.0 + 2.0 * 0.6931471805599453 * score[j] * 0x1.0p24;
        if (codes) {
          const double rounded = f16_round(p);
          const double unit = f16_ulp(p);
          const double tie = std::fabs(p - std::floor(p / unit) * unit - unit / 2);
          // p = 0 (exp2 below FP32's range, as the kernel's flushed exp2 gives it too) has no tie
          // to round across (and no exponent: ilogb(0) is INT_MIN).
          const double flip =
              p > 0.0 && tie <= near * std::ldexp(1.0, std::ilogb(p) - 23) ? unit : 0.0;
          sum = round(sum + rounded);
          step_flip += flip;
          const CodedKey& c = coded[b][static_cast<size_t>(key0 + j)];
          for (int g = 0; g < groups; ++g) {
            // The FP16 operand P * scale (fp8: P * fp16(scale / 2^E)) and its value's factor.
            const double factor = fp8 ? std::ldexp(1.0, exponent[g] - 127) : 1.0;
            const double scaled16 =
                fp8 ? f16_round(rounded * f16_round(std::ldexp(c.scale[g], 127 - exponent[g])))
                    : f16_round(rounded * c.scale[g]);
            const double scaled = scaled16 * factor;
            double& largest = window[static_cast<size_t>(g)];
            largest = std::max(largest, std::fabs(scaled));
            for (int d = group_size * g; d < group_size * (g + 1); ++d) {
              const double value = std::fabs(c.scale[g] * c.codes[d] + c.minimum[g]);
              run.out[d] = round(round(run.out[d] + scaled * c.codes[d]) + rounded * c.minimum[g]);
              run.flip[d] +=
                  flip * value +
                  (flip > 0.0 ? f16_ulp(scaled16) * factor * std::fabs(c.codes[d]) : 0.0);
              run.magnitude[d] += rounded * value;
            }
          }
        } else {
          const double rounded = bf16_to_f32(f32_to_bf16(p));
          const int low = static_cast<int>(std::bit_cast<uint32_t>(p) & 0xffffu);
          const double flip = std::abs(low - 0x8000) <= near ? bf16_ulp(rounded) : 0.0;
          // The right half's P of a scaled pair: bf16(p 2^(m_a - m_b)), over the same factor so
          // that the step's later rescale by it restores the kernel's product (0 where the factor
          // underflows: so does the kernel's P). Near a tie also by exp2f's 2 ulp of the factor.
          const float scaled = p * pair_scale;
          const int scaled_low = static_cast<int>(std::bit_cast<uint32_t>(scaled) & 0xffffu);
          const double scaled_rounded =
              pair_scale > 0.0f ? bf16_to_f32(f32_to_bf16(scaled)) / pair_scale : 0.0;
          const double scaled_flip =
              pair_scale > 0.0f && std::abs(scaled_low - 0x8000) <= near + 4.0
                  ? bf16_ulp(bf16_to_f32(f32_to_bf16(scaled))) / pair_scale
                  : 0.0;
          sum = round(sum + p);
          const float* v = keys[b].data() + static_cast<size_t>(key0 + j) * kKeyDim;
          for (int d = 0; d < kLatentDim; ++d) {
            const bool right_scaled = scaled_pair && d >= kLatentDim / 2;
            run.out[d] = round(run.out[d] + (right_scaled ? scaled_rounded : rounded) * v[d]);
            run.flip[d] += (right_scaled ? scaled_flip : flip) * std::fabs(v[d]);
            run.magnitude[d] += rounded * std::fabs(v[d]);
          }
        }
      }
      if (codes) {
        // int: FP16 subnormal codes, a 24-bit window below the largest product; fp8: normal
        // FP16 values up to 448, the same window below 448 times the largest P scale.
        const double window_unit = fp8 ? 448.0 * 0x1.0p-23 : 0x1.0p-12;
        for (int g = 0; g < groups; ++g) {
          const double tiles = step_keys / 16 * window[static_cast<size_t>(g)];
          for (int d = group_size * g; d < group_size * (g + 1); ++d) {
            run.flip[d] += 17.0 * window_unit * tiles;
          }
        }
      }
      row_sum = round(round(row_sum * alpha) + sum);
      sum_flip = sum_flip * alpha + step_flip;
      row_max = new_max;
    }
    const double inverse = row_sum > 0.0 ? 1.0 / row_sum : 0.0;
    for (int d = 0; d < kLatentDim; ++d) {
      run.out[d] *= inverse, run.flip[d] *= inverse, run.magnitude[d] *= inverse;
    }
    run.lse = row_sum > 0.0 ? (row_max + std::log2(row_sum)) * 0.69314718055994531 : -INFINITY;
    run.lse_flip = row_sum > 0.0 ? sum_flip / row_sum : 0.0;
    return run;
  };

  std::vector<std::vector<RunResult>> runs(static_cast<size_t>(batch) * rows_per_seq);
  for (const gpu::MlaDecodePlan::Block& block : blocks) {
    const int first = block.page_begin * kPageTokens;
    const int end = std::min(block.page_end * kPageTokens, cache.lens[block.batch]);
    if (block.chains > 1 && operands == Operands::kBf16TileScaledPairs) {
      throw InvalidArgument("faithful_decode: scaled pairs are steps of one chain");
    }
    // A block's chains merge at its end as the combine merges runs: each is a run of its own.
    for (int r = block.first_row; r < block.first_row + block.rows; ++r) {
      for (int chain = 0; chain < block.chains; ++chain) {
        runs[static_cast<size_t>(block.batch) * rows_per_seq + r].push_back(
            run_keys(block.batch, r, first + chain * step_keys, end, block.chains * step_keys));
      }
    }
  }
  FaithfulResult result;
  result.out.assign(runs.size() * kLatentDim, 0.0);
  result.allowed.assign(runs.size() * kLatentDim, 0.0);
  result.lse.assign(runs.size(), 0.0);
  result.lse_allowed.assign(runs.size(), 0.0);
  for (size_t row = 0; row < runs.size(); ++row) {
    // The combine's merge (a single run passes through): weights exp(lse - max), FP32 sums.
    double max_lse = -INFINITY, total = 0.0, score_error = 0.0, lse_flip = 0.0;
    int keys_seen = 0;
    for (const RunResult& run : runs[row]) {
      max_lse = std::max(max_lse, run.lse);
      score_error = std::max(score_error, run.score_error);
      keys_seen = std::max(keys_seen, run.keys);
    }
    std::vector<double> out(kLatentDim, 0.0), flip(kLatentDim, 0.0), magnitude(kLatentDim, 0.0);
    for (const RunResult& run : runs[row]) {
      const double w = run.lse == -INFINITY ? 0.0 : std::exp(run.lse - max_lse);
      total += w;
      lse_flip += w * run.lse_flip;
      for (int d = 0; d < kLatentDim; ++d) {
        out[d] += w * run.out[d], flip[d] += w * run.flip[d];
        magnitude[d] += w * run.magnitude[d];
      }
    }
    // A scaled logit off by e (log2 units) moves its probability and the sum by up to e ln 2
    // each; the P V sums and the sum of P add up to an FP32 unit per key (and per merged run).
    const double accumulation =
        (keys_seen + 16 + static_cast<double>(runs[row].size())) * std::ldexp(1.0, -23);
    const double relative = 4.0 * 0.6931471805599453 * score_error + 2.0 * accumulation;
    for (int d = 0; d < kLatentDim; ++d) {
      const size_t at = row * kLatentDim + d;
      result.out[at] = out[d] / total;
      result.allowed[at] =
          2.0 * bf16_ulp(result.out[at]) + flip[d] / total + relative * magnitude[d] / total;
    }
    result.lse[row] = runs[row].size() == 1 ? runs[row][0].lse : max_lse + std::log(total);
    result.lse_allowed[row] = 0.6931471805599453 * score_error + accumulation +
                              8.0 * std::ldexp(1.0, -24) * (1.0 + std::fabs(result.lse[row])) +
                              (total > 0.0 ? lse_flip / total : 0.0);
  }
  return result;
}

FaithfulComparison compare_faithful(const std::vector<uint16_t>& out, const std::vector<float>& lse,
                                    const FaithfulResult& ref) {
  FaithfulComparison c;
  double sum_squares = 0.0;
  for (size_t at = 0; at < ref.out.size(); ++at) {
    const double got = bf16_to_f32(out[at]);
    if (std::isnan(got)) {
      ++c.nan;
      continue;
    }
    const double ratio = std::fabs(got - ref.out[at]) / ref.allowed[at];
    c.worst = std::max(c.worst, ratio);
    sum_squares += ratio * ratio;
    c.exact += out[at] == f32_to_bf16(static_cast<float>(ref.out[at]));
  }
  for (size_t row = 0; row < ref.lse.size(); ++row) {
    if (std::isnan(lse[row])) ++c.nan;
    c.worst_lse = std::max(c.worst_lse, std::fabs(lse[row] - ref.lse[row]) / ref.lse_allowed[row]);
  }
  c.rms = std::sqrt(sum_squares / static_cast<double>(ref.out.size()));
  return c;
}

}  // namespace quantmla::testing
