// Absorbed MLA decode attention and quantize-on-write on an NVIDIA GPU (sm_90a) over a paged cache
// whose pages hold exactly the records of the CPU caches (cache_format.h): 64 records per page,
// found through a block table. Built with -DQUANTMLA_CUDA=ON; using it needs no CUDA header. Every
// pointer in the params structs is a device pointer; strides are in elements.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "quantmla/cache_format.h"

namespace quantmla::gpu {

inline constexpr int kLatentDim = 512;  // kv_lora_rank: width of c, and of the output
inline constexpr int kRopeDim = 64;     // qk_rope_head_dim: width of k_pe
inline constexpr int kKeyDim = kLatentDim + kRopeDim;
inline constexpr int kPageTokens = 64;   // records per page, as the CPU paged cache
inline constexpr int kMaxKeptPairs = 4;  // RoPE frequency pairs kept in BF16 (":bf16pairs=")

// Formats the GPU kernels read and write: content bf16 | fp8 | int4:g64|g128 | int2:g64|g128 (any
// clip), RoPE bf16 | int4:g64 with up to kMaxKeptPairs kept pairs. Throws InvalidArgument naming
// the format otherwise.
void check_gpu_format(const CacheFormat& format);

// One decode step for a batch of sequences: s_q new queries per sequence, all heads.
struct MlaDecodeParams {
  // q: [batch, s_q, num_heads, kKeyDim] BF16 bits: W_UK_h^T q_nope_h, then q_pe_h.
  const uint16_t* q = nullptr;
  // pool: [physical pages, kPageTokens, record_bytes] records as the CPU cache encodes them.
  const uint8_t* pool = nullptr;
  // block_table: [batch, block_table_stride] logical page -> physical page.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  // seq_lens: [batch] tokens in each sequence's cache, its s_q new tokens included. Query i of
  // sequence b sits at position seq_lens[b] - s_q + i and attends to keys [0, that position].
  const int32_t* seq_lens = nullptr;
  // out: [batch, s_q, num_heads, kLatentDim] BF16 bits: sum_j p_h(j) c_j.
  uint16_t* out = nullptr;
  // lse: [batch, s_q, num_heads] natural log-sum-exp of the scaled logits; may be null.
  float* lse = nullptr;
  int batch = 0;
  int s_q = 1;
  int num_heads = 0;  // a multiple of 16
  float softmax_scale = 1.0f;
  // The pool's pages, block_table, seq_lens and the plan were written before the kernel preceding
  // this call on its stream began (two kernels back or earlier, or by a copy), so that under a
  // programmatic dependent launch the 16-head kernels may request their first pages before they
  // wait for that kernel, and read only q after it (the runner's W_UK product, between the cache
  // write and the decode, writes q alone). Leave false where the previous kernel writes the cache.
  bool pool_ready = false;
};

// Device memory for a decode plan, owned by the caller (MlaDecodePlan::workspace_bytes sizes it):
// 256-byte aligned.
struct MlaDecodeWorkspace {
  void* device = nullptr;
  size_t bytes = 0;
};

// How a plan in a workspace splits its work. kFillDevice: the split that fills the device for
// these lengths (each sequence's share of the concurrent blocks), the kernel and its row tiles
// chosen by the batch. kBatchInvariant: each query row's arithmetic depends on its own position
// only, never on the rest of the batch or on the s_q of its call (a token decoded alone, in a
// batch, or recomputed inside a prefill chunk gets the same bits): one 16-row tile a block, the
// kernel chosen by the format alone, each tile taking the pages its own token sees in runs of
// max(kBatchInvariantMinRunPages, pages / kBatchInvariantMaxRuns) pages from the first, every run
// merged by the combine kernel. The cap on runs bounds the partial results a prefill chunk holds
// (its tokens x kBatchInvariantMaxRuns x heads x 2 KB at any context). Not with a fixed grid.
enum class DecodeSplit { kFillDevice, kBatchInvariant };
inline constexpr int kBatchInvariantMinRunPages = 8;
inline constexpr int kBatchInvariantMaxRuns = 16;

// Whether a decode call's longest sequence holds more than kLongContextPages pages (16K tokens),
// which the plan's choice of kernel depends on besides the format, batch and heads: a CUDA graph
// of decode steps keys on it too, so that every step it replays made the choice it captured.
inline constexpr int kLongContextPages = 256;
bool decode_long_context(const std::vector<int32_t>& seq_lens);

// How one decode call is split into thread blocks: each block takes 16, 32 or 64 query rows (s_q x
// heads) of one sequence and a run of its pages, as many blocks as the format's kernel runs at once
// on the device; sequences split into several runs are merged by a combine kernel through their
// log-sum-exps. It depends on the format and the lengths only, so one plan serves every layer of a
// step (as FlashMLA's metadata). Holds (or, in a workspace, points at) its device copy and the
// partial results, so calls that share a plan must run one after another (one stream).
class MlaDecodePlan {
 public:
  // seq_lens: a host copy of MlaDecodeParams::seq_lens. pages_per_split = 0 chooses the split so
  // that the blocks fill the device; a positive value forces it (tests). Throws InvalidArgument
  // for a format without GPU kernels, num_heads not a multiple of 16, s_q < 1, or a sequence
  // shorter than s_q.
  MlaDecodePlan(const CacheFormat& format, const std::vector<int32_t>& seq_lens, int s_q,
                int num_heads, int pages_per_split = 0);
  // Plans into the caller's `workspace` instead of allocating (pages_per_split 0), the schedule
  // copied in on `stream` (a cudaStream_t). fixed_grid: the launches take a grid fixed by
  // (format, batch, s_q, num_heads) whatever the lengths, the unused blocks exiting at once, so
  // that a decode step captured in a CUDA graph can be replayed after the next step's plan is
  // written to the same workspace; otherwise exactly the schedule's blocks. The workspace must
  // stay untouched until the plan's calls have run. Throws InvalidArgument as the first
  // constructor, and for a workspace smaller than workspace_bytes or not 256-byte aligned.
  // split: see DecodeSplit (kBatchInvariant with fixed_grid throws InvalidArgument).
  MlaDecodePlan(const CacheFormat& format, const std::vector<int32_t>& seq_lens, int s_q,
                int num_heads, const MlaDecodeWorkspace& workspace, bool fixed_grid, void* stream,
                DecodeSplit split = DecodeSplit::kFillDevice);
  // Workspace bytes of a fixed-grid plan of `batch` sequences (any lengths).
  static size_t workspace_bytes(const CacheFormat& format, int batch, int s_q, int num_heads);
  // Workspace bytes of a plan of these lengths that launches its own grid.
  static size_t workspace_bytes(const CacheFormat& format, const std::vector<int32_t>& seq_lens,
                                int s_q, int num_heads,
                                DecodeSplit split = DecodeSplit::kFillDevice);

  ~MlaDecodePlan();
  MlaDecodePlan(MlaDecodePlan&&) noexcept;
  MlaDecodePlan& operator=(MlaDecodePlan&&) noexcept;

  int num_blocks() const;  // thread blocks of the decode kernel
  // The decode kernel chosen, by QUANTMLA_DECODE_KERNEL's names: tiled, fragments, fragments3 (the
  // fragment kernel's three-block form), warpgroup or transposed.
  std::string kernel_name() const;
  int max_splits() const;  // most page runs of one sequence
  // The pages of the shortest and of the longest block run (a block's pages of one sequence):
  // whether a kernel's per-run costs or its steady state (a prefetch, say) weigh at a shape.
  struct RunPages {
    int shortest = 0;
    int longest = 0;
  };
  RunPages run_pages() const;

  // What the kernel's roundings depend on besides the inputs, for references that follow its
  // arithmetic (tests): each block's sequence, query rows [first_row, first_row + rows) of its
  // s_q x num_heads, pages [page_begin, page_end), whether it writes a partial result (merged
  // by the combine kernel through the log-sum-exps) and its online-softmax chains (the steps
  // dealt to them in turn, each with its own running maximum, merged at the block's end as the
  // combine merges runs); the keys of one online-softmax step (P is rounded against the running
  // maximum of each step); and the products' operands.
  struct Block {
    int batch = 0;
    int first_row = 0;
    int rows = 0;
    int page_begin = 0;
    int page_end = 0;
    bool partial = false;
    int chains = 1;
  };
  std::vector<Block> blocks() const;
  int keys_per_step() const;
  // The products' operands: kBf16Tile, every key's values rounded to BF16 as the tiled kernel's
  // tile holds them (the warpgroup kernel's BF16 records as stored), and P rounded to BF16;
  // kFp16Codes (the fragment kernel on int g64 or fp8
  // content), the codes exact in FP16, each group's scale and minimum applied to the scores'
  // partial sums and to P (P rounded to FP16, P times a scale rounded again; fp8: the scale over
  // a running power of two), the RoPE key as in the tile; kBf16TileScaledPairs (the warpgroup
  // kernel on a BF16 cache, its seesaw schedule), kBf16Tile but for the pages taken in pairs from
  // each block's first: the second half of the channels (256-511) takes the P of a pair's first
  // page rescaled to the second page's maximum before it is rounded to BF16.
  enum class Operands { kBf16Tile, kFp16Codes, kBf16TileScaledPairs };
  Operands operands() const;

  struct State;
  const State& state() const { return *state_; }

 private:
  std::unique_ptr<State> state_;
};

// Runs the decode kernel (and the combine kernel when a sequence was split) on `stream` (a
// cudaStream_t; null: the default stream). Throws InvalidArgument when the format or the params
// disagree with the plan, CudaError when CUDA reports an error.
void mla_decode(const CacheFormat& format, const MlaDecodeParams& params, const MlaDecodePlan& plan,
                void* stream = nullptr);

// Quantize-on-write: encodes new tokens' (c, k_pe) into their records, byte for byte as
// encode_path does on the CPU for finite inputs. It can also take the rows as kv_a_proj_with_mqa
// writes them and apply kv_a_layernorm to c and RoPE to k_pe first (the arithmetic of the model
// runner's rms_norm and rope kernels), so that a step makes its cache rows in one kernel.
struct MlaWriteParams {
  const float* c = nullptr;     // [num_tokens, kLatentDim], row stride c_stride
  const float* k_pe = nullptr;  // [num_tokens, kRopeDim], row stride k_pe_stride, after RoPE
                                // unless inv_freq is set
  int64_t c_stride = kLatentDim;
  int64_t k_pe_stride = kRopeDim;
  // Set: c is normalized here, weight * (c * inv_rms), inv_rms = float(1 / sqrt(mean_double(c^2)
  // + eps)). [kLatentDim] FP32.
  const float* norm_weight = nullptr;
  float norm_eps = 0.0f;
  // Set: k_pe is rotated here at its position (interleaved pairs, angle = position * inv_freq[i],
  // cos and sin times attention_factor). [kRopeDim / 2] FP32.
  const float* inv_freq = nullptr;
  float attention_factor = 1.0f;
  const int32_t* seq_ids = nullptr;      // [num_tokens] row of block_table of each token
  const int32_t* positions = nullptr;    // [num_tokens] position of each token in its sequence
  uint8_t* pool = nullptr;               // [physical pages, kPageTokens, record_bytes]
  const int32_t* block_table = nullptr;  // [sequences, block_table_stride]
  int64_t block_table_stride = 0;
  int64_t num_tokens = 0;
};
void mla_write(const CacheFormat& format, const MlaWriteParams& params, void* stream = nullptr);

// Dequantizes one sequence's cache rows back to BF16 (the expanded prefill attention reads them):
// out[t] = [c ; k_pe] of position first + t, channel order, as the decode kernel sees them (the
// codes times the BF16-rounded scale plus min; kept RoPE pairs as stored).
struct MlaGatherParams {
  const uint8_t* pool = nullptr;         // [physical pages, kPageTokens, record_bytes]
  const int32_t* block_table = nullptr;  // [pages of the sequence]: its row of the block table
  int64_t first = 0;                     // first position gathered
  int64_t num_tokens = 0;
  // [num_tokens, kKeyDim] BF16 bits, 16-byte aligned, row stride out_stride >= kKeyDim (a
  // multiple of 8).
  uint16_t* out = nullptr;
  int64_t out_stride = kKeyDim;
};
void mla_gather(const CacheFormat& format, const MlaGatherParams& params, void* stream = nullptr);

// True when a CUDA device can be used from this process.
bool device_available();

}  // namespace quantmla::gpu
