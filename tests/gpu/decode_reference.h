// A host reference for the GPU decode kernel that follows its arithmetic (test code, no CUDA;
// tests/gpu/test_gpu_mla.cpp compares the kernel with it, tests/test_decode_reference.cpp tests it
// on the host). The worst-case bound of test_gpu_mla leaves the quantized formats' runs 30-125x
// below it, so a wrong scale on one group or a lost key could pass; this reference takes the BF16
// tile values the kernel's decoders give each record (computed here from the record's bytes), its
// online softmax step by step with P rounded to BF16 against each step's running maximum, its page
// runs and the combine's log-sum-exp merge, and rounds the output to BF16 once. Scores and sums
// are exact (double); the kernel's FP32 sums and exp2f differ from them by units in the 24th bit,
// which move an output's rounding only near a tie and a probability's only near one. So each
// output must match to 2 units in its last place, plus what a probability near a rounding tie may
// flip and an FP32 accumulation bound; and the RMS of the errors over those allowances must stay
// small.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "quantmla/cache_format.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::testing {

// Most RMS of error / allowed over a call's outputs: the allowances are worst cases, and nearly
// every output should carry the reference's bits.
inline constexpr double kFaithfulRms = 0.25;

// Round to nearest even at BF16's 8 significant bits, in one step from double (normal range).
double bf16_round(double v);
// The unit in the last place of BF16 at |v| (the subnormal step below the normal range).
double bf16_ulp(double v);

// A host copy of a paged pool as the kernel reads it: records of `format`, 64 a page.
struct PagedRecords {
  CacheFormat format;
  int64_t record_bytes = 0;
  int64_t content_bytes = 0;
  int max_pages = 0;
  std::vector<int32_t> lens;
  std::vector<int32_t> block_table;  // [batch, max_pages]
  std::vector<uint8_t> pool;

  uint8_t* record(int b, int pos);
  const uint8_t* record(int b, int pos) const;
};

// Records of `format` for sequences of `lens` as the CPU cache writes them (encode_path): random
// rows, content latents with a few large channels and RoPE keys with one high-energy pair (21) as
// the trained fixture shows (DESIGN §8), so that groups have realistic ranges; pages assigned in a
// shuffled order; 0xFF bytes (NaN in every format) in the slots past each sequence's end, which
// must not reach an output. rows: where the values written go (per sequence [len, 576]), or null.
PagedRecords random_paged_records(const CacheFormat& format, const std::vector<int32_t>& lens,
                                  std::mt19937_64& rng,
                                  std::vector<std::vector<float>>* rows = nullptr);

// The kernel's value of each channel of a path (record_formats.cuh): int codes -> bf16(code *
// bf16(scale) + bf16(min)), one rounding (hfma2); fp8 -> bf16(float(e4m3) * scale); BF16 as
// stored; kept RoPE pairs as stored. `wrong_scale` (the mutation check's) doubles group 0's
// scale. Not another group's scale: the groups of random rows are too alike for it to move the
// outputs beyond their allowances every time (an int4 key with group 1's scale and min did not,
// one run in about twenty).
void kernel_path_values(const PathFormat& f, const uint8_t* rec, int width, float* out,
                        bool wrong_scale = false);

// A change the reference makes to itself, standing for a kernel bug: the comparison must fail
// with it (a test that passes whatever the kernel does proves nothing).
enum class Mutation {
  kNone,
  kGroupScale,  // the heaviest key of row 0 decodes its group 0 with twice its scale
  kWrongPage,   // sequence 0's second page read from sequence 1's first page
  kDroppedKey,  // the heaviest key of row 0 left out of row 0
  kCausal,      // row 0 (query 0 of s_q = 2) also sees the key of query 1
};

struct FaithfulResult {
  std::vector<double> out;      // [batch, s_q, heads, kLatentDim] before the rounding to BF16
  std::vector<double> allowed;  // the same shape: what the kernel may differ by (see above)
  std::vector<double> lse;      // [batch, s_q, heads]
  // The scores' FP32 error, the sums' accumulation and, where the row sums add FP16 P (int and
  // fp8 codes), what a P rounded the other way near a tie moves the sum by.
  std::vector<double> lse_allowed;
};

// Points the query of row 0 (sequence 0, query 0, head 0) at two keys of sequence 0: its last,
// which only query 1 of s_q = 2 may see, so that a causal mask off by one shows, and the first
// of its second page, which row 0 sees (the sequence needs more than 65 keys), so that the other
// mutations (a wrong scale, a wrong page, a dropped key) hit the key that carries row 0's
// weight. With random queries a single key's weight is often too small to move an output far:
// the wrong page moved it by only 2.4x the allowance in one host run of 114.
void aim_row0_at_mutated_keys(const PagedRecords& cache, std::vector<uint16_t>& q);

// Multiplies every FP32 group scale of an fp8 record (after its e4m3 codes, one a channel) by
// `factor`: a key whose scales are far the largest, for the batch-invariance checks of the
// fragment kernel's FP8 operand exponent.
void scale_fp8_record(uint8_t* record, float factor);

// kExact: scores and sums in double (the reference); kFp32: every sum rounded to FP32 after each
// addition and exp2f for exp2 (a stand-in for the kernel, to test the allowances on the host).
enum class Arithmetic { kExact, kFp32 };

using Operands = gpu::MlaDecodePlan::Operands;

// The outputs and log-sum-exps of a decode call over `cache`, block by block as the kernel takes
// them (MlaDecodePlan::blocks(), keys_per_step(), operands(); a block's chains each a run of every
// chains-th step, merged as the combine merges runs); q: [batch, s_q, heads, 576] BF16
// bits. Operands::kFp16Codes (int g64 or fp8 content) follows decode_fragments.cuh: scores
// sum(q~ scale code) + sum(q min) up to FP32 sums (int codes as FP16 subnormals: also up to
// 2^-14 of each group's sum of |q~ scale code|, their products' window), q~ Q as the kernel holds
// it in FP16 (each row times a power of two, each channel divided by 2^p of its code's position:
// fragment_maps.h); P rounded to FP16 and the row sums adding the rounded P; values sum(fp16(P
// scale) code + P min), for fp8 (e4m3 values, FP32 scales of 128 channels, no minimums) sum(fp16(P
// fp16(scale / 2^E)) 2^E code) with E the largest scale exponent of the group over the run's pages
// so far (the keys some row of the kernel's 16-row tile sees). Its products of FP16 subnormal codes
// and P may lose bits below the largest product's window (measured on the H200: 2^-17 of the sum of
// magnitudes); the allowance takes a 24-bit window, 2^-12 of the largest P scale of a group's
// 16-key tile (bounded by the step's largest, the tiles' key order being the kernel's), 17 terms a
// product. Operands::kBf16TileScaledPairs follows decode_seesaw.cuh: the steps of a block in pairs
// from its first, the right half of the channels taking a pair's first step's P times 2^(m_a - m_b)
// (exp2f, FP32) rounded to BF16, over that factor (the next step's rescale restores it), the left
// half and the sums as kBf16Tile.
FaithfulResult faithful_decode(const PagedRecords& cache, const std::vector<uint16_t>& q, int s_q,
                               int num_heads, float softmax_scale,
                               const std::vector<gpu::MlaDecodePlan::Block>& blocks, int step_keys,
                               Mutation mutation = Mutation::kNone,
                               Arithmetic arithmetic = Arithmetic::kExact,
                               Operands operands = Operands::kBf16Tile);

struct FaithfulComparison {
  double worst = 0.0;      // max over outputs of |error| / allowed
  double rms = 0.0;        // RMS over outputs of |error| / allowed
  double worst_lse = 0.0;  // max over rows of |lse error| / allowed
  int exact = 0;           // outputs with the reference's BF16 bits
  int nan = 0;
};

// out: BF16 bits, lse: FP32, both in FaithfulResult's shapes.
FaithfulComparison compare_faithful(const std::vector<uint16_t>& out, const std::vector<float>& lse,
                                    const FaithfulResult& ref);

}  // namespace quantmla::testing
