// The offline serving benchmark (`quantmla bench-serve`, the protocol of `vllm bench throughput`):
// random-token requests all submitted at t = 0, run to the end through the scheduler on a cache of
// a given byte budget, one cache format at a time, with throughput, concurrency, preemption and
// latency figures.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "quantmla/cache_format.h"
#include "quantmla/runner.h"
#include "quantmla/scheduler.h"

namespace quantmla {

struct ServeWorkload {
  int64_t num_prompts = 100;
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;  // lengths uniform in [L (1 - R), L (1 + R)] (vLLM's random dataset)
  uint64_t seed = 0;
};

// The workload's requests: uniform random token ids (no BOS), greedy, ignore_eos, max_tokens = the
// drawn output length. Throws InvalidArgument for non-positive counts or lengths, R outside
// [0, 1), or a length the model's positions cannot hold.
std::vector<Request> make_workload(const ServeWorkload& workload, const ModelConfig& config);

// One step of a run: its decodes, the keys they attend over (summed), its prefill tokens (prompt
// chunks and recomputation), the tokens it generated, what it left behind, its wall time and the
// runner's kernel time within it.
struct StepRecord {
  int64_t decodes = 0, decode_context = 0, prefill_tokens = 0;
  int64_t generated = 0;   // output tokens (decodes and the prefill chunks that completed)
  int64_t pages_used = 0;  // pages held after the step (sequences' pages, partial last ones too)
  int64_t waiting = 0;     // requests waiting to be admitted after the step (preempted too)
  int64_t swap_bytes = 0;  // records the step's swaps copied out and in (StepReport)
  double seconds = 0;
  double device_ms = 0;  // StepStats::device_ms (0 where the backend does not time its kernels)
};

struct ServeResult {
  std::string cache;
  int64_t bytes_per_token = 0;  // all layers
  int64_t pages = 0;            // pages the byte budget holds in this format
  double wall_s = 0, output_tok_s = 0, total_tok_s = 0, requests_s = 0;
  int64_t peak_seqs = 0;
  double mean_batch = 0;  // mean sequences decoded per step that decoded
  int64_t preemptions = 0, recomputed_tokens = 0, steps = 0;
  int64_t swapped_out = 0;        // of the preemptions, those by swap (--swap-space)
  int64_t peak_swap_bytes = 0;    // most swap space held at once
  int64_t swapped_out_bytes = 0;  // records copied out by the swaps (as many come back)
  double ttft_p50_ms = 0, ttft_p99_ms = 0, tpot_p50_ms = 0, tpot_p99_ms = 0;
  int64_t completed = 0, failed = 0;  // failed: refused at submission (never fits)
  // Where the wall time went, by kind of step: steps of decodes only, and steps that carried
  // prefill chunks (prompts, or recomputation after a preemption) with or without decodes.
  int64_t decode_steps = 0, prefill_steps = 0;
  double decode_steps_s = 0, prefill_steps_s = 0;
  // The runner's kernels over the whole run (the steps' device_ms summed): wall_s less this is
  // host time (scheduling, the runner's preparation, swaps, synchronization) the GPU waited out.
  double device_s = 0;
  int64_t output_tokens = 0, prompt_tokens = 0;
  // The run while requests waited: its steps up to the last one that left a request waiting. A
  // finite job ends in a drain (nothing left to admit, the running requests finishing one by one
  // at falling batches, ~output-len steps in every format), which is a larger share of a format
  // that holds more requests at once; this part is the steady state of a server whose queue never
  // empties (its pages or --max-seqs binding).
  int64_t queued_steps = 0, queued_output_tokens = 0;
  double queued_s = 0, queued_output_tok_s = 0;
  std::vector<StepRecord> step_log;           // every step, in order
  std::vector<std::vector<int32_t>> outputs;  // per request, in submission order (empty: failed)
};

// Progress of one run: (done, total, running, waiting), called about once a second.
using ServeProgress = std::function<void(int64_t, int64_t, int64_t, int64_t)>;

// How bench-serve warms the runner up on a format's pool before its timed run, so that the timed
// run meets its step shapes prepared (kernels loaded, GEMM plans chosen, CUDA graphs captured for
// that pool), as a serving engine has them once it has run a while, and the first format of a
// run pays no more one-time costs than the others.
enum class ServeWarmup {
  kNone,
  kShapes,  // warm_up_shapes: the step shapes alone, in seconds
  kFull,    // the whole workload once, untimed: exact, doubles the run's time
};
const char* to_string(ServeWarmup warmup);
// "none", "shapes" or "full"; throws InvalidArgument otherwise.
ServeWarmup parse_serve_warmup(const std::string& text);

// Runs, untimed, each step shape a backend may prepare on first use that the scheduler's steps
// with these options will take, on `pool` (left as it was found: every sequence it adds is
// removed): one prefill chunk of each power of two of tokens from 512 up to the step budget, and
// decode steps of every batch size from the largest down to 1, twice each, with the batch's
// longest sequence at one page and at each power of two of pages from 32 up to
// `longest_tokens`' pages (block tables of every width a backend may round to). Fewer where the
// pool's free pages do not suffice.
void warm_up_shapes(Runner& runner, PagePool& pool, const SchedulerOptions& options,
                    int64_t longest_tokens);

// Runs `requests` on a pool of `cache_bytes` in `format` (PagePool::pages_for_bytes), warmed up
// first as `warmup` says. Throws InvalidArgument when the budget holds no page.
ServeResult run_serve_bench(Runner& runner, const CacheFormat& format, int64_t cache_bytes,
                            const std::vector<Request>& requests, const SchedulerOptions& options,
                            const ServeProgress& progress = {},
                            ServeWarmup warmup = ServeWarmup::kNone);

// The p-quantile (p in [0, 1]) of `values`, linearly interpolated as numpy's default; 0 when empty.
double percentile(std::vector<double> values, double p);

// "8GiB", "512MiB", "1.5GB", "300000000": bytes. Throws InvalidArgument otherwise.
int64_t parse_byte_size(const std::string& text);

// vLLM's --gpu-memory-utilization U: the cache gets what is left of U x total_bytes after what the
// device already holds (total_bytes - free_bytes: this process's weights and buffers, and other
// processes'). Throws InvalidArgument, with the figures, for U outside (0, 1] or nothing left.
int64_t utilization_budget_bytes(double utilization, int64_t free_bytes, int64_t total_bytes);

}  // namespace quantmla
