// quantmla bench-serve: the offline throughput protocol of `vllm bench throughput` (random
// requests, all submitted at t = 0) through the scheduler, one cache format after another on the
// same requests and the same cache byte budget.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_online.h"
#include "commands.h"
#include "quantmla/error.h"
#include "quantmla/serve_bench.h"
#include "svg_plot.h"

namespace quantmla::cli {
namespace {

struct BenchServeOptions {
  std::string model = kDefaultModel;
  std::string device = "cpu";
  bool batch_invariant = false;
  bool schedule_only = false;
  ServeWorkload workload;
  std::vector<std::string> caches;
  std::string cache_memory = "64MiB";
  std::optional<double> gpu_memory_utilization;
  SchedulerOptions scheduler;
  int64_t check_outputs = 0;
  std::string warmup;  // empty: shapes on a GPU (CUDA graphs, kernel loading), none elsewhere
  std::string json, plot, step_log;
  OnlineOptions online;  // --url: against a running server
};

// --schedule-only: the schedule's figures (no time was measured).
void print_schedule_row(const ServeResult& r) {
  std::printf("%-34s %7lld %5lld %6.1f %6lld %7lld %7lld %6lld %6lld %8lld %9lld %4lld/%lld\n",
              r.cache.c_str(), static_cast<long long>(r.pages), static_cast<long long>(r.peak_seqs),
              r.mean_batch, static_cast<long long>(r.steps), static_cast<long long>(r.queued_steps),
              static_cast<long long>(r.decode_steps), static_cast<long long>(r.prefill_steps),
              static_cast<long long>(r.preemptions), static_cast<long long>(r.recomputed_tokens),
              static_cast<long long>(r.prompt_tokens + r.recomputed_tokens),
              static_cast<long long>(r.completed), static_cast<long long>(r.completed + r.failed));
  std::fflush(stdout);
}

// --step-log: one CSV line a step (its decodes, the keys they attend over, its prefill tokens, the
// tokens it generated, the pages held and the requests waiting after it, the bytes its swaps
// copied, and its wall time when the model ran), to see how the step time grows with the batch
// or to cost a schedule.
void write_step_log(const std::string& path, const std::vector<ServeResult>& results, bool timed) {
  std::ofstream file(path, std::ios::trunc);
  if (!file) throw IoError("cannot write " + path);
  file << "cache,step,decodes,decode_context,prefill_tokens,generated,pages_used,waiting,swap_bytes"
       << (timed ? ",step_ms,device_ms" : "") << "\n";
  for (const ServeResult& r : results) {
    for (size_t i = 0; i < r.step_log.size(); ++i) {
      const StepRecord& s = r.step_log[i];
      file << '"' << r.cache << "\"," << i << ',' << s.decodes << ',' << s.decode_context << ','
           << s.prefill_tokens << ',' << s.generated << ',' << s.pages_used << ',' << s.waiting
           << ',' << s.swap_bytes;
      if (timed) file << ',' << s.seconds * 1e3 << ',' << s.device_ms;
      file << '\n';
    }
  }
  if (!file) throw IoError("cannot write " + path);
}

void print_row(const ServeResult& r) {
  std::printf(
      "%-34s %7lld %7.2f %9.1f %9.1f %9.1f %5lld %6.1f %6lld %8lld %8.0f %8.0f %7.1f %7.1f "
      "%8.0f%% %4lld/%lld\n",
      r.cache.c_str(), static_cast<long long>(r.pages), r.wall_s, r.output_tok_s, r.total_tok_s,
      r.queued_output_tok_s, static_cast<long long>(r.peak_seqs), r.mean_batch,
      static_cast<long long>(r.preemptions), static_cast<long long>(r.recomputed_tokens),
      r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms, r.tpot_p99_ms,
      100.0 * r.prefill_steps_s / r.wall_s, static_cast<long long>(r.completed),
      static_cast<long long>(r.completed + r.failed));
  std::fflush(stdout);
}

// bench-serve --url: the same workload sent to a running server.
void run_bench_online_cli(const BenchServeOptions& options) {
  const ModelConfig config =
      ModelConfig::from_file(std::filesystem::path(options.model) / "config.json");
  const std::vector<Request> requests = make_workload(options.workload, config);
  std::fprintf(stderr, "bench-serve: %lld requests to %s, concurrency %lld, rate %.2f/s\n",
               static_cast<long long>(requests.size()), options.online.url.c_str(),
               static_cast<long long>(options.online.concurrency), options.online.request_rate);
  const OnlineResult r = run_bench_online(requests, options.online);
  std::printf("%-28s %7s %9s %9s %8s %8s %7s %7s %7s %7s %s\n", "url", "wall s", "out tok/s",
              "tot tok/s", "ttft p50", "ttft p99", "tpot 50", "tpot 99", "itl 50", "itl 99",
              "done");
  std::printf("%-28s %7.2f %9.1f %9.1f %8.0f %8.0f %7.1f %7.1f %7.1f %7.1f %lld/%zu\n",
              options.online.url.c_str(), r.wall_s, r.output_tok_s, r.total_tok_s, r.ttft_p50_ms,
              r.ttft_p99_ms, r.tpot_p50_ms, r.tpot_p99_ms, r.itl_p50_ms, r.itl_p99_ms,
              static_cast<long long>(r.completed), requests.size());
  if (r.failed > 0) {
    std::fprintf(stderr, "bench-serve: %lld requests failed, the first: %s\n",
                 static_cast<long long>(r.failed), r.first_error.c_str());
  }
  if (!options.json.empty()) {
    const nlohmann::json out = {{"url", options.online.url},
                                {"requests", requests.size()},
                                {"input_len", options.workload.input_len},
                                {"output_len", options.workload.output_len},
                                {"concurrency", options.online.concurrency},
                                {"request_rate", options.online.request_rate},
                                {"wall_s", r.wall_s},
                                {"output_tok_s", r.output_tok_s},
                                {"total_tok_s", r.total_tok_s},
                                {"requests_s", r.requests_s},
                                {"ttft_p50_ms", r.ttft_p50_ms},
                                {"ttft_p99_ms", r.ttft_p99_ms},
                                {"tpot_p50_ms", r.tpot_p50_ms},
                                {"tpot_p99_ms", r.tpot_p99_ms},
                                {"itl_p50_ms", r.itl_p50_ms},
                                {"itl_p99_ms", r.itl_p99_ms},
                                {"completed", r.completed},
                                {"failed", r.failed},
                                {"output_tokens", r.output_tokens}};
    std::ofstream file(options.json, std::ios::trunc);
    if (!file) throw IoError("cannot write " + options.json);
    file << out.dump(2) << "\n";
  }
  if (r.completed == 0) throw IoError("bench-serve: no request completed: " + r.first_error);
}

void run_bench_serve(const BenchServeOptions& options) {
  if (options.schedule_only && (!options.online.url.empty() || options.device != "cpu" ||
                                options.batch_invariant || options.check_outputs > 0)) {
    throw InvalidArgument(
        "--schedule-only runs no model: it takes no --url, --device, --batch-invariant or "
        "--check-outputs");
  }
  if (!options.online.url.empty()) {
    run_bench_online_cli(options);
    return;
  }
  std::unique_ptr<Model> model;
  const std::unique_ptr<Runner> runner =
      options.schedule_only ? make_schedule_only_runner(ModelConfig::from_file(
                                  std::filesystem::path(options.model) / "config.json"))
                            : make_runner(options.device, options.model, {}, model,
                                          &options.scheduler, options.batch_invariant);
  const std::vector<Request> requests = make_workload(options.workload, runner->config());
  const int64_t bytes =
      cache_budget_bytes(options.cache_memory, options.gpu_memory_utilization, *runner);
  const ServeWarmup warmup = !options.warmup.empty()    ? parse_serve_warmup(options.warmup)
                             : options.device == "cuda" ? ServeWarmup::kShapes
                                                        : ServeWarmup::kNone;
  std::vector<std::string> caches = options.caches;
  if (caches.empty()) caches = {"bf16"};
  std::fprintf(stderr,
               "bench-serve: %lld requests (input %lld, output %lld, range %.2f, seed %llu) "
               "on %s%s, %lld bytes of cache, warm-up %s\n",
               static_cast<long long>(requests.size()),
               static_cast<long long>(options.workload.input_len),
               static_cast<long long>(options.workload.output_len), options.workload.range_ratio,
               static_cast<unsigned long long>(options.workload.seed), runner->device().c_str(),
               options.batch_invariant ? " (batch-invariant)" : "", static_cast<long long>(bytes),
               to_string(warmup));
  if (options.schedule_only) {
    std::printf("%-34s %7s %5s %6s %6s %6s %7s %7s %6s %8s %9s %s\n", "cache", "pages", "peak",
                "batch", "steps", "queued", "decode", "prefill", "preem", "recomp", "prefilled",
                "done");
  } else {
    // "queued/s": output tok/s over the steps that left requests waiting (before the drain).
    std::printf("%-34s %7s %7s %9s %9s %9s %5s %6s %6s %8s %8s %8s %7s %7s %9s %s\n", "cache",
                "pages", "wall s", "out tok/s", "tot tok/s", "queued/s", "peak", "batch", "preem",
                "recomp", "ttft p50", "ttft p99", "tpot 50", "tpot 99", "prefill %", "done");
  }
  std::vector<ServeResult> results;
  for (const std::string& spec : caches) {
    const CacheFormat format = CacheFormat::parse(spec);
    results.push_back(run_serve_bench(
        *runner, format, bytes, requests, options.scheduler,
        [&](int64_t done, int64_t total, int64_t running, int64_t waiting) {
          std::fprintf(stderr,
                       "  %s: %lld/%lld done, %lld running, %lld "
                       "waiting\n",
                       spec.c_str(), static_cast<long long>(done), static_cast<long long>(total),
                       static_cast<long long>(running), static_cast<long long>(waiting));
        },
        warmup));
    if (options.schedule_only) {
      print_schedule_row(results.back());
    } else {
      print_row(results.back());
    }
  }
  // Greedy outputs of the first requests with and without preemption: the format that preempted
  // most, its first K requests alone in a budget that holds them all.
  nlohmann::json check = nullptr;
  if (options.check_outputs > 0) {
    size_t worst = 0;
    for (size_t i = 0; i < results.size(); ++i) {
      if (results[i].preemptions > results[worst].preemptions) worst = i;
    }
    const int64_t k =
        std::min<int64_t>(options.check_outputs, static_cast<int64_t>(requests.size()));
    const std::vector<Request> sample(requests.begin(), requests.begin() + k);
    int64_t roomy = 0;
    for (const Request& r : sample) {
      roomy += PagePool::pages_for_tokens(static_cast<int64_t>(r.prompt.size()) + r.max_tokens);
    }
    const CacheFormat format = CacheFormat::parse(caches[worst]);
    const ModelConfig& c = runner->config();
    const int64_t page_bytes =
        PagePool::bytes_per_page({c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim}, format);
    SchedulerOptions alone = options.scheduler;
    alone.max_seqs = std::max<int64_t>(alone.max_seqs, k);
    const ServeResult free_run =
        run_serve_bench(*runner, format, (roomy + 1) * page_bytes, sample, alone);
    // Where the two runs part: each request's tokens before the first that differs, so that a
    // late flip of a near tie reads apart from outputs wrong from the start.
    int64_t same = 0;
    std::vector<int64_t> common(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
      const std::vector<int32_t>& a = free_run.outputs[i];
      const std::vector<int32_t>& b = results[worst].outputs[i];
      same += a == b;
      common[i] = std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
    }
    std::vector<int64_t> sorted = common;
    std::sort(sorted.begin(), sorted.end());
    std::printf(
        "greedy outputs of the first %lld requests, %s with %lld preemptions vs none: "
        "%lld identical; tokens before the first difference: median %lld, min %lld, max %lld\n",
        static_cast<long long>(k), caches[worst].c_str(),
        static_cast<long long>(results[worst].preemptions), static_cast<long long>(same),
        static_cast<long long>(sorted[sorted.size() / 2]), static_cast<long long>(sorted.front()),
        static_cast<long long>(sorted.back()));
    std::fflush(stdout);
    check = {{"cache", caches[worst]},
             {"requests", k},
             {"preemptions_in_run", results[worst].preemptions},
             {"preemptions_alone", free_run.preemptions},
             {"identical", same},
             {"common_prefix_tokens", common}};
  }
  if (!options.step_log.empty()) write_step_log(options.step_log, results, !options.schedule_only);
  if (!options.json.empty()) {
    nlohmann::json formats = nlohmann::json::array();
    for (const ServeResult& r : results) {
      nlohmann::json row = {{"cache", r.cache},
                            {"bytes_per_token", r.bytes_per_token},
                            {"pages", r.pages},
                            {"peak_seqs", r.peak_seqs},
                            {"mean_batch", r.mean_batch},
                            {"steps", r.steps},
                            {"preemptions", r.preemptions},
                            {"recomputed_tokens", r.recomputed_tokens},
                            {"swapped_out", r.swapped_out},
                            {"peak_swap_bytes", r.peak_swap_bytes},
                            {"swapped_out_bytes", r.swapped_out_bytes},
                            {"completed", r.completed},
                            {"failed", r.failed},
                            {"output_tokens", r.output_tokens},
                            {"prompt_tokens", r.prompt_tokens},
                            {"decode_steps", r.decode_steps},
                            {"prefill_steps", r.prefill_steps},
                            {"queued_steps", r.queued_steps},
                            {"queued_output_tokens", r.queued_output_tokens}};
      // --schedule-only: the host time of steps that computed nothing is no figure of any device.
      if (!options.schedule_only) {
        row.update({{"wall_s", r.wall_s},
                    {"output_tok_s", r.output_tok_s},
                    {"total_tok_s", r.total_tok_s},
                    {"requests_s", r.requests_s},
                    {"ttft_p50_ms", r.ttft_p50_ms},
                    {"ttft_p99_ms", r.ttft_p99_ms},
                    {"tpot_p50_ms", r.tpot_p50_ms},
                    {"tpot_p99_ms", r.tpot_p99_ms},
                    {"decode_steps_s", r.decode_steps_s},
                    {"prefill_steps_s", r.prefill_steps_s},
                    {"device_s", r.device_s},
                    {"queued_s", r.queued_s},
                    {"queued_output_tok_s", r.queued_output_tok_s}});
      }
      formats.push_back(row);
    }
    const nlohmann::json out = {{"device", runner->device()},
                                {"model", options.model},
                                {"requests", requests.size()},
                                {"input_len", options.workload.input_len},
                                {"output_len", options.workload.output_len},
                                {"random_range_ratio", options.workload.range_ratio},
                                {"seed", options.workload.seed},
                                {"max_batched_tokens", options.scheduler.max_batched_tokens},
                                {"max_seqs", options.scheduler.max_seqs},
                                {"swap_space_bytes", options.scheduler.swap_space_bytes},
                                {"batch_invariant", options.batch_invariant},
                                {"schedule_only", options.schedule_only},
                                {"warmup", to_string(warmup)},
                                {"cache_memory_bytes", bytes},
                                {"formats", formats},
                                {"preemption_check", check}};
    std::ofstream file(options.json, std::ios::trunc);
    if (!file) throw IoError("cannot write " + options.json);
    file << out.dump(2) << "\n";
  }
  if (!options.plot.empty()) {
    // --schedule-only measured no time: its first panel is the mean decode batch instead.
    PlotPanel throughput =
        options.schedule_only
            ? PlotPanel{"mean decode batch", "cache bytes per token", "sequences a step", {}}
            : PlotPanel{"output throughput", "cache bytes per token", "output tokens/s", {}};
    PlotPanel concurrency{"peak concurrent sequences", "cache bytes per token", "sequences", {}};
    for (const ServeResult& r : results) {
      throughput.points.push_back({static_cast<double>(r.bytes_per_token),
                                   options.schedule_only ? r.mean_batch : r.output_tok_s, r.cache});
      concurrency.points.push_back(
          {static_cast<double>(r.bytes_per_token), static_cast<double>(r.peak_seqs), r.cache});
    }
    std::ofstream file(options.plot, std::ios::trunc);
    if (!file) throw IoError("cannot write " + options.plot);
    file << render_svg("bench-serve: " + std::to_string(requests.size()) + " requests, " +
                           std::to_string(bytes >> 20) + " MiB of cache on " + runner->device(),
                       {throughput, concurrency});
  }
}

}  // namespace

void add_bench_serve(CLI::App& app) {
  auto o = std::make_shared<BenchServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench-serve",
      "Offline serving throughput (vllm bench throughput's protocol): random requests through the "
      "scheduler on a cache byte budget, for each --cache format");
  cmd->add_option("--model", o->model, "Model directory")->capture_default_str();
  add_device_option(*cmd, o->device);
  add_batch_invariant_option(*cmd, o->batch_invariant);
  cmd->add_flag("--schedule-only", o->schedule_only,
                "Run the scheduler without the model (only --model's config.json is read): the "
                "pages, concurrency, mean decode batch, steps and preemptions each format's budget "
                "gives, in seconds on any machine; no time is measured");
  cmd->add_option("--num-prompts", o->workload.num_prompts, "Requests")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--input-len", o->workload.input_len, "Prompt tokens")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--output-len", o->workload.output_len, "Generated tokens (ignore_eos)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--random-range-ratio", o->workload.range_ratio,
                  "Lengths uniform in [L(1-R), L(1+R)]; 0 = fixed")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.999));
  cmd->add_option("--seed", o->workload.seed, "Seed of the random requests")->capture_default_str();
  cmd->add_option("--cache", o->caches,
                  "Cache format; repeat to run several on the same requests (default bf16)");
  CLI::Option* cache_memory =
      cmd->add_option("--cache-memory", o->cache_memory,
                      "Cache budget: a size (512MiB, 8GiB) or a fraction of free GPU memory (0.9)")
          ->capture_default_str();
  add_gpu_memory_utilization(*cmd, cache_memory, o->gpu_memory_utilization);
  cmd->add_option("--max-batched-tokens,--max-num-batched-tokens", o->scheduler.max_batched_tokens,
                  "Tokens one step runs (decodes + prefill chunks; vLLM's name as an alias)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-seqs,--max-num-seqs", o->scheduler.max_seqs,
                  "Sequences one step runs (vLLM's name as an alias)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  add_swap_space(*cmd, o->scheduler.swap_space_bytes);
  cmd->add_option("--check-outputs", o->check_outputs,
                  "Rerun the first K requests without cache pressure and compare greedy outputs")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option(
         "--warmup", o->warmup,
         "Before each format's timed run, on its pool: none; shapes (each step shape "
         "once or twice, seconds); full (the whole workload once, untimed). Default: shapes "
         "with --device cuda (CUDA graphs and kernels ready, as in a server that has run "
         "a while; measured to give full's figures), none elsewhere")
      ->check(CLI::IsMember({"none", "shapes", "full"}));
  cmd->add_option("--json,--output-json", o->json,
                  "Write the results as JSON to this file (vLLM's name as an alias)");
  cmd->add_option("--plot", o->plot, "Write an SVG plot of throughput and concurrency");
  cmd->add_option("--step-log", o->step_log,
                  "Write every step (cache, step, decodes, their keys, prefill tokens, tokens "
                  "generated, pages held, requests waiting, swap bytes, ms) to this CSV");
  cmd->add_option("--url", o->online.url,
                  "Online: send the requests to a running server (http://HOST:PORT) instead; "
                  "--model then only gives the vocabulary (config.json)");
  cmd->add_option("--concurrency", o->online.concurrency,
                  "Online: requests in flight at most (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--request-rate", o->online.request_rate,
                  "Online: Poisson arrivals per second (0 = all at t = 0)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--api-key", o->online.api_key, "Online: the server's API key");
  cmd->add_option("--served-model-name", o->online.model_name,
                  "Online: the model name to put in the requests");
  cmd->callback([o] {
    o->online.seed = o->workload.seed;
    run_bench_serve(*o);
  });
}

}  // namespace quantmla::cli
