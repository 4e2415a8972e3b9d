// The CUDA runner on a production-shape model (make-random-model): decode step time at several
// batch sizes and contexts beside the weight-read bound, prefill tokens/s on 2K-token prompts with
// the achieved GEMM rate beside cuBLAS's, and memory at load. Prints a table, writes JSON.
//   bench_runner --model DIR [--json FILE] [--repeats N] [--only decode:B[:CTX]|prefill:P]
//   [--no-pdl] [--no-fusion] [--quick] [--prefill] [--experts cublas|ours-gated|ours]
//   [--cache SPEC] [--swap]
//   (--only: one shape, for profiling: decode of B sequences at ctx CTX, default 1024, with the
//   BF16 cache (or --cache's format), or a prefill of P 2K-token prompts; --no-fusion:
//   CudaRunnerOptions::fused_decode off; --quick: decode of 1, 4 and 16 sequences at 1K, no
//   prefill; --prefill: the prefill rows only; --experts: CudaRunnerOptions::expert_products,
//   default the runner's own; --swap: only the time a preemption by swap takes, a sequence's
//   records out of the pool and back in, each format, through the pool's pinned staging buffer
//   and without it (CudaRunnerOptions::swap_staging_bytes 0: from pageable memory), the model
//   loaded once for each)
//
// Method. The device's ceilings are measured in the same run: copy bandwidth (a 4 GiB device copy,
// bytes read + written over the time) and the cuBLAS BF16 rate (8192^3 through the runner's own
// GemmRunner, random data). A decode step is one Runner::step over B sequences of `context` cached
// tokens (their pages filled with random rows by the quantize-on-write kernel, each sequence its
// own pages), one new token each, sampled greedily on the GPU; host clock around the synchronous
// step, median of the repeats after two warm-ups. Its bound is the weight bytes the step's GEMMs
// read (routed experts: those chosen; the runner counts them) over the copy bandwidth. A shape
// whose cache does not fit next to the weights is reported as such.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/gemm.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"
#include "quantmla/runner.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

__global__ void fill_positions(int32_t* seq_ids, int32_t* positions, int64_t count, int64_t per_seq,
                               int32_t first_seq) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  seq_ids[i] = first_seq + static_cast<int32_t>(i / per_seq);
  positions[i] = static_cast<int32_t>(i % per_seq);
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + 255) / 256); }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double measure_gemm_tflops() {
  const int64_t n = 8192;
  DeviceArray<uint16_t> x(n * n), w(n * n);
  DeviceArray<float> y(n * n);
  bench::random_bf16<<<bench::fill_blocks(n * n), 256>>>(x.data(), n * n, 1.0f, 1);
  bench::random_bf16<<<bench::fill_blocks(n * n), 256>>>(w.data(), n * n, 1.0f, 2);
  gpu::GemmRunner gemm;
  cudaEvent_t start, stop;
  QUANTMLA_CUDA_CHECK(cudaEventCreate(&start));
  QUANTMLA_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  for (int r = 0; r < 8; ++r) {
    QUANTMLA_CUDA_CHECK(cudaEventRecord(start));
    gemm.linear(n, n, n, x.data(), n, w.data(), n, y.data(), n, DType::kF32, 0.0f, nullptr);
    QUANTMLA_CUDA_CHECK(cudaEventRecord(stop));
    QUANTMLA_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    if (r > 1) ms.push_back(t);
  }
  return 2.0 * n * n * n / (bench::median(ms) * 1e-3) / 1e12;
}

// B sequences of `context` tokens whose pages hold random rows, each with room for `extra` more.
std::vector<SequenceId> fill_pool(PagePool& pool, int64_t batch, int64_t context, int64_t extra) {
  std::vector<SequenceId> seqs;
  std::vector<int32_t> table;
  int64_t stride = PagePool::pages_for_tokens(context + extra);
  for (int64_t b = 0; b < batch; ++b) {
    seqs.push_back(pool.add_sequence());
    pool.reserve(seqs.back(), context + extra);
    pool.set_length(seqs.back(), context);
    const auto& t = pool.block_table(seqs.back());
    table.insert(table.end(), t.begin(), t.end());
  }
  DeviceArray<int32_t> block_table(table);
  // One chunk of whole sequences at a time, at most ~1M tokens.
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t{1} << 20) / context);
  const int64_t tokens = std::min(batch, per_chunk) * context;
  DeviceArray<float> c(tokens * gpu::kLatentDim), k_pe(tokens * gpu::kRopeDim);
  DeviceArray<int32_t> seq_ids(tokens), positions(tokens);
  for (int64_t layer = 0; layer < pool.shape().num_layers; ++layer) {
    for (int64_t first = 0; first < batch; first += per_chunk) {
      const int64_t n = std::min(per_chunk, batch - first) * context;
      bench::random_f32<<<bench::fill_blocks(n * gpu::kLatentDim), 256>>>(
          c.data(), n * gpu::kLatentDim, 1.7f, layer * 1000 + first);
      bench::random_f32<<<bench::fill_blocks(n * gpu::kRopeDim), 256>>>(
          k_pe.data(), n * gpu::kRopeDim, 3.4f, layer * 1000 + first + 7);
      fill_positions<<<blocks(n), 256>>>(seq_ids.data(), positions.data(), n, context,
                                         static_cast<int32_t>(first));
      gpu::MlaWriteParams write;
      write.c = c.data();
      write.k_pe = k_pe.data();
      write.seq_ids = seq_ids.data();
      write.positions = positions.data();
      write.pool = pool.storage().layer_pages(layer);
      write.block_table = block_table.data();
      write.block_table_stride = stride;
      write.num_tokens = n;
      gpu::mla_write(pool.format(), write, nullptr);
    }
  }
  QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
  return seqs;
}

struct DecodeRow {
  int64_t batch, context;
  std::string cache;
  double step_ms = 0, bound_ms = 0;
  double device_ms = 0, host_queue_ms = 0;  // StepStats: the kernels' span, the host's queueing
  bool fits = true;
  bool graph = false;  // the timed steps replayed a captured CUDA graph
};
struct PrefillRow {
  int64_t prompts, prompt_tokens;
  double step_ms = 0, tokens_per_s = 0, gemm_tflops = 0;
};
struct SwapRow {
  std::string cache;
  int64_t tokens = 0, bytes = 0;
  bool staged = true;  // through the pool's pinned staging buffer (else from pageable memory)
  double out_ms = 0, in_ms = 0;
};

// --swap: PagePool::copy_out and copy_in of one sequence of `tokens` tokens (what a preemption by
// swap and its readmission move), median of `repeats` after two warm-ups, each format, with the
// runner's pinned staging buffer and without. The records' values do not matter to a copy, so
// the pages are left as allocated.
std::vector<SwapRow> time_swaps(const std::string& model_dir, CudaRunnerOptions options,
                                int repeats) {
  std::vector<SwapRow> rows;
  for (const bool staged : {true, false}) {
    if (!staged) options.swap_staging_bytes = 0;
    auto runner = make_cuda_runner(model_dir, options);
    for (const char* spec : {"bf16", "content=fp8,rope=bf16", "content=int4:g64,rope=int4:g64",
                             "content=int2:g64,rope=int4:g64"}) {
      for (const int64_t tokens : {int64_t{640}, int64_t{1280}}) {
        auto pool =
            runner->make_pool(CacheFormat::parse(spec), 2 * PagePool::pages_for_tokens(tokens));
        const SequenceId victim = pool->add_sequence();
        pool->reserve(victim, tokens);
        pool->set_length(victim, tokens);
        SwapRow row{spec, tokens, pool->swap_bytes(tokens), staged};
        std::vector<uint8_t> host(static_cast<size_t>(row.bytes));
        std::vector<double> out_ms, in_ms;
        for (int r = 0; r < repeats + 2; ++r) {
          auto start = std::chrono::steady_clock::now();
          pool->copy_out(victim, tokens, host);
          const double out = seconds_since(start) * 1e3;
          const SequenceId back = pool->add_sequence();
          pool->reserve(back, tokens);
          start = std::chrono::steady_clock::now();
          pool->copy_in(back, tokens, host);
          const double in = seconds_since(start) * 1e3;
          pool->remove_sequence(back);
          if (r >= 2) out_ms.push_back(out), in_ms.push_back(in);
        }
        row.out_ms = bench::median(out_ms);
        row.in_ms = bench::median(in_ms);
        std::printf(
            "swap %-32s %5lld tokens (%6.2f MB), %-9s: out %7.3f ms (%5.1f GB/s), in "
            "%7.3f ms (%5.1f GB/s)\n",
            spec, static_cast<long long>(tokens), row.bytes / 1e6, staged ? "staged" : "pageable",
            row.out_ms, row.bytes / (row.out_ms * 1e6), row.in_ms, row.bytes / (row.in_ms * 1e6));
        std::fflush(stdout);
        rows.push_back(row);
      }
    }
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir, json_path;
  int repeats = 10;
  std::string only_kind;  // --only decode:B[:CTX] | prefill:P
  int64_t only_size = 0;
  int64_t only_context = 1024;
  bool programmatic = true;   // --no-pdl: the runner's kernels launched the plain way
  bool fused = true;          // --no-fusion: the separate kernels of decode steps
  bool quick = false;         // --quick: decode of 1, 4 and 16 sequences at 1K only
  bool prefill_only = false;  // --prefill: no decode rows
  bool swap_only = false;     // --swap: the swap copies only
  std::string experts;        // --experts: CudaRunnerOptions::expert_products (empty: the runner's)
  std::string only_cache = "bf16";  // --cache: the cache format of an --only decode shape
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--no-pdl") programmatic = false;
    if (flag == "--no-fusion") fused = false;
    if (flag == "--quick") quick = true;
    if (flag == "--prefill") prefill_only = true;
    if (flag == "--swap") swap_only = true;
    if (i + 1 >= argc) break;
    if (flag == "--only") {
      const std::string value = argv[++i];
      const size_t colon = value.find(':');
      only_kind = value.substr(0, colon);
      only_size = colon == std::string::npos ? 0 : std::atoll(value.c_str() + colon + 1);
      const size_t second = colon == std::string::npos ? colon : value.find(':', colon + 1);
      if (second != std::string::npos) only_context = std::atoll(value.c_str() + second + 1);
    }
    if (flag == "--model") model_dir = argv[++i];
    if (flag == "--json") json_path = argv[++i];
    if (flag == "--repeats") repeats = std::atoi(argv[++i]);
    if (flag == "--experts") experts = argv[++i];
    if (flag == "--cache") only_cache = argv[++i];
  }
  const bool only = !only_kind.empty();
  using ExpertProducts = CudaRunnerOptions::ExpertProducts;
  const std::pair<const char*, ExpertProducts> expert_names[] = {
      {"cublas", ExpertProducts::kCublas},
      {"ours-gated", ExpertProducts::kOursGated},
      {"ours", ExpertProducts::kOurs}};
  CudaRunnerOptions options;
  bool experts_known = experts.empty();
  for (const auto& [name, products] : expert_names) {
    if (experts == name) options.expert_products = products, experts_known = true;
  }
  for (const auto& [name, products] : expert_names) {
    if (options.expert_products == products) experts = name;
  }
  if (model_dir.empty() || !experts_known ||
      (only &&
       ((only_kind != "decode" && only_kind != "prefill") || only_size < 1 || only_context < 1))) {
    std::fprintf(
        stderr,
        "usage: bench_runner --model DIR [--json FILE] [--repeats N] [--only "
        "decode:B[:CTX]|prefill:P] [--cache SPEC] [--no-pdl] [--no-fusion] [--quick] [--prefill] "
        "[--experts cublas|ours-gated|ours] [--swap]\n");
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_gbps = bench::copy_bandwidth_gbps();
    // --swap times host copies: the cuBLAS rate is no ceiling of theirs.
    const double gemm_tflops = swap_only ? 0.0 : measure_gemm_tflops();
    std::printf("%s: copy %.0f GB/s (read + write)", prop.name, copy_gbps);
    if (!swap_only) std::printf(", cuBLAS BF16 8192^3 %.0f TFLOP/s", gemm_tflops);
    std::printf("\n");

    options.max_batch_tokens = 8192;
    options.max_sequences = 256;
    options.programmatic_launch = programmatic;
    options.fused_decode = fused;
    if (swap_only) {
      const std::vector<SwapRow> swaps = time_swaps(model_dir, options, repeats);
      if (!json_path.empty()) {
        std::ofstream out(json_path);
        out << "{\n  \"device\": \"" << prop.name << "\",\n  \"model\": \"" << model_dir
            << "\",\n  \"copy_gbps\": " << copy_gbps << ",\n  \"swap\": [\n";
        for (size_t i = 0; i < swaps.size(); ++i) {
          const SwapRow& r = swaps[i];
          out << "    {\"cache\": \"" << r.cache << "\", \"tokens\": " << r.tokens
              << ", \"bytes\": " << r.bytes << ", \"staged\": " << (r.staged ? "true" : "false")
              << ", \"out_ms\": " << r.out_ms << ", \"in_ms\": " << r.in_ms << "}"
              << (i + 1 < swaps.size() ? ",\n" : "\n");
        }
        out << "  ]\n}\n";
      }
      return 0;
    }
    std::printf("routed experts of prefill steps: %s\n", experts.c_str());
    if (!programmatic) std::printf("kernels launched without programmatic dependent launch\n");
    if (!fused) std::printf("decode steps launch the separate kernels (no fusion)\n");
    const auto load_start = std::chrono::steady_clock::now();
    auto runner = make_cuda_runner(model_dir, options);
    const double load_s = seconds_since(load_start);
    const ModelConfig& config = runner->config();
    size_t free_bytes = 0, total_bytes = 0;
    QUANTMLA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const int64_t weights_bytes = static_cast<int64_t>(total_bytes - free_bytes);  // + workspaces
    std::printf("model %s: loaded in %.1f s; device memory in use %.2f GiB, free %.2f GiB\n",
                model_dir.c_str(), load_s, weights_bytes / double(1 << 30),
                free_bytes / double(1 << 30));

    const CacheShape shape{config.num_layers, config.kv_lora_rank, config.qk_rope_head_dim};
    std::vector<std::string> specs = {"bf16", "content=int4:g64,rope=int4:g64"};
    if (only && std::find(specs.begin(), specs.end(), only_cache) == specs.end()) {
      specs = {only_cache};
    }
    std::vector<std::pair<std::string, int64_t>> longest;
    for (const char* spec : {"bf16", "content=fp8,rope=bf16", "content=int4:g64,rope=int4:g64",
                             "content=int2:g64,rope=int4:g64"}) {
      const CacheFormat format = CacheFormat::parse(spec);
      const int64_t per_token = shape.num_layers * format.record_bytes(512, 64);
      longest.emplace_back(spec, int64_t{100'000'000'000} / per_token);
    }

    std::vector<DecodeRow> decode;
    std::mt19937 rng(7);
    for (const std::string& spec : specs) {
      if ((only && spec != only_cache) || prefill_only) continue;
      const CacheFormat format = CacheFormat::parse(spec);
      if (only && only_kind != "decode") continue;
      // --only decode:B[:CTX]: any batch B, at ctx CTX (1024 unless given).
      const std::vector<int64_t> contexts = only    ? std::vector<int64_t>{only_context}
                                            : quick ? std::vector<int64_t>{1024}
                                                    : std::vector<int64_t>{1024, 16384};
      const std::vector<int64_t> batches = only    ? std::vector<int64_t>{only_size}
                                           : quick ? std::vector<int64_t>{1, 4, 16}
                                                   : std::vector<int64_t>{1, 16, 64, 256};
      for (int64_t context : contexts) {
        for (int64_t batch : batches) {
          DecodeRow row{batch, context, spec};
          const int64_t extra = repeats + 4;
          const int64_t pages = batch * PagePool::pages_for_tokens(context + extra);
          QUANTMLA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
          const int64_t need = pages * PagePool::bytes_per_page(shape, format);
          if (need > static_cast<int64_t>(free_bytes) - (int64_t{2} << 30)) {
            row.fits = false;
            std::printf("%-32s B %4lld ctx %6lld: cache %.1f GiB does not fit (%.1f GiB free)\n",
                        spec.c_str(), static_cast<long long>(batch),
                        static_cast<long long>(context), need / double(1 << 30),
                        free_bytes / double(1 << 30));
            decode.push_back(row);
            continue;
          }
          auto pool = runner->make_pool(format, pages);
          const std::vector<SequenceId> seqs = fill_pool(*pool, batch, context, extra);
          std::vector<int32_t> next(static_cast<size_t>(batch));
          for (auto& t : next) t = static_cast<int32_t>(rng() % config.vocab_size);
          std::vector<double> times, device_times, queue_times;
          int64_t weight_bytes = 0;
          for (int r = 0; r < repeats + 2; ++r) {
            StepBatch step;
            for (int64_t b = 0; b < batch; ++b) {
              step.chunks.push_back({seqs[b], std::span(&next[b], 1), LogitRows::kLast, {}});
            }
            const auto start = std::chrono::steady_clock::now();
            runner->step(step, *pool, {{}, next});
            const double ms = seconds_since(start) * 1e3;
            if (r >= 2) {
              times.push_back(ms);
              device_times.push_back(runner->last_step_stats().device_ms);
              queue_times.push_back(runner->last_step_stats().host_queue_ms);
            }
            weight_bytes = runner->last_step_stats().weight_bytes_read;
            row.graph = runner->last_step_stats().graph_replayed;
          }
          row.step_ms = bench::median(times);
          row.device_ms = bench::median(device_times);
          row.host_queue_ms = bench::median(queue_times);
          row.bound_ms = weight_bytes / (copy_gbps * 1e9) * 1e3;
          std::printf(
              "%-32s B %4lld ctx %6lld: step %8.3f ms  weight-read bound %7.3f ms  (%.0f%%)%s"
              "  [kernels %.3f ms, host queueing %.3f ms]\n",
              spec.c_str(), static_cast<long long>(batch), static_cast<long long>(context),
              row.step_ms, row.bound_ms, 100.0 * row.bound_ms / row.step_ms,
              row.graph ? "  graph" : "", row.device_ms, row.host_queue_ms);
          std::fflush(stdout);
          decode.push_back(row);
        }
      }
    }

    std::vector<PrefillRow> prefill;
    const std::vector<int64_t> prompt_counts = only    ? std::vector<int64_t>{only_size}
                                               : quick ? std::vector<int64_t>{}
                                                       : std::vector<int64_t>{1, 4};
    for (int64_t prompts : prompt_counts) {
      if (only && (only_kind != "prefill" || prompts != only_size)) continue;
      const int64_t len = 2048;
      const CacheFormat format = CacheFormat::parse("content=int4:g64,rope=int4:g64");
      PrefillRow row{prompts, len};
      std::vector<std::vector<int32_t>> ids(static_cast<size_t>(prompts));
      for (auto& p : ids) {
        for (int64_t i = 0; i < len; ++i)
          p.push_back(static_cast<int32_t>(rng() % config.vocab_size));
      }
      std::vector<double> times;
      int64_t flops = 0, padding = 0;
      auto pool = runner->make_pool(format, prompts * PagePool::pages_for_tokens(len));
      for (int r = 0; r < (only ? repeats : std::max(3, repeats / 2)) + 1; ++r) {
        StepBatch step;
        for (int64_t b = 0; b < prompts; ++b) {
          const SequenceId seq = pool->add_sequence();
          pool->reserve(seq, len);
          step.chunks.push_back({seq, ids[b], LogitRows::kLast, {}});
        }
        std::vector<int32_t> tokens(static_cast<size_t>(prompts));
        const auto start = std::chrono::steady_clock::now();
        runner->step(step, *pool, {{}, tokens});
        const double ms = seconds_since(start) * 1e3;
        if (r >= 1) times.push_back(ms);
        flops = runner->last_step_stats().gemm_flops;
        padding = runner->last_step_stats().padding_flops;
        for (const SequenceChunk& chunk : step.chunks) pool->remove_sequence(chunk.sequence);
      }
      row.step_ms = bench::median(times);
      row.tokens_per_s = prompts * len / (row.step_ms * 1e-3);
      row.gemm_tflops = flops / (row.step_ms * 1e-3) / 1e12;
      std::printf(
          "prefill %lld x %lld tokens: %.2f ms, %.0f tokens/s, GEMM work at %.0f TFLOP/s "
          "(%.0f%% of cuBLAS's %.0f), %.0f%% more on the experts' padding rows\n",
          static_cast<long long>(prompts), static_cast<long long>(len), row.step_ms,
          row.tokens_per_s, row.gemm_tflops, 100.0 * row.gemm_tflops / gemm_tflops, gemm_tflops,
          100.0 * static_cast<double>(padding) / static_cast<double>(flops));
      prefill.push_back(row);
    }

    if (!json_path.empty()) {
      std::ofstream out(json_path);
      out << "{\n  \"device\": \"" << prop.name << "\",\n  \"model\": \"" << model_dir
          << "\",\n  \"copy_gbps\": " << copy_gbps << ",\n  \"gemm_tflops\": " << gemm_tflops
          << ",\n  \"programmatic_launch\": " << (programmatic ? "true" : "false")
          << ",\n  \"fused_decode\": " << (fused ? "true" : "false") << ",\n  \"experts\": \""
          << experts << "\""
          << ",\n  \"device_memory_in_use_bytes\": " << weights_bytes
          << ",\n  \"load_s\": " << load_s << ",\n  \"decode\": [\n";
      for (size_t i = 0; i < decode.size(); ++i) {
        const DecodeRow& r = decode[i];
        out << "    {\"batch\": " << r.batch << ", \"context\": " << r.context << ", \"cache\": \""
            << r.cache << "\", \"fits\": " << (r.fits ? "true" : "false")
            << ", \"graph\": " << (r.graph ? "true" : "false") << ", \"step_ms\": " << r.step_ms
            << ", \"bound_ms\": " << r.bound_ms << ", \"device_ms\": " << r.device_ms
            << ", \"host_queue_ms\": " << r.host_queue_ms << "}"
            << (i + 1 < decode.size() ? ",\n" : "\n");
      }
      out << "  ],\n  \"prefill\": [\n";
      for (size_t i = 0; i < prefill.size(); ++i) {
        const PrefillRow& r = prefill[i];
        out << "    {\"prompts\": " << r.prompts << ", \"prompt_tokens\": " << r.prompt_tokens
            << ", \"step_ms\": " << r.step_ms << ", \"tokens_per_s\": " << r.tokens_per_s
            << ", \"gemm_tflops\": " << r.gemm_tflops << "}"
            << (i + 1 < prefill.size() ? ",\n" : "\n");
      }
      out << "  ],\n  \"longest_context_in_100GB\": {";
      for (size_t i = 0; i < longest.size(); ++i) {
        out << "\"" << longest[i].first << "\": " << longest[i].second
            << (i + 1 < longest.size() ? ", " : "");
      }
      out << "}\n}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
