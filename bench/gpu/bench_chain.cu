// What one link of a chain of dependent kernels costs inside a CUDA graph: the floor under a
// batch-1 decode step, whose ~11 kernels a layer each wait for the one before (docs/benchmarks.md,
// "Runner"). Three kinds of link, each in a graph of `links` launches on one stream, with and
// without programmatic dependent launch (launch.cuh: wait, then let the successor be scheduled):
// - empty: a kernel that only waits (the launch and scheduling alone);
// - relay: each block reads a value the previous kernel wrote and writes one (the data's round
//   trip through L2 as well);
// - skinny: skinny_gemm at m = 1 over a [n, k] weight of its own per link (64 links x 8 MB for
//   2048 x 2048: larger than the L2, so each link streams its weights as a decode step does), its
//   BF16 output the next link's input; beside it the weights' transfer at the copy rate. Each
//   shape with the tiling skinny_gemm chooses and with half its warps (half the shared memory,
//   so that the next link's blocks find room on an SM while this link's still run).
// Timing: CUDA events around a graph replay, median of the repeats after 3 warm-ups, divided by
// the links. Prints a table; --json FILE writes the rows.
//   bench_chain [--links N] [--repeats N] [--json FILE]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/skinny_gemm.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

__global__ void empty_link() { gpu::wait_for_previous_kernel(); }

// in, out: [gridDim.x] int32.
__global__ void relay_link(const int32_t* in, int32_t* out) {
  gpu::wait_for_previous_kernel();
  if (threadIdx.x == 0) out[blockIdx.x] = in[blockIdx.x] + 1;
}

struct Row {
  std::string link;
  int64_t blocks_or_n = 0, k = 0;
  bool programmatic = false;
  double us_per_link = 0, transfer_us = 0;
  gpu::SkinnyTiling tiling{};  // skinny links
};

// Median microseconds of one link: `add_links` launches the chain on `stream` (captured once).
template <class AddLinks>
double time_chain(int links, int repeats, AddLinks&& add_links) {
  cudaStream_t stream;
  QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  QUANTMLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  add_links(stream);
  QUANTMLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  QUANTMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // Replayed on the default stream, where bench::median_us's events are recorded.
  const double us =
      bench::median_us([&] { QUANTMLA_CUDA_CHECK(cudaGraphLaunch(exec, 0)); }, repeats, [](int) {});
  QUANTMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  QUANTMLA_CUDA_CHECK(cudaGraphDestroy(graph));
  QUANTMLA_CUDA_CHECK(cudaStreamDestroy(stream));
  return us / links;
}

}  // namespace

int main(int argc, char** argv) {
  int links = 64, repeats = 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--links") && i + 1 < argc) {
      links = std::max(2, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--repeats") && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--links N] [--repeats N] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const double copy_gbps = bench::copy_bandwidth_gbps();
    std::printf("%s, %d SMs: copy %.0f GB/s; %d links a graph, median of %d replays\n", prop.name,
                prop.multiProcessorCount, copy_gbps, links, repeats);
    std::vector<Row> rows;
    DeviceArray<int32_t> a(4096), b(4096);
    a.fill_bytes(0);
    b.fill_bytes(0);
    for (const bool programmatic : {false, true}) {
      gpu::set_programmatic_launch(programmatic);
      for (const int blocks : {1, prop.multiProcessorCount, 2 * prop.multiProcessorCount}) {
        Row empty{"empty", blocks, 0, programmatic};
        empty.us_per_link = time_chain(links, repeats, [&](cudaStream_t s) {
          for (int l = 0; l < links; ++l) gpu::launch_kernel(empty_link, blocks, 128, 0, s);
        });
        rows.push_back(empty);
        Row relay{"relay", blocks, 0, programmatic};
        relay.us_per_link = time_chain(links, repeats, [&](cudaStream_t s) {
          for (int l = 0; l < links; ++l) {
            gpu::launch_kernel(relay_link, blocks, 128, 0, s, l % 2 ? b.data() : a.data(),
                               l % 2 ? a.data() : b.data());
          }
        });
        rows.push_back(relay);
      }
      // V2-Lite's decode products at one token: o_proj, the fused q / kv_a, kv_a alone.
      for (const auto& [n, k] :
           std::vector<std::pair<int64_t, int64_t>>{{2048, 2048}, {3648, 2048}, {576, 2048}}) {
        const int64_t weight = n * k;
        DeviceArray<uint16_t> weights(weight * links);
        bench::random_bf16<<<4096, 256>>>(weights.data(), weight * links, 0.02f, 5);
        QUANTMLA_CUDA_CHECK_LAUNCH();
        const int64_t width = std::max(n, k);
        DeviceArray<uint16_t> x(width), y(width);
        bench::random_bf16<<<16, 256>>>(x.data(), width, 1.0f, 6);
        bench::random_bf16<<<16, 256>>>(y.data(), width, 1.0f, 7);
        QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize());
        const auto params = [&](int l) {
          gpu::SkinnyGemmParams p;
          p.x = l % 2 ? y.data() : x.data();
          p.ldx = k;
          p.x_rows = 1;
          p.max_rows = 1;
          p.weight = weights.data() + weight * l;
          p.n = n;
          p.k = k;
          p.y = l % 2 ? x.data() : y.data();
          p.ldy = n;
          p.out_dtype = DType::kBF16;
          return p;
        };
        // The tiling skinny_gemm chooses, then the same with half its warps (half the shared
        // memory: room on each SM for the next link's blocks to be scheduled early).
        const gpu::SkinnyTiling chosen = gpu::skinny_gemm_tiling(params(0));
        for (const int warps : {chosen.warps, chosen.warps / 2}) {
          if (warps < 1 || (warps != chosen.warps && warps < 2)) continue;
          gpu::SkinnyTiling tiling = chosen;
          tiling.warps = warps;
          Row skinny{"skinny", n, k, programmatic};
          skinny.tiling = tiling;
          skinny.transfer_us = weight * 2 / (copy_gbps * 1e9) * 1e6;
          skinny.us_per_link = time_chain(links, repeats, [&](cudaStream_t s) {
            for (int l = 0; l < links; ++l) gpu::skinny_gemm(params(l), tiling, s);
          });
          rows.push_back(skinny);
        }
      }
    }
    std::printf(
        "\n| link | blocks or n x k | tile_n x warps | programmatic | us a link | weights at the "
        "copy rate |\n| --- | --- | --- | --- | --- | --- |\n");
    for (const Row& r : rows) {
      const std::string shape = r.k ? std::to_string(r.blocks_or_n) + " x " + std::to_string(r.k)
                                    : std::to_string(r.blocks_or_n);
      const std::string tiling =
          r.k ? std::to_string(r.tiling.tile_n) + " x " + std::to_string(r.tiling.warps) : "";
      std::printf("| %s | %s | %s | %s | %.2f | %s |\n", r.link.c_str(), shape.c_str(),
                  tiling.c_str(), r.programmatic ? "yes" : "no", r.us_per_link,
                  r.k ? (std::to_string(r.transfer_us).substr(0, 4) + " us").c_str() : "");
    }
    if (!json_path.empty()) {
      std::ofstream out(json_path);
      out << "{\"device\": \"" << prop.name << "\", \"copy_gbps\": " << copy_gbps
          << ", \"links\": " << links << ", \"rows\": [\n";
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        out << "  {\"link\": \"" << r.link << "\", \"blocks_or_n\": " << r.blocks_or_n
            << ", \"k\": " << r.k << ", \"tile_n\": " << r.tiling.tile_n
            << ", \"warps\": " << r.tiling.warps
            << ", \"programmatic\": " << (r.programmatic ? "true" : "false")
            << ", \"us_per_link\": " << r.us_per_link << ", \"transfer_us\": " << r.transfer_us
            << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
      }
      out << "]}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_chain: %s\n", e.what());
    return 1;
  }
  return 0;
}
