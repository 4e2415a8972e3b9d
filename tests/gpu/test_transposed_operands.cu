// The transposed decode kernel's two products (decode_transposed.cu) alone, against a double
// reference on random BF16 inputs: S^T = K Q^T with the page's keys as A (K-major, its nine boxes
// as the tensor-map copies lay them out) and Q's 16 rows as B (a tile of 16-row blocks), and
// O^T = V^T P^T with the page's channels as A, read transposed from the same boxes (MN-major), and
// P^T (16 rows x 64 keys) as B. A failure here is the descriptors' or the layouts', not the
// kernel's softmax or pipeline. Exit 77 without a device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "checks.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/swizzle_layouts.h"
#include "kernels/cuda/wgmma.cuh"
#include "quantmla/dtype.h"

namespace {

using namespace quantmla;
using namespace quantmla::gpu;
using gpu_checks::expect;

constexpr int kBox = 64 * 128;  // one box: 64 rows of 64 BF16
constexpr int kQBoxes = 9;      // 576 channels

constexpr int kQueryBlock = 16 * 128;  // Q's 16 rows x 64 channels, or P^T's 16 rows x 64 keys
constexpr int kTransposedImage = kQBoxes * kBox + kQBoxes * kQueryBlock + kQueryBlock;

// The m64n16k16 products in one warpgroup, their accumulators NaN at first, so that the first
// product of each must overwrite them. Out row-major: S^T [64 keys][16], O^T [512 channels][16].

__global__ void __launch_bounds__(128)
    transposed_kernel(const uint4* image, float* s_out, float* o_out) {
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint4* const dst = reinterpret_cast<uint4*>(shared_raw + (base - shared_address(shared_raw)));
  for (int i = threadIdx.x; i < kTransposedImage / 16; i += 128) dst[i] = image[i];
  fence_proxy_async_shared();
  __syncthreads();
  const uint32_t keys = base, q = base + kQBoxes * kBox, probs = q + kQBoxes * kQueryBlock;
  float s[2][4], o[8][2][4];
  for (float& v : s[0]) v = __int_as_float(0x7fc00000);
  for (float& v : s[1]) v = __int_as_float(0x7fc00000);
  for (auto& block : o) {
    for (float(&n)[4] : block) {
      for (float& v : n) v = __int_as_float(0x7fc00000);
    }
  }
  wgmma_fence();
  for (int step = 0; step < 36; ++step) {
    const uint32_t column = (step % 4) * 32;
    wgmma_m64n16k16_ss<false>(s, wgmma_descriptor(keys + (step / 4) * kBox + column),
                              wgmma_descriptor(q + (step / 4) * kQueryBlock + column), step > 0);
  }
  for (int m = 0; m < 8; ++m) {
    for (int k = 0; k < 4; ++k) {
      wgmma_m64n16k16_ss<true>(o[m], wgmma_descriptor_mn(keys + m * kBox + k * 16 * 128, kBox),
                               wgmma_descriptor(probs + k * 32), k > 0);
    }
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_registers(s[0]);
  wgmma_fence_registers(s[1]);
  for (auto& block : o) {
    wgmma_fence_registers(block[0]);
    wgmma_fence_registers(block[1]);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  for (int n = 0; n < 2; ++n) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + (e < 2 ? 0 : 8), column = 8 * n + 2 * t4 + e % 2;
      s_out[row * 16 + column] = s[n][e];
      for (int m = 0; m < 8; ++m) o_out[(64 * m + row) * 16 + column] = o[m][n][e];
    }
  }
}

void run_transposed_case() {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // page [64 keys, 576], q [16, 576], p [16 rows, 64 keys], BF16 values.
  std::vector<float> page(64 * 576), q(16 * 576), p(16 * 64);
  for (float& v : page) v = bf16_to_f32(f32_to_bf16(normal(gpu_checks::rng)));
  for (float& v : q) v = bf16_to_f32(f32_to_bf16(normal(gpu_checks::rng)));
  for (float& v : p) v = bf16_to_f32(f32_to_bf16(std::fabs(normal(gpu_checks::rng))));
  std::vector<uint8_t> image(kTransposedImage);
  const auto place = [&](size_t at, float v) {
    const uint16_t bits = f32_to_bf16(v);
    std::memcpy(image.data() + at, &bits, 2);
  };
  for (int c = 0; c < 576; ++c) {
    for (int key = 0; key < 64; ++key) {
      place((c / 64) * kBox + tma_box_offset(key, c % 64), page[key * 576 + c]);
    }
    for (int r = 0; r < 16; ++r) {
      place(kQBoxes * kBox + (c / 64) * kQueryBlock + tma_box_offset(r, c % 64), q[r * 576 + c]);
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int key = 0; key < 64; ++key) {
      place(kQBoxes * kBox + kQBoxes * kQueryBlock + tma_box_offset(r, key), p[r * 64 + key]);
    }
  }
  DeviceArray<uint8_t> d_image(image.size());
  QUANTMLA_CUDA_CHECK(
      cudaMemcpy(d_image.data(), image.data(), image.size(), cudaMemcpyHostToDevice));
  DeviceArray<float> d_s(64 * 16), d_o(512 * 16);
  const size_t shared = kTransposedImage + 1024;
  QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(
      transposed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  transposed_kernel<<<1, 128, shared>>>(reinterpret_cast<const uint4*>(d_image.data()), d_s.data(),
                                        d_o.data());
  QUANTMLA_CUDA_CHECK_LAUNCH();
  std::vector<float> s(64 * 16), o(512 * 16);
  QUANTMLA_CUDA_CHECK(cudaMemcpy(s.data(), d_s.data(), s.size() * 4, cudaMemcpyDeviceToHost));
  QUANTMLA_CUDA_CHECK(cudaMemcpy(o.data(), d_o.data(), o.size() * 4, cudaMemcpyDeviceToHost));
  double worst_s = 0.0, worst_o = 0.0;
  int nans = 0;
  // got against the exact sum of the n products term(i), allowed n x 2^-24 of their magnitudes.
  const auto check = [&](float got, int n, auto term, double& worst) {
    double sum = 0.0, magnitude = 0.0;
    for (int i = 0; i < n; ++i) {
      const double t = term(i);
      sum += t, magnitude += std::fabs(t);
    }
    if (std::isnan(got)) {
      ++nans;
    } else {
      worst = std::max(worst, std::fabs(got - sum) / (n * 0x1p-24 * magnitude));
    }
  };
  for (int r = 0; r < 16; ++r) {
    for (int key = 0; key < 64; ++key) {
      check(
          s[key * 16 + r], 576,
          [&](int c) { return static_cast<double>(page[key * 576 + c]) * q[r * 576 + c]; },
          worst_s);
    }
    for (int c = 0; c < 512; ++c) {
      check(
          o[c * 16 + r], 64,
          [&](int key) { return static_cast<double>(page[key * 576 + c]) * p[r * 64 + key]; },
          worst_o);
    }
  }
  char line[192];
  std::snprintf(line, sizeof line,
                "transposed: S^T (keys as A, K-major) err/allowed %.3g, O^T (values as A, "
                "MN-major) %.3g, %d NaN",
                worst_s, worst_o, nans);
  std::printf("%s\n", line);
  expect(worst_s <= 1.0 && worst_o <= 1.0 && nans == 0, line);
}

}  // namespace

int main(int argc, char** argv) {
  return gpu_checks::run(argc, argv, [] { run_transposed_case(); });
}
