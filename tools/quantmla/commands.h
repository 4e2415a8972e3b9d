// Subcommands of the `quantmla` program. Each registers its options on the app and runs when
// chosen.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "quantmla/eval.h"
#include "quantmla/model.h"
#include "quantmla/runner.h"
#include "quantmla/scheduler.h"

namespace quantmla::cli {

// Default model directory: the bundled model, relative to the working directory.
inline constexpr const char* kDefaultModel = "models/mla-tiny";
// One sequence of this many tokens is the yardstick for physical cache memory and compression.
inline constexpr int64_t kLongSequence = 128 * 1024;

// --transform none|hadamard and --seed S on `cmd`; apply_transform() folds the chosen one.
struct TransformOption {
  std::string name = "none";
  uint64_t seed = 0;
};
void add_transform_options(CLI::App& cmd, TransformOption& option);
// Loads the model at `dir` and folds the transform into it (none: as loaded).
Model load_transformed(const std::string& dir, const TransformOption& option);

// --device cpu|cuda: the backend a command runs on.
void add_device_option(CLI::App& cmd, std::string& device);
// --batch-invariant: the CUDA runner's reproducible mode (CudaRunnerOptions::batch_invariant).
void add_batch_invariant_option(CLI::App& cmd, bool& batch_invariant);
// The engine a command runs: the CPU runner over a model loaded (with its transform) into `holder`,
// or the CUDA runner over the checkpoint (which refuses a transform: it uploads the weights as
// stored). scheduler: the steps a serving command's scheduler makes (--max-batched-tokens,
// --max-seqs), which the CUDA runner is sized for (at least its defaults); null: the defaults.
// batch_invariant: the CUDA runner's batch-invariant mode (InvalidArgument on the CPU).
std::unique_ptr<Runner> make_runner(const std::string& device, const std::string& model_dir,
                                    const TransformOption& transform,
                                    std::unique_ptr<Model>& holder,
                                    const SchedulerOptions* scheduler = nullptr,
                                    bool batch_invariant = false);
// The cache a command runs with on `device`: cache_spec_or_recorded(), where the CPU fallback
// `fallback` becomes bf16 on the GPU (which has no f32 cache).
CacheFormat device_cache(const std::string& device, const std::string& model_dir,
                         const std::string& given, const std::string& fallback);

// --cache-memory: a size ("8GiB", parse_byte_size) or a fraction of the device memory free after
// loading ("0.9", CUDA only: InvalidArgument on the CPU); with --gpu-memory-utilization U set,
// vLLM's rule instead (utilization_budget_bytes, CUDA only).
int64_t cache_budget_bytes(const std::string& text, std::optional<double> gpu_memory_utilization,
                           const Runner& runner);

// --swap-space GiB (vLLM's flag) into `bytes`: host memory for preempted requests' records
// (SchedulerOptions::swap_space_bytes; 0, the default, preempts by recompute only).
void add_swap_space(CLI::App& cmd, int64_t& bytes);

// --gpu-memory-utilization, exclusive with --cache-memory.
void add_gpu_memory_utilization(CLI::App& cmd, CLI::Option* cache_memory,
                                std::optional<double>& utilization);

// --ctx N and --max-windows K, the window protocol's options shared by the evaluators.
void add_window_options(CLI::App& cmd, int64_t& ctx, int64_t& max_windows);
// --ids FILE (required, must exist).
void add_ids_option(CLI::App& cmd, std::string& ids);

// The cache spec a command runs with: `given` when the user passed one; else the spec `quantmla
// calibrate` recorded in MODEL_DIR/config.json, announced on stderr; else `fallback`.
std::string cache_spec_or_recorded(const std::string& model_dir, const std::string& given,
                                   const std::string& fallback);

// What eval-kld and compare share: the model (with its transform), the ids, the windows and the
// baseline. run_kld() measures `formats` against the baseline cache of `baseline_model`, by default
// the model under test as loaded (without --transform).
struct KldRun {
  std::string model = kDefaultModel;
  std::string baseline_model;  // "" = `model`
  std::string ids;
  int64_t ctx = 1024;
  int64_t first_window = 0;
  int64_t max_windows = 0;
  std::string baseline = "bf16";
  TransformOption transform;
  std::string device = "cpu";
};
void add_kld_run_options(CLI::App& cmd, KldRun& run);
std::vector<KldResult> run_kld(const KldRun& run, const std::vector<CacheFormat>& formats,
                               const char* progress_label);

void add_info(CLI::App& app);
void add_generate(CLI::App& app);
void add_eval_ppl(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_render_chat(CLI::App& app);
void add_eval_kld(CLI::App& app);
void add_compare(CLI::App& app);
void add_compare_merge(CLI::App& app);
void add_error_model(CLI::App& app);
void add_calibrate(CLI::App& app);
void add_eval_passkey(CLI::App& app);
void add_make_random_model(CLI::App& app);
void add_bench_serve(CLI::App& app);
void add_serve(CLI::App& app);

}  // namespace quantmla::cli
