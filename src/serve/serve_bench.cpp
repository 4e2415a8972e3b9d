// bench-serve's workload, run and figures.
#include "quantmla/serve_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>

#include "quantmla/error.h"

namespace quantmla {
double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = p * static_cast<double>(values.size() - 1);
  const size_t low = static_cast<size_t>(std::floor(rank));
  const size_t high = std::min(low + 1, values.size() - 1);
  return values[low] + (rank - static_cast<double>(low)) * (values[high] - values[low]);
}

std::vector<Request> make_workload(const ServeWorkload& w, const ModelConfig& config) {
  if (w.num_prompts < 1 || w.input_len < 1 || w.output_len < 1 || !(w.range_ratio >= 0.0) ||
      w.range_ratio >= 1.0) {
    throw InvalidArgument("workload: num_prompts " + std::to_string(w.num_prompts) +
                          ", input_len " + std::to_string(w.input_len) + ", output_len " +
                          std::to_string(w.output_len) + ", range ratio " +
                          std::to_string(w.range_ratio) +
                          " (need positive counts and a ratio in [0, 1))");
  }
  const auto range = [&](int64_t len) {
    const int64_t low = std::max<int64_t>(
        1, static_cast<int64_t>(std::floor(static_cast<double>(len) * (1.0 - w.range_ratio))));
    const int64_t high =
        static_cast<int64_t>(std::ceil(static_cast<double>(len) * (1.0 + w.range_ratio)));
    return std::uniform_int_distribution<int64_t>(low, std::max(low, high));
  };
  const int64_t longest = static_cast<int64_t>(
      std::ceil(static_cast<double>(w.input_len + w.output_len) * (1.0 + w.range_ratio)));
  if (longest > config.max_position_embeddings) {
    throw InvalidArgument("workload: requests of up to " + std::to_string(longest) +
                          " tokens, the model holds " +
                          std::to_string(config.max_position_embeddings) + " positions");
  }
  std::mt19937_64 rng(w.seed);
  auto input = range(w.input_len);
  auto output = range(w.output_len);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<Request> requests;
  for (int64_t i = 0; i < w.num_prompts; ++i) {
    Request r;
    const int64_t len = input(rng);
    for (int64_t t = 0; t < len; ++t) r.prompt.push_back(token(rng));
    r.max_tokens = output(rng);
    r.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  return requests;
}

const char* to_string(ServeWarmup warmup) {
  switch (warmup) {
    case ServeWarmup::kNone:
      return "none";
    case ServeWarmup::kShapes:
      return "shapes";
    case ServeWarmup::kFull:
      return "full";
  }
  return "?";
}

ServeWarmup parse_serve_warmup(const std::string& text) {
  for (const ServeWarmup w : {ServeWarmup::kNone, ServeWarmup::kShapes, ServeWarmup::kFull}) {
    if (text == to_string(w)) return w;
  }
  throw InvalidArgument("warm-up \"" + text + "\": expected none, shapes or full");
}

void warm_up_shapes(Runner& runner, PagePool& pool, const SchedulerOptions& options,
                    int64_t longest_tokens) {
  // Any id of the vocabulary will do: nothing the steps compute is kept.
  const std::vector<int32_t> tokens(
      static_cast<size_t>(std::max<int64_t>(options.max_batched_tokens, 1)), 0);
  const auto chunk = [&](SequenceId sequence, int64_t count, LogitRows logits) {
    return SequenceChunk{
        sequence, std::span<const int32_t>(tokens).first(static_cast<size_t>(count)), logits, {}};
  };
  std::vector<int32_t> sampled(static_cast<size_t>(options.max_seqs));
  const int64_t max_tokens = runner.config().max_position_embeddings;

  // Prefill chunks: a backend may choose a GEMM plan for each power-of-two bucket of rows.
  for (int64_t count = 512;
       count <= options.max_batched_tokens &&
       PagePool::pages_for_tokens(count) <= pool.free_pages() && count <= max_tokens;
       count *= 2) {
    const SequenceId sequence = pool.add_sequence();
    pool.reserve(sequence, count);
    runner.step({{chunk(sequence, count, LogitRows::kLast)}}, pool,
                {{}, std::span<int32_t>(sampled).first(1)});
    pool.remove_sequence(sequence);
  }

  // Decode steps of every batch size, the longest sequence at 1 page, then at 32, 64, ... pages.
  const int64_t longest_pages =
      PagePool::pages_for_tokens(std::min(std::max<int64_t>(longest_tokens, 1), max_tokens));
  std::vector<int64_t> widths = {1};
  for (int64_t pages = 32; pages / 2 < longest_pages; pages *= 2) {
    widths.push_back(std::min(pages, longest_pages));
  }
  for (const int64_t width : widths) {
    // The first sequence holds `width` pages and decodes at its last position; the others hold
    // one page and decode at position 0, each step after truncating back.
    const int64_t first_position = width == 1 ? 0 : std::min(width * kPageTokens, max_tokens) - 1;
    const int64_t batch =
        std::min({options.max_seqs, options.max_batched_tokens, pool.free_pages() - width + 1});
    if (batch < 1) continue;
    std::vector<SequenceId> sequences;
    for (int64_t i = 0; i < batch; ++i) {
      sequences.push_back(pool.add_sequence());
      pool.reserve(sequences.back(), i == 0 ? first_position + 1 : 1);
    }
    for (int64_t done = 0; done < first_position;) {  // the first sequence's earlier rows
      const int64_t count = std::min(first_position - done, options.max_batched_tokens);
      runner.step({{chunk(sequences[0], count, LogitRows::kNone)}}, pool, {});
      done += count;
    }
    for (int64_t n = batch; n >= 1; --n) {
      StepBatch step;
      for (int64_t i = 0; i < n; ++i) {
        step.chunks.push_back(chunk(sequences[i], 1, LogitRows::kLast));
      }
      for (int repeat = 0; repeat < 2; ++repeat) {
        for (int64_t i = 0; i < n; ++i) pool.set_length(sequences[i], i == 0 ? first_position : 0);
        runner.step(step, pool, {{}, std::span<int32_t>(sampled).first(static_cast<size_t>(n))});
      }
    }
    for (const SequenceId sequence : sequences) pool.remove_sequence(sequence);
  }
}

ServeResult run_serve_bench(Runner& runner, const CacheFormat& format, int64_t cache_bytes,
                            const std::vector<Request>& requests, const SchedulerOptions& options,
                            const ServeProgress& progress, ServeWarmup warmup) {
  const ModelConfig& c = runner.config();
  const CacheShape shape{c.num_layers, c.kv_lora_rank, c.qk_rope_head_dim};
  ServeResult result;
  result.cache = format.to_string();
  result.bytes_per_token = c.num_layers * format.record_bytes(shape.kv_lora_rank, shape.rope_dim);
  result.pages = PagePool::pages_for_bytes(shape, format, cache_bytes);
  if (result.pages < 1) {
    throw InvalidArgument("bench-serve: " + std::to_string(cache_bytes) + " bytes of cache hold " +
                          "no page of " + result.cache + " (" +
                          std::to_string(PagePool::bytes_per_page(shape, format)) +
                          " bytes a page)");
  }
  auto pool = runner.make_pool(format, result.pages);
  if (warmup == ServeWarmup::kFull) {
    Scheduler untimed(runner, *pool, options);
    for (const Request& r : requests) {
      try {
        untimed.add(r);
      } catch (const CapacityError&) {
        // never fits: the timed run counts it as failed
      }
    }
    while (untimed.has_work()) untimed.step();
  } else if (warmup == ServeWarmup::kShapes) {
    int64_t longest = 1;
    for (const Request& r : requests) {
      longest = std::max(longest, static_cast<int64_t>(r.prompt.size()) + r.max_tokens);
    }
    warm_up_shapes(runner, *pool, options, longest);
  }
  Scheduler scheduler(runner, *pool, options);
  std::vector<RequestId> ids(requests.size(), 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    try {
      ids[i] = scheduler.add(requests[i]);
      result.prompt_tokens += static_cast<int64_t>(requests[i].prompt.size());
    } catch (const CapacityError&) {
      ++result.failed;
    }
  }
  result.outputs.resize(requests.size());
  std::vector<double> ttft, tpot;
  const auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  const double t0 = scheduler.now_s();
  const int64_t total = static_cast<int64_t>(requests.size());
  while (scheduler.has_work()) {
    const auto step_start = std::chrono::steady_clock::now();
    StepReport report = scheduler.step();
    const double step_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    if (report.tokens > 0) {
      result.step_log.push_back(
          {report.decodes, report.decode_context, report.tokens - report.decodes,
           static_cast<int64_t>(report.generated.size()), pool->used_pages(),
           scheduler.num_waiting(), report.swap_bytes, step_s, runner.last_step_stats().device_ms});
    }
    for (FinishedRequest& f : report.finished) {
      ++result.completed;
      result.output_tokens += static_cast<int64_t>(f.tokens.size());
      ttft.push_back((f.first_token_s - t0) * 1e3);
      if (f.tokens.size() > 1) {
        tpot.push_back((f.finish_s - f.first_token_s) * 1e3 /
                       static_cast<double>(f.tokens.size() - 1));
      }
      const auto it = std::find(ids.begin(), ids.end(), f.id);
      result.outputs[static_cast<size_t>(it - ids.begin())] = std::move(f.tokens);
    }
    const auto now = std::chrono::steady_clock::now();
    if (progress && now - last_report > std::chrono::seconds(1)) {
      progress(result.completed + result.failed, total, scheduler.num_running(),
               scheduler.num_waiting());
      last_report = now;
    }
  }
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (size_t i = 0; i < result.step_log.size(); ++i) {
    if (result.step_log[i].waiting > 0) result.queued_steps = static_cast<int64_t>(i) + 1;
  }
  for (int64_t i = 0; i < result.queued_steps; ++i) {
    result.queued_output_tokens += result.step_log[static_cast<size_t>(i)].generated;
    result.queued_s += result.step_log[static_cast<size_t>(i)].seconds;
  }
  if (result.queued_s > 0) {
    result.queued_output_tok_s = static_cast<double>(result.queued_output_tokens) / result.queued_s;
  }
  for (const StepRecord& step : result.step_log) {
    result.device_s += step.device_ms * 1e-3;
    if (step.prefill_tokens > 0) {
      ++result.prefill_steps;
      result.prefill_steps_s += step.seconds;
    } else {
      ++result.decode_steps;
      result.decode_steps_s += step.seconds;
    }
  }
  const SchedulerStats& stats = scheduler.stats();
  result.output_tok_s = static_cast<double>(result.output_tokens) / result.wall_s;
  result.total_tok_s =
      static_cast<double>(result.output_tokens + result.prompt_tokens) / result.wall_s;
  result.requests_s = static_cast<double>(result.completed) / result.wall_s;
  result.peak_seqs = stats.peak_running;
  result.mean_batch = stats.decode_batches > 0 ? static_cast<double>(stats.decode_tokens) /
                                                     static_cast<double>(stats.decode_batches)
                                               : 0.0;
  result.preemptions = stats.preemptions;
  result.recomputed_tokens = stats.recomputed_tokens;
  result.swapped_out = stats.swapped_out;
  result.peak_swap_bytes = stats.peak_swap_bytes;
  result.swapped_out_bytes = stats.swapped_out_bytes;
  result.steps = stats.steps;
  result.ttft_p50_ms = percentile(ttft, 0.5);
  result.ttft_p99_ms = percentile(ttft, 0.99);
  result.tpot_p50_ms = percentile(tpot, 0.5);
  result.tpot_p99_ms = percentile(tpot, 0.99);
  return result;
}

int64_t utilization_budget_bytes(double utilization, int64_t free_bytes, int64_t total_bytes) {
  const auto gib = [](double bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2f GiB", bytes / 1073741824.0);
    return std::string(text);
  };
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    throw InvalidArgument("--gpu-memory-utilization " + std::to_string(utilization) +
                          ": expected a fraction in (0, 1]");
  }
  const double used = static_cast<double>(total_bytes - free_bytes);
  const double allowed = utilization * static_cast<double>(total_bytes);
  if (allowed <= used) {
    throw InvalidArgument("--gpu-memory-utilization " + std::to_string(utilization) + ": " +
                          gib(allowed) + " of the device's " +
                          gib(static_cast<double>(total_bytes)) +
                          ", but the model, its buffers and other processes already take " +
                          gib(used) + "; raise it, or give --cache-memory");
  }
  return static_cast<int64_t>(allowed - used);
}

int64_t parse_byte_size(const std::string& text) {
  size_t end = 0;
  double value = 0.0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  std::string unit = text.substr(end);
  const std::pair<const char*, double> units[] = {{"", 1.0},
                                                  {"B", 1.0},
                                                  {"KB", 1e3},
                                                  {"MB", 1e6},
                                                  {"GB", 1e9},
                                                  {"TB", 1e12},
                                                  {"KiB", 1024.0},
                                                  {"MiB", 1048576.0},
                                                  {"GiB", 1073741824.0},
                                                  {"TiB", 1099511627776.0}};
  if (end > 0 && value >= 0.0) {
    for (const auto& [name, scale] : units) {
      if (unit == name) return static_cast<int64_t>(value * scale);
    }
  }
  throw InvalidArgument("byte size \"" + text +
                        "\": expected a number with an optional unit B, KB, MB, GB, TB, KiB, MiB, "
                        "GiB or TiB (e.g. 8GiB)");
}

}  // namespace quantmla
