// The step seam shared by every backend: one forward step over a ragged batch of sequences whose
// rows live in a PagePool. The CPU runner and the CUDA runner implement it; whatever schedules
// requests above it never knows which one it drives.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "quantmla/cache_format.h"
#include "quantmla/config.h"
#include "quantmla/page_pool.h"
#include "quantmla/sampler.h"

namespace quantmla {

class Model;

// Which of a chunk's rows the step turns into logits (and samples).
enum class LogitRows { kNone, kLast, kAll };

// One sequence's part of a step: `tokens` at positions [pool.length(sequence), + tokens.size()).
// A prefill chunk has many tokens, a decode step one.
struct SequenceChunk {
  SequenceId sequence = 0;
  std::span<const int32_t> tokens;
  LogitRows logits = LogitRows::kLast;
  // How its logit rows become tokens: counter_uniform(seed, position of the token drawn).
  SamplerOptions sampling;
  // Whether its logit rows are copied into StepOutputs::logits (when that span is given). A chunk
  // whose tokens are sampled by the runner leaves them out, so that a step where a few requests
  // need their logits on the host (logprobs, host-side sampling controls) copies only theirs.
  bool return_logits = true;

  // Its rows of logits: 1 (kLast), its token count (kAll) or 0.
  int64_t num_logit_rows() const;
};

struct StepBatch {
  std::vector<SequenceChunk> chunks;

  int64_t num_tokens() const;
  // Rows of logits the step computes (and samples): one per kLast chunk, its token count per kAll
  // chunk.
  int64_t num_logit_rows() const;
  // Those of them copied into StepOutputs::logits: the rows of chunks with return_logits.
  int64_t num_returned_logit_rows() const;
};

// What a step returns, in chunk order. Either span may be empty (not wanted).
struct StepOutputs {
  std::span<float> logits;    // [num_returned_logit_rows, vocab]
  std::span<int32_t> tokens;  // [num_logit_rows]: each row sampled with its chunk's params
};

// What the last step did, for benchmarks.
struct StepStats {
  int64_t weight_bytes_read = 0;  // weights the step's GEMMs read (routed experts: those chosen)
  int64_t gemm_flops = 0;         // 2 m n k over the step's GEMMs
  int64_t padding_flops = 0;      // 2 m n k more on padding rows (prefill's batched experts)
  bool graph_replayed = false;    // the CUDA runner replayed a captured graph of the step
  // Where a step's wall time goes (CUDA runner): host time from the call to the moment its
  // kernels were all queued (checks, layout, uploads, plans, the graph launch), and the device
  // time of its kernels (events around them on the stream: from the uploads' end to the last
  // kernel's end, so a slow graph launch counts there too).
  double host_queue_ms = 0;
  double device_ms = 0;
};

class Runner {
 public:
  virtual ~Runner() = default;

  virtual const ModelConfig& config() const = 0;
  // "cpu", or the GPU's name.
  virtual std::string device() const = 0;
  // A pool whose pages this runner reads and writes (host memory for the CPU runner, device
  // memory for the CUDA one). Throws InvalidArgument for a format the backend cannot run.
  virtual std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) = 0;

  // One forward step. For each chunk: its tokens' rows are written into the pool (the pages must
  // have been reserved: CapacityError otherwise), every token attends over its sequence's rows up
  // to its own, the sequence's length is committed, and the requested rows are returned. A failed
  // step commits nothing. Throws InvalidArgument for an unknown sequence, an empty chunk, a token
  // id outside the vocabulary, a sequence named twice or a pool of another runner; ShapeError
  // for output spans of the wrong size. A runner takes one step at a time (it reuses its buffers
  // from step to step).
  virtual void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) = 0;
  // Counted by the CUDA runner; zeros where a backend does not count.
  virtual StepStats last_step_stats() const { return {}; }
  // The device's memory now (bytes free and in all), for sizing a cache from it; -1 both where
  // the backend has no device memory of its own (CPU).
  struct DeviceMemory {
    int64_t free = -1;
    int64_t total = -1;
  };
  virtual DeviceMemory device_memory() const { return {}; }
};

// The CPU runner over `model`, which must outlive it.
std::unique_ptr<Runner> make_cpu_runner(const Model& model);

// A runner without a model, for planning a serving run (bench-serve --schedule-only): a step
// computes nothing, commits each chunk's tokens and returns, for every logit row, a token that is
// not `config.eos_token_id` (so a request runs to its max_tokens or a stop token id of its own)
// and zero logits. Its pools hold no records, so a budget of any size costs no memory; the
// scheduler above it makes the same decisions as over a real runner with the same pages, since
// none depends on what the model computes.
std::unique_ptr<Runner> make_schedule_only_runner(const ModelConfig& config);

struct CudaRunnerOptions {
  int device = 0;
  // Largest number of tokens one step runs (sizes the activation workspace, allocated once).
  int64_t max_batch_tokens = 8192;
  // Largest number of sequences one step runs.
  int64_t max_sequences = 256;
  // Decode steps (every chunk one token) of up to this many sequences are captured as CUDA graphs,
  // one per batch size (and pool and block-table width), at their second occurrence, and replayed
  // after: one launch instead of hundreds. 0 turns graphs off.
  int64_t max_graph_tokens = 256;
  // Prefill chunks of at least 128 tokens whose sequences are at most this long run their
  // attention in the expanded form (keys and values up-projected, two cuBLAS products per query
  // tile; 3.4x fewer multiply-adds per key than the decode kernel's absorbed form); longer
  // sequences and shorter chunks go through the decode kernel. Sizes a workspace of about
  // 16 KiB per token of this context at 16 heads (allocated once). 0: always the decode kernel.
  int64_t prefill_expanded_max_context = 16384;
  // The runner's kernels as programmatic dependent launches (Hopper): each may be scheduled while
  // the previous one drains and waits for it before touching memory, which hides part of the
  // launch latency that dominates small decode steps, and lets the projections request their
  // weights during the previous kernel (skinny_gemm). Process-wide: the runner made last sets
  // it. Measured on an H200: 3.49 -> 3.15 ms a V2-Lite decode step at batch 1 (bench_runner
  // --no-pdl times the other way).
  bool programmatic_launch = true;
  // Steps of few tokens (decode) launch fewer kernels: each RMSNorm inside the product that reads
  // it, the cache write and the queries' RoPE as one launch, the shared experts as groups of the
  // routed experts' products with the mixture's combine in the down product's tail. false: the
  // separate kernels (bench_runner --no-fusion times them side by side).
  bool fused_decode = true;
  // How prefill-sized steps multiply the routed experts (decode-sized steps always take the
  // skinny grouped products). kCublas: cuBLAS's strided-batched products over every expert's rows
  // padded to the busiest expert's count, silu_mul between them. kOursGated: gate, up and the
  // activation by our grouped wgmma product (gpu::expert_gemm) over the same padded layout's real
  // rows only, then cuBLAS's padded down product. kOurs (the default): both products by
  // gpu::expert_gemm over the exact rows, the down product's outputs in BF16; a 2K prefill of
  // V2-Lite 4.6% faster than kOursGated over four A/B rounds (23.17 against 24.30 ms on average)
  // and steadier from one process to the next (docs/benchmarks.md, 2026-12-04). Ours where the
  // shapes allow (hidden a multiple of 128, moe_intermediate_size of 64), else kCublas.
  // bench_runner --experts times them side by side.
  enum class ExpertProducts { kCublas, kOursGated, kOurs };
  ExpertProducts expert_products = ExpertProducts::kOurs;
  // A token's arithmetic never depends on what shares its step, so its logits are the same bits
  // alone, in any batch, in a prefill chunk of any size, or recomputed after a preemption (vLLM's
  // VLLM_BATCH_INVARIANT, SGLang's deterministic inference): every product by one cuBLASLt
  // algorithm per shape whatever the rows (GemmRunner's batch_invariant), the routed experts over
  // their exact rows by gpu::expert_gemm (one cuBLASLt product per expert where its shapes do
  // not fit), prefill chunks through the decode kernel, and decode plans split by each token's
  // own length (DecodeSplit::kBatchInvariant). Turns off what would vary the arithmetic by the
  // step's size: the skinny kernel, fused_decode, the expanded prefill attention, CUDA graphs.
  // Slower (docs/serving.md has the figures); for reproducible outputs.
  bool batch_invariant = false;
  // Pinned host memory each pool allocates at its first swap (preemption by swap, --swap-space)
  // and moves a swapped sequence's pages through, as many whole pages at a time as it holds (at
  // least one): copies from pageable memory would each be a synchronous transfer staged by the
  // driver. 0: no staging, the copies straight from the scheduler's pageable memory (what a pool
  // falls back to where pinned memory is refused; bench_runner --swap times both).
  int64_t swap_staging_bytes = int64_t{32} << 20;
};

// The CUDA runner: the checkpoint at `model_dir` uploaded to the GPU as BF16. Throws
// InvalidArgument when this build has no CUDA support (configure with -DQUANTMLA_CUDA=ON) or for
// a model the kernels cannot run (naming what), CudaError when CUDA fails.
std::unique_ptr<Runner> make_cuda_runner(const std::filesystem::path& model_dir,
                                         const CudaRunnerOptions& options = {});

// Checks a step against its pool before any work (shared by the runners): every sequence known and
// named once, chunks non-empty, token ids in the vocabulary, pages reserved, output sizes.
void check_step(const StepBatch& batch, const PagePool& pool, const ModelConfig& config,
                const StepOutputs& outputs);

}  // namespace quantmla
