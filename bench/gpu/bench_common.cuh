// What the GPU benchmarks share: counter-hash random fills (no generator state per thread, the
// same data for a given seed on every run), CUDA events, the median of repeats, and the copy
// bandwidth that the benchmarks' ceilings are measured against in the same run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"

namespace quantmla::bench {

// Uniform in [-1, 1) from a 64-bit counter (a splitmix-style finalizer).
__device__ __forceinline__ float hash_uniform(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__device__ __forceinline__ float seeded_uniform(uint64_t seed, int64_t i) {
  return hash_uniform(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
}

// out[i] = scale * uniform(seed, i), FP32 or BF16 bits (truncated), grid-stride.
__global__ void random_f32(float* out, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = scale * seeded_uniform(seed, i);
  }
}
__global__ void random_bf16(uint16_t* out, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = static_cast<uint16_t>(__float_as_uint(scale * seeded_uniform(seed, i)) >> 16);
  }
}
// Launch sizes for the fills: grid-stride, so a capped grid covers any n.
inline unsigned fill_blocks(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 4096));
}

struct Event {
  cudaEvent_t event = nullptr;
  Event() { QUANTMLA_CUDA_CHECK(cudaEventCreate(&event)); }
  ~Event() { cudaEventDestroy(event); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds of `repeats` calls of f, each timed by CUDA events on the default stream
// after before_each() (e.g. an L2 flush), after 3 warm-up calls.
template <class F, class Before>
double median_us(F&& f, int repeats, Before&& before_each) {
  Event start, stop;
  std::vector<double> times;
  for (int r = 0; r < repeats + 3; ++r) {
    before_each(r);
    QUANTMLA_CUDA_CHECK(cudaEventRecord(start.event));
    f();
    QUANTMLA_CUDA_CHECK(cudaEventRecord(stop.event));
    QUANTMLA_CUDA_CHECK(cudaEventSynchronize(stop.event));
    float ms = 0;
    QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event, stop.event));
    if (r >= 3) times.push_back(ms * 1e3);
  }
  return median(times);
}

// Reads every 16 bytes of data (the second half of an L2 flush: see median_us_flushed).
__global__ void read_all(const uint4* data, size_t count, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // never in practice; keeps the loads
}

// The second half of an L2 flush on `stream`: every byte of `flush` but its last 64 (read_all's
// sink) read back, so that the L2 holds clean lines after the write that evicted the rest.
inline void read_back(gpu::DeviceArray<uint8_t>& flush, cudaStream_t stream = nullptr) {
  read_all<<<1056, 512, 0, stream>>>(
      reinterpret_cast<const uint4*>(flush.data()), (flush.bytes() - 64) / 16,
      reinterpret_cast<uint32_t*>(flush.data() + flush.bytes() - 64));
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

// median_us with the L2 flushed before each repeat by writing `flush` (256 MB or more) and reading
// it back: a write alone leaves the L2 full of dirty lines, and the timed kernel would pay for
// writing them back.
template <class F>
double median_us_flushed(F&& f, gpu::DeviceArray<uint8_t>& flush, int repeats) {
  return median_us(f, repeats, [&](int r) {
    QUANTMLA_CUDA_CHECK(cudaMemsetAsync(flush.data(), r & 0xff, flush.bytes() - 64));
    read_back(flush);
  });
}

// Device-to-device copy of 2 GiB, bytes read plus written over the median time of 10 repeats.
inline double copy_bandwidth_gbps() {
  const size_t bytes = size_t{2} << 30;
  gpu::DeviceArray<uint8_t> a(bytes), b(bytes);
  a.fill_bytes(1);
  Event start, stop;
  std::vector<double> times;
  for (int r = 0; r < 12; ++r) {
    QUANTMLA_CUDA_CHECK(cudaEventRecord(start.event));
    QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));
    QUANTMLA_CUDA_CHECK(cudaEventRecord(stop.event));
    QUANTMLA_CUDA_CHECK(cudaEventSynchronize(stop.event));
    float ms = 0;
    QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event, stop.event));
    if (r >= 2) times.push_back(ms);
  }
  return 2.0 * static_cast<double>(bytes) / (median(times) * 1e-3) / 1e9;
}

}  // namespace quantmla::bench
