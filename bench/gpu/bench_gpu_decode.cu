// GPU decode benchmark: measures the device's copy bandwidth, then times the decode kernel of each
// cache format over a grid of batch x context x heads (s_q = 1) on a pool filled by the
// quantize-on-write kernel with random rows; prints a table and writes JSON. A format name ending
// in "@tiled", "@fragments", "@fragments3", "@warpgroup" or "@transposed" is the same format with
// that kernel forced (QUANTMLA_DECODE_KERNEL), beside the plan's own choice.
//
// Timing: CUDA events around one launch of a graph holding the decode call (decode + combine
// kernels), L2 flushed before each repeat by a 256 MB memset (the FlashMLA anchor's method),
// median of the repeats after one warm-up call. The memset leaves the L2 full of dirty lines,
// which the timed kernel writes back as its copies fill the L2; --clean-flush reads the buffer
// back after the memset (bench_common.cuh's median_us_flushed), so that the kernel starts from
// clean lines (on an H200 FlashMLA ran 3-7% faster at 128K so, ours within 1%: docs/benchmarks.md,
// "Forty-seventh session"; the grid beside FlashMLA keeps the anchor's method).
// --batches B,... times those batch sizes instead of the grid's (at its contexts, or the serving
// grid's with --short-contexts). --range-ratio R gives each sequence a length uniform in
// [CTX (1 - R), CTX (1 + R)] (vllm bench's --random-range-ratio; drawn once per shape from --seed,
// printed), the mixed contexts of a serving step instead of one for all. "cache MB" counts the
// records of every visible token (the bytes the kernel must read); GB/s is that over the time;
// TFLOP/s counts 2 x heads x tokens x (576 + 512); each row names the plan's kernel, its blocks and
// the pages of their runs (the shortest and the longest, also in the JSON). Physical cache memory
// for one 128K-token sequence of a DeepSeek-V3-shaped model (61 layers) comes from
// cache_physical_bytes, pages and block table included.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/device_array.h"
#include "quantmla/cache.h"
#include "quantmla/cache_format.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;
using gpu::kKeyDim;
using gpu::kLatentDim;
using gpu::kRopeDim;

// Rows like the fixture's: a few large content channels, one high-energy RoPE pair.
__global__ void random_rows(float* c, float* k_pe, int64_t tokens, uint64_t seed) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * kKeyDim) return;
  const int64_t token = i / kKeyDim;
  const int d = static_cast<int>(i % kKeyDim);
  const float u = bench::seeded_uniform(seed, i);
  if (d < kLatentDim) {
    c[token * kLatentDim + d] = 1.7f * u * (d % 37 == 0 ? 6.0f : 1.0f);
  } else {
    const int r = d - kLatentDim;
    k_pe[token * kRopeDim + r] = 3.4f * u * (r / 2 == 21 ? 4.0f : 1.0f);
  }
}

// Token t of the fill: sequence t / tokens_per_seq, position t % tokens_per_seq.
__global__ void fill_positions(int32_t* ids, int32_t* positions, int64_t first, int64_t count,
                               int64_t tokens_per_seq) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  ids[i] = static_cast<int32_t>((first + i) / tokens_per_seq);
  positions[i] = static_cast<int32_t>((first + i) % tokens_per_seq);
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

struct FormatRun {
  std::string name;
  std::string spec;
  bool heavy;                    // also timed at H = 128 (the compute-bound shapes)
  const char* kernel = nullptr;  // QUANTMLA_DECODE_KERNEL for this run; null: the plan's choice
};

struct Row {
  std::string format;
  int batch, context, heads, s_q;
  double ms, cache_mb, gbps, tflops;
  int repeats, blocks;
  std::string kernel;                // the plan's choice (MlaDecodePlan::kernel_name)
  int run_pages_min, run_pages_max;  // the pages of the plan's shortest and longest block runs
};

std::string iso_date() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

// "B,B,..." as batch sizes, or none where an item is not a whole number in [1, 4096].
std::vector<int> parse_batches(const std::string& list) {
  std::vector<int> batches;
  for (size_t from = 0; from <= list.size();) {
    const size_t comma = std::min(list.find(',', from), list.size());
    const std::string item = list.substr(from, comma - from);
    char* end = nullptr;
    const long b = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || b < 1 || b > 4096) return {};
    batches.push_back(static_cast<int>(b));
    from = comma + 1;
  }
  return batches;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  std::string only;          // "FORMAT,B,CTX,H": one shape, e.g. for ncu
  std::string formats_only;  // "NAME,NAME,...": these formats only
  int heads_only = 0;        // 16 or 128: that half of the grid only
  double max_seconds = 420.0;
  bool quick = false;
  bool short_contexts = false;    // the serving grid: batch 16-128 at 512-2K tokens
  bool clean_flush = false;       // the flush's memset followed by a read of the buffer
  int s_q = 1;                    // queries per sequence (2: multi-token prediction)
  int pages_per_split = 0;        // 0: the plan's own split; N: runs of exactly N pages (tuning)
  double range_ratio = 0.0;       // sequence lengths uniform in [CTX (1 - R), CTX (1 + R)]
  uint64_t seed = 1;              // of those lengths
  std::vector<int> batches_only;  // --batches B,...: these batch sizes instead of the grid's
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--max-seconds") && i + 1 < argc) {
      max_seconds = std::stod(argv[++i]);
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--short-contexts")) {
      short_contexts = true;
    } else if (!std::strcmp(argv[i], "--clean-flush")) {
      clean_flush = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!std::strcmp(argv[i], "--formats") && i + 1 < argc) {
      formats_only = "," + std::string(argv[++i]) + ",";
    } else if (!std::strcmp(argv[i], "--heads") && i + 1 < argc) {
      heads_only = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--s-q") && i + 1 < argc) {
      s_q = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--pages-per-split") && i + 1 < argc) {
      pages_per_split = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--range-ratio") && i + 1 < argc) {
      range_ratio = std::stod(argv[++i]);
    } else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) {
      seed = std::stoull(argv[++i]);
    } else if (!std::strcmp(argv[i], "--batches") && i + 1 < argc) {
      batches_only = parse_batches(argv[++i]);
      if (batches_only.empty()) {
        std::fprintf(stderr, "--batches %s: expected batch sizes 1-4096, comma-separated\n",
                     argv[i]);
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json FILE] [--max-seconds S] [--quick | --short-contexts] "
                   "[--heads 16|128] "
                   "[--s-q 1|2] [--only FORMAT,B,CTX,H] [--formats NAME,...] "
                   "[--pages-per-split N] [--range-ratio R] [--seed S] [--clean-flush] "
                   "[--batches B,...]\n",
                   argv[0]);
      return 2;
    }
  }
  if (s_q < 1 || s_q > 2) {
    std::fprintf(stderr, "--s-q %d: 1 or 2\n", s_q);
    return 2;
  }
  if (!(range_ratio >= 0.0 && range_ratio < 1.0)) {
    std::fprintf(stderr, "--range-ratio %g: expected 0 <= R < 1\n", range_ratio);
    return 2;
  }
  if (!gpu::device_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  try {
    const auto started = std::chrono::steady_clock::now();
    const auto elapsed = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    };
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0, runtime = 0;
    QUANTMLA_CUDA_CHECK(cudaDriverGetVersion(&driver));
    QUANTMLA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    const double copy_gbps = bench::copy_bandwidth_gbps();
    std::printf("%s, %d SMs, L2 %d MB, driver %d, runtime %d; copy bandwidth %.0f GB/s\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, driver, runtime,
                copy_gbps);

    const std::vector<FormatRun> formats = {
        {"bf16/bf16", "content=bf16,rope=bf16", true},
        {"bf16/bf16@tiled", "content=bf16,rope=bf16", true, "tiled"},
        {"bf16/bf16@warpgroup", "content=bf16,rope=bf16", true, "warpgroup"},
        {"bf16/bf16@transposed", "content=bf16,rope=bf16", true, "transposed"},
        {"bf16/bf16@transposed32", "content=bf16,rope=bf16", false, "transposed32"},
        {"fp8/bf16", "content=fp8,rope=bf16", true},
        {"fp8/bf16@tiled", "content=fp8,rope=bf16", true, "tiled"},
        {"fp8/bf16@fragments", "content=fp8,rope=bf16", true, "fragments"},
        {"int4g64/int4", "content=int4:g64,rope=int4:g64", true},
        {"int4g64/int4@tiled", "content=int4:g64,rope=int4:g64", true, "tiled"},
        {"int4g64/int4@fragments", "content=int4:g64,rope=int4:g64", true, "fragments"},
        {"int4g64/int4@fragments3", "content=int4:g64,rope=int4:g64", false, "fragments3"},
        {"int4g64/int4@warpgroup", "content=int4:g64,rope=int4:g64", true, "warpgroup"},
        {"int4g64/int4@transposed", "content=int4:g64,rope=int4:g64", false, "transposed"},
        {"int4g128/int4", "content=int4:g128,rope=int4:g64", false},
        {"int4g128/int4@transposed", "content=int4:g128,rope=int4:g64", false, "transposed"},
        {"int4g64/int4+2bf16", "content=int4:g64,rope=int4:g64:bf16pairs=0+21", false},
        {"int4g64/bf16", "content=int4:g64,rope=bf16", false},
        {"int2g64/int4", "content=int2:g64,rope=int4:g64", true},
        {"int2g64/int4@tiled", "content=int2:g64,rope=int4:g64", true, "tiled"},
        {"int2g64/int4@fragments", "content=int2:g64,rope=int4:g64", true, "fragments"},
        {"int2g64/int4@warpgroup", "content=int2:g64,rope=int4:g64", true, "warpgroup"},
        {"int2g64/int4@transposed", "content=int2:g64,rope=int4:g64", false, "transposed"},
        {"int2g128/int4", "content=int2:g128,rope=int4:g64", false},
        {"int2g128/int4@transposed", "content=int2:g128,rope=int4:g64", false, "transposed"},
        {"int2g64/int4+2bf16", "content=int2:g64,rope=int4:g64:bf16pairs=0+21", false},
    };
    std::vector<int> batches = quick ? std::vector<int>{1, 16} : std::vector<int>{1, 16, 64, 128};
    std::vector<int> contexts =
        quick ? std::vector<int>{4096, 32768} : std::vector<int>{4096, 32768, 131072};
    if (short_contexts) {
      // A serving step's shapes (workload P of docs/benchmarks.md: 256-1280 tokens a sequence),
      // where the split of the work costs more than at long contexts (decode_schedule.h).
      batches = {16, 32, 64, 96, 128};
      contexts = {512, 1024, 2048};
    }
    if (!batches_only.empty())
      batches = batches_only;  // at the grid's (or serving grid's) contexts
    std::vector<int> head_counts = {16, 128};
    if (!only.empty()) {
      // --only names its shape, which need not be on the grid (e.g. the runner's 1K contexts, 32
      // or 64 heads), for any format.
      int b = 0, ctx = 0, h = 0;
      const size_t comma = only.find(',');
      if (comma == std::string::npos ||
          std::sscanf(only.c_str() + comma + 1, "%d,%d,%d", &b, &ctx, &h) != 3 || b < 1 ||
          ctx < s_q || h < 16 || h > 128 || h % 16 != 0) {
        std::fprintf(stderr, "--only %s: expected FORMAT,B,CTX,H (H a multiple of 16 to 128)\n",
                     only.c_str());
        return 2;
      }
      batches = {b};
      contexts = {ctx};
      head_counts = {h};
    }
    const int max_batch = batches.back();
    // The longest length a shape can draw: every sequence's pages are filled that far.
    const int max_context = static_cast<int>(std::floor(contexts.back() * (1.0 + range_ratio)));
    // Each sequence's length at nominal context `context` (all equal without --range-ratio);
    // at least s_q, as the kernel needs.
    const auto draw_lengths = [&](int batch, int context) {
      const int lo = std::max(s_q, static_cast<int>(std::ceil(context * (1.0 - range_ratio))));
      const int hi = std::max(lo, static_cast<int>(std::floor(context * (1.0 + range_ratio))));
      std::mt19937_64 rng(seed);
      std::uniform_int_distribution<int> length(lo, hi);
      std::vector<int32_t> lens(static_cast<size_t>(batch));
      for (int32_t& len : lens) len = length(rng);
      return lens;
    };
    if (range_ratio > 0.0) {
      std::printf("sequence lengths uniform in [ctx (1 - %.2f), ctx (1 + %.2f)], seed %llu\n",
                  range_ratio, range_ratio, static_cast<unsigned long long>(seed));
    }
    const int max_pages = (max_context + kPageTokens - 1) / kPageTokens;
    const int64_t total_pages = static_cast<int64_t>(max_batch) * max_pages;

    // One shuffled block table for every format: sequence b owns row b.
    std::vector<int32_t> table(static_cast<size_t>(total_pages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937_64(42));
    DeviceArray<int32_t> d_table(table);
    DeviceArray<uint8_t> flush(size_t{256} << 20);
    DeviceArray<uint16_t> d_q(static_cast<size_t>(max_batch) * s_q * 128 * kKeyDim);
    bench::random_bf16<<<bench::fill_blocks(d_q.size()), 256>>>(d_q.data(), d_q.size(), 1.7f, 7);
    QUANTMLA_CUDA_CHECK_LAUNCH();
    DeviceArray<uint16_t> d_out(static_cast<size_t>(max_batch) * s_q * 128 * kLatentDim);
    DeviceArray<float> d_lse(static_cast<size_t>(max_batch) * s_q * 128);

    std::vector<Row> rows;
    std::vector<std::string> skipped;
    bench::Event start, stop;
    for (const FormatRun& run : formats) {
      if (!only.empty() && only.rfind(run.name + ",", 0) != 0) continue;
      if (heads_only == 128 && !run.heavy) continue;
      if (!formats_only.empty() && formats_only.find("," + run.name + ",") == std::string::npos) {
        continue;
      }
      if (run.kernel != nullptr) {
        setenv("QUANTMLA_DECODE_KERNEL", run.kernel, 1);
      } else {
        unsetenv("QUANTMLA_DECODE_KERNEL");
      }
      const CacheFormat format = CacheFormat::parse(run.spec);
      const int64_t record_bytes = format.record_bytes(kLatentDim, kRopeDim);
      DeviceArray<uint8_t> pool(static_cast<size_t>(total_pages * kPageTokens * record_bytes));
      // Fill every sequence's pages through the quantize-on-write kernel, in chunks.
      {
        const int64_t tokens = static_cast<int64_t>(max_batch) * max_context;
        const int64_t chunk = int64_t{1} << 20;
        DeviceArray<float> c(static_cast<size_t>(chunk) * kLatentDim);
        DeviceArray<float> k_pe(static_cast<size_t>(chunk) * kRopeDim);
        DeviceArray<int32_t> ids(chunk), positions(chunk);
        for (int64_t first = 0; first < tokens; first += chunk) {
          const int64_t n = std::min(chunk, tokens - first);
          random_rows<<<blocks_for(n * kKeyDim, 256), 256>>>(c.data(), k_pe.data(), n, first + 1);
          fill_positions<<<blocks_for(n, 256), 256>>>(ids.data(), positions.data(), first, n,
                                                      max_context);
          QUANTMLA_CUDA_CHECK_LAUNCH();
          gpu::MlaWriteParams write;
          write.c = c.data();
          write.k_pe = k_pe.data();
          write.seq_ids = ids.data();
          write.positions = positions.data();
          write.pool = pool.data();
          write.block_table = d_table.data();
          write.block_table_stride = max_pages;
          write.num_tokens = n;
          gpu::mla_write(format, write);
        }
        QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
      }
      for (const int heads : head_counts) {
        if ((heads == 128 && !run.heavy && only.empty()) ||
            (heads_only != 0 && heads != heads_only)) {
          continue;
        }
        for (const int context : contexts) {
          for (const int batch : batches) {
            char label[96];
            std::snprintf(label, sizeof label, "%s B=%d ctx=%d H=%d", run.name.c_str(), batch,
                          context, heads);
            if (!only.empty() && only != run.name + "," + std::to_string(batch) + "," +
                                             std::to_string(context) + "," +
                                             std::to_string(heads)) {
              continue;
            }
            if (elapsed() > max_seconds) {
              skipped.push_back(label);
              continue;
            }
            const std::vector<int32_t> lens = draw_lengths(batch, context);
            DeviceArray<int32_t> d_lens(lens);
            gpu::MlaDecodePlan plan(format, lens, s_q, heads, pages_per_split);
            gpu::MlaDecodeParams params;
            params.q = d_q.data();
            params.pool = pool.data();
            params.block_table = d_table.data();
            params.block_table_stride = max_pages;
            params.seq_lens = d_lens.data();
            params.out = d_out.data();
            params.lse = d_lse.data();
            params.batch = batch;
            params.s_q = s_q;
            params.num_heads = heads;
            params.softmax_scale = 1.0f / std::sqrt(192.0f);
            // One graph of the decode (and combine) kernels: each repeat is one launch, so host
            // launch gaps stay out of the timing.
            cudaStream_t stream;
            QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
            cudaGraph_t graph;
            cudaGraphExec_t graph_exec;
            QUANTMLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            gpu::mla_decode(format, params, plan, stream);
            QUANTMLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
            QUANTMLA_CUDA_CHECK(cudaGraphInstantiate(&graph_exec, graph, 0));
            const auto timed = [&] {
              QUANTMLA_CUDA_CHECK(cudaMemsetAsync(flush.data(), 0, flush.bytes() - 64, stream));
              if (clean_flush) bench::read_back(flush, stream);
              QUANTMLA_CUDA_CHECK(cudaEventRecord(start.event, stream));
              QUANTMLA_CUDA_CHECK(cudaGraphLaunch(graph_exec, stream));
              QUANTMLA_CUDA_CHECK(cudaEventRecord(stop.event, stream));
              QUANTMLA_CUDA_CHECK(cudaEventSynchronize(stop.event));
              float ms = 0;
              QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event, stop.event));
              return static_cast<double>(ms);
            };
            const double first = timed();  // warm-up
            // About 0.3 s of repeats per shape, at least 3. A call of over half a second (the
            // compute-bound H = 128, 128K shapes) counts its warm-up as a repeat: the kernel was
            // loaded by the smaller shapes before it, and the lease is short.
            std::vector<double> times;
            if (first > 500.0) times.push_back(first);
            const int repeats = std::clamp(static_cast<int>(300.0 / first), 3, 25);
            while (static_cast<int>(times.size()) < repeats) times.push_back(timed());
            const double ms = bench::median(times);
            QUANTMLA_CUDA_CHECK(cudaGraphExecDestroy(graph_exec));
            QUANTMLA_CUDA_CHECK(cudaGraphDestroy(graph));
            QUANTMLA_CUDA_CHECK(cudaStreamDestroy(stream));
            const double tokens = std::accumulate(lens.begin(), lens.end(), 0.0);
            const auto [run_pages_min, run_pages_max] = plan.run_pages();
            Row row{run.name,
                    batch,
                    context,
                    heads,
                    s_q,
                    ms,
                    tokens * record_bytes / 1e6,
                    tokens * record_bytes / (ms * 1e-3) / 1e9,
                    2.0 * heads * s_q * tokens * (kKeyDim + kLatentDim) / (ms * 1e-3) / 1e12,
                    static_cast<int>(times.size()),
                    plan.num_blocks(),
                    plan.kernel_name(),
                    run_pages_min,
                    run_pages_max};
            rows.push_back(row);
            char runs[32];
            if (run_pages_min == run_pages_max) {
              std::snprintf(runs, sizeof runs, "%d", run_pages_max);
            } else {
              std::snprintf(runs, sizeof runs, "%d-%d", run_pages_min, run_pages_max);
            }
            std::printf(
                "%-20s B=%-3d ctx=%-6d H=%-3d s_q=%d %9.3f ms %9.1f MB %7.0f GB/s (%3.0f%% of "
                "copy) "
                "%6.1f TFLOP/s  [%s, %d blocks, runs of %s pages, %d repeats]\n",
                row.format.c_str(), batch, context, heads, s_q, ms, row.cache_mb, row.gbps,
                100.0 * row.gbps / copy_gbps, row.tflops, row.kernel.c_str(), row.blocks, runs,
                row.repeats);
            std::fflush(stdout);
          }
        }
      }
    }

    // Physical memory of one 128K-token sequence, DeepSeek-V3 shape.
    const CacheShape v3{61, kLatentDim, kRopeDim};
    const int64_t long_tokens = 131072;
    const double bf16_bytes =
        static_cast<double>(cache_physical_bytes(v3, CacheFormat::parse("bf16"), long_tokens));

    // Summary: speed-up over BF16 on the same shape.
    std::printf("\n| format | H | B | ctx | ms | GB/s | %% of copy | TFLOP/s | vs bf16 |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (const Row& row : rows) {
      double speedup = 0.0;
      for (const Row& base : rows) {
        if (base.format == "bf16/bf16" && base.batch == row.batch && base.context == row.context &&
            base.heads == row.heads) {
          speedup = base.ms / row.ms;
        }
      }
      char versus[16] = "-";  // no BF16 row of that shape in this run (--formats)
      if (speedup > 0.0) std::snprintf(versus, sizeof versus, "%.2fx", speedup);
      std::printf("| %s | %d | %d | %d | %.3f | %.0f | %.0f%% | %.1f | %s |\n", row.format.c_str(),
                  row.heads, row.batch, row.context, row.ms, row.gbps, 100.0 * row.gbps / copy_gbps,
                  row.tflops, versus);
    }
    std::printf("\nphysical cache for one %lld-token sequence, 61 layers (DeepSeek-V3 shape):\n",
                static_cast<long long>(long_tokens));
    for (const FormatRun& run : formats) {
      const double bytes =
          static_cast<double>(cache_physical_bytes(v3, CacheFormat::parse(run.spec), long_tokens));
      std::printf(
          "  %-20s %5lld B/token/layer %8.3f GB  %.3fx vs bf16\n", run.name.c_str(),
          static_cast<long long>(CacheFormat::parse(run.spec).record_bytes(kLatentDim, kRopeDim)),
          bytes / 1e9, bf16_bytes / bytes);
    }
    for (const std::string& s : skipped) std::printf("skipped (time budget): %s\n", s.c_str());

    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) throw IoError("cannot write " + json_path);
      std::fprintf(f, "{\n  \"card\": \"%s\",\n  \"date\": \"%s\",\n  \"sms\": %d,\n", prop.name,
                   iso_date().c_str(), prop.multiProcessorCount);
      std::fprintf(f, "  \"driver\": %d,\n  \"runtime\": %d,\n  \"copy_gbps\": %.1f,\n", driver,
                   runtime, copy_gbps);
      std::fprintf(f, "  \"range_ratio\": %.3f,\n  \"seed\": %llu,\n", range_ratio,
                   static_cast<unsigned long long>(seed));
      std::fprintf(f,
                   "  \"timing\": \"CUDA events, L2 flushed (256 MB memset%s) before each repeat, "
                   "median\",\n",
                   clean_flush ? " then read back" : "");
      std::fprintf(f, "  \"rows\": [\n");
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "    {\"format\": \"%s\", \"heads\": %d, \"batch\": %d, \"context\": %d, "
                     "\"s_q\": %d, \"ms\": %.4f, \"cache_mb\": %.2f, \"gbps\": %.1f, "
                     "\"pct_copy\": %.1f, \"tflops\": %.2f, \"repeats\": %d, \"blocks\": %d, "
                     "\"kernel\": \"%s\", \"run_pages_min\": %d, \"run_pages_max\": %d}%s\n",
                     r.format.c_str(), r.heads, r.batch, r.context, r.s_q, r.ms, r.cache_mb, r.gbps,
                     100.0 * r.gbps / copy_gbps, r.tflops, r.repeats, r.blocks, r.kernel.c_str(),
                     r.run_pages_min, r.run_pages_max, i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "  ],\n  \"memory_128k_v3\": [\n");
      for (size_t i = 0; i < formats.size(); ++i) {
        const CacheFormat format = CacheFormat::parse(formats[i].spec);
        const double bytes = static_cast<double>(cache_physical_bytes(v3, format, long_tokens));
        std::fprintf(f,
                     "    {\"format\": \"%s\", \"spec\": \"%s\", \"bytes_per_token_layer\": %lld, "
                     "\"bytes\": %.0f, \"ratio_vs_bf16\": %.4f}%s\n",
                     formats[i].name.c_str(), formats[i].spec.c_str(),
                     static_cast<long long>(format.record_bytes(kLatentDim, kRopeDim)), bytes,
                     bf16_bytes / bytes, i + 1 < formats.size() ? "," : "");
      }
      std::fprintf(f, "  ],\n  \"skipped\": %zu\n}\n", skipped.size());
      std::fclose(f);
      std::printf("wrote %s\n", json_path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
