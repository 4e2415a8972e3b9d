#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "progress.h"
#include "quantmla/config.h"
#include "quantmla/error.h"
#include "quantmla/io.h"
#include "quantmla/serve_bench.h"
#include "quantmla/transform.h"

namespace quantmla::cli {

std::string cache_spec_or_recorded(const std::string& model_dir, const std::string& given,
                                   const std::string& fallback) {
  if (!given.empty()) return given;
  const std::filesystem::path config_file = std::filesystem::path(model_dir) / "config.json";
  const std::string recorded = ModelConfig::from_file(config_file).quantmla_cache;
  if (recorded.empty()) return fallback;
  // Said out loud: the run's figures belong to a format the user did not type.
  std::fprintf(stderr, "cache %s (recorded in %s by quantmla calibrate)\n",
               CacheFormat::parse(recorded).to_string().c_str(), config_file.string().c_str());
  return recorded;
}

void add_transform_options(CLI::App& cmd, TransformOption& option) {
  cmd.add_option("--transform", option.name,
                 "Content-path transform folded into the weights: none | hadamard "
                 "(random-sign Walsh-Hadamard rotation per layer)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "hadamard"}));
  cmd.add_option("--seed", option.seed, "Seed of the transform's random signs")
      ->capture_default_str();
}

void add_window_options(CLI::App& cmd, int64_t& ctx, int64_t& max_windows) {
  cmd.add_option("--ctx", ctx, "Window length including BOS")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  cmd.add_option("--max-windows", max_windows, "Score at most K windows (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

void add_ids_option(CLI::App& cmd, std::string& ids) {
  cmd.add_option("--ids", ids, "Token ids, little-endian int32, no BOS")
      ->required()
      ->check(CLI::ExistingFile);
}

void add_device_option(CLI::App& cmd, std::string& device) {
  cmd.add_option("--device", device, "Backend: cpu, or cuda (a build with -DQUANTMLA_CUDA=ON)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
}

void add_batch_invariant_option(CLI::App& cmd, bool& batch_invariant) {
  cmd.add_flag("--batch-invariant", batch_invariant,
               "CUDA: a request's tokens do not depend on what shares its steps (the same greedy "
               "output alone, batched or after a preemption), at some speed (docs/serving.md)");
}

std::unique_ptr<Runner> make_runner(const std::string& device, const std::string& model_dir,
                                    const TransformOption& transform,
                                    std::unique_ptr<Model>& holder,
                                    const SchedulerOptions* scheduler, bool batch_invariant) {
  if (batch_invariant && device != "cuda") {
    throw InvalidArgument(
        "--batch-invariant is a mode of the CUDA runner (--device cuda), not of " + device);
  }
  if (device == "cuda") {
    if (transform.name != "none") {
      throw InvalidArgument("--transform " + transform.name +
                            " runs on the CPU only: save a transformed model (quantmla calibrate) "
                            "and run that on the GPU");
    }
    CudaRunnerOptions options;
    if (scheduler != nullptr) {
      // A step holds at most the token budget, or one decode token per running sequence.
      options.max_batch_tokens =
          std::max({options.max_batch_tokens, scheduler->max_batched_tokens, scheduler->max_seqs});
      options.max_sequences = std::max(options.max_sequences, scheduler->max_seqs);
    }
    options.batch_invariant = batch_invariant;
    return make_cuda_runner(model_dir, options);
  }
  holder = std::make_unique<Model>(load_transformed(model_dir, transform));
  return make_cpu_runner(*holder);
}

CacheFormat device_cache(const std::string& device, const std::string& model_dir,
                         const std::string& given, const std::string& fallback) {
  return CacheFormat::parse(cache_spec_or_recorded(
      model_dir, given, device == "cuda" && fallback == "f32" ? "bf16" : fallback));
}

Model load_transformed(const std::string& dir, const TransformOption& option) {
  Model model = Model::load(dir);
  if (option.name == "hadamard") fold_random_hadamard(model, option.seed);
  return model;
}

void add_kld_run_options(CLI::App& cmd, KldRun& run) {
  cmd.add_option("--model", run.model, "Model directory")->capture_default_str();
  add_ids_option(cmd, run.ids);
  add_window_options(cmd, run.ctx, run.max_windows);
  cmd.add_option("--first-window", run.first_window,
                 "Start at window N (0-based), to split one evaluation across processes")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd.add_option("--baseline", run.baseline, "Cache format of the reference distribution")
      ->capture_default_str();
  cmd.add_option("--baseline-model", run.baseline_model,
                 "Model whose --baseline cache gives the reference distribution, e.g. the "
                 "original of a saved calibrated model (default: --model, without --transform)")
      ->check(CLI::ExistingDirectory);
  add_transform_options(cmd, run.transform);
  add_device_option(cmd, run.device);
}

std::vector<KldResult> run_kld(const KldRun& run, const std::vector<CacheFormat>& formats,
                               const char* progress_label) {
  std::unique_ptr<Model> model, original;
  const std::unique_ptr<Runner> runner = make_runner(run.device, run.model, run.transform, model);
  // The reference distribution: the baseline model (by default this one without its --transform)
  // with the baseline cache. On the GPU without a separate baseline model: the same runner.
  std::unique_ptr<Runner> baseline;
  if (!run.baseline_model.empty() || (run.transform.name != "none" && run.device == "cpu")) {
    baseline = make_runner(run.device, run.baseline_model.empty() ? run.model : run.baseline_model,
                           {}, original);
  }
  const std::vector<int32_t> ids = read_ids_file(run.ids);
  ProgressBar progress(progress_label);
  KldOptions options;
  options.ctx = run.ctx;
  options.first_window = run.first_window;
  options.max_windows = run.max_windows;
  options.baseline = CacheFormat::parse(run.baseline);
  options.baseline_runner = baseline.get();
  if (run.device == "cpu") options.windows_per_step = 1;  // one window fills the cores
  options.progress = [&](int64_t done, int64_t total) { progress.update(done, total); };
  return evaluate_kld(*runner, ids, formats, options);
}

// --cache-memory: a size ("8GiB") or a fraction of the device memory free after loading ("0.9");
// --gpu-memory-utilization U instead: what is left of U x the device's memory.
int64_t cache_budget_bytes(const std::string& text, std::optional<double> gpu_memory_utilization,
                           const Runner& runner) {
  const Runner::DeviceMemory memory = runner.device_memory();
  if (gpu_memory_utilization) {
    if (memory.total < 0) {
      throw InvalidArgument(
          "--gpu-memory-utilization sizes the cache from the device's memory and needs --device "
          "cuda; give --cache-memory a size such as 512MiB");
    }
    return utilization_budget_bytes(*gpu_memory_utilization, memory.free, memory.total);
  }
  size_t end = 0;
  double fraction = -1.0;
  try {
    fraction = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  if (end == text.size() && fraction > 0.0 && fraction <= 1.0) {
    const int64_t free_bytes = memory.free;
    if (free_bytes < 0) {
      throw InvalidArgument("--cache-memory " + text +
                            ": a fraction of free device memory needs --device cuda; give a size "
                            "such as 512MiB");
    }
    return static_cast<int64_t>(fraction * static_cast<double>(free_bytes));
  }
  return parse_byte_size(text);
}

void add_swap_space(CLI::App& cmd, int64_t& bytes) {
  cmd.add_option_function<double>(
         "--swap-space",
         [&bytes](double gib) { bytes = static_cast<int64_t>(gib * double(int64_t{1} << 30)); },
         "GiB of host memory for the cache records of preempted requests (vLLM's flag): a "
         "preemption copies them out and back instead of recomputing them while they fit; 0: "
         "recompute only (the default)")
      ->check(CLI::Range(0.0, 1024.0));
}

void add_gpu_memory_utilization(CLI::App& cmd, CLI::Option* cache_memory,
                                std::optional<double>& utilization) {
  cmd.add_option("--gpu-memory-utilization", utilization,
                 "CUDA, vLLM's rule: the cache gets what is left of this fraction of the device's "
                 "memory after the model, its buffers and other processes (instead of "
                 "--cache-memory)")
      ->excludes(cache_memory);
}

}  // namespace quantmla::cli
