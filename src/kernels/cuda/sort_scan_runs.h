// How moe_sort's scan (sort_scan_kernel, moe_ops.cu) splits the chunk counts among its threads:
// each expert's column of chunk counts (chunk_counts[c, e], c = 0 .. chunks - 1) is cut into
// scan_parts(E) runs of consecutive chunks, one thread a run, so that a long column is summed by
// many threads side by side. Plain functions, so that the host test (test_host_layouts.cpp) checks
// that the runs cover every count once and each column in order, and the kernel uses the same
// arithmetic.
#pragma once

#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace quantmla::gpu {

inline constexpr int kScanThreads = 1024;  // the scan's one block

// The runs a column is cut into: the threads an expert gets (one run when the experts outnumber
// the threads, each thread then taking every kScanThreads-th expert).
QUANTMLA_HOST_DEVICE constexpr int scan_parts(int num_experts) {
  return num_experts < kScanThreads ? kScanThreads / num_experts : 1;
}

// A thread's run: `part`, its place in its column (-1: the thread has none), its first expert
// (then every kScanThreads-th), and its chunks [first_chunk, end_chunk), possibly empty.
struct ScanRun {
  int part = -1;
  int first_expert = 0;
  int64_t first_chunk = 0, end_chunk = 0;
};

QUANTMLA_HOST_DEVICE constexpr ScanRun scan_run(int thread, int num_experts, int64_t chunks) {
  const int parts = scan_parts(num_experts);
  const int part = thread / num_experts;
  if (part >= parts) return {};
  const int64_t per_part = (chunks + parts - 1) / parts;
  const int64_t first = part * per_part, end = first + per_part;
  return {part, thread % num_experts, first < chunks ? first : chunks, end < chunks ? end : chunks};
}

}  // namespace quantmla::gpu
