// The warpgroup products of the warpgroup decode kernel (decode_warpgroup.cu) on their own, against
// a double reference on random BF16 inputs: S = Q K^T with the keys' B operand K-major at a 32-row
// offset in its boxes (m64n32), and O = P V with V read untransposed from the same boxes as an
// MN-major B operand (m64n256, wgmma_descriptor_mn). The operands are laid out on the host exactly
// as the kernel's tensor-map copies lay them out (swizzle_layouts.h), so a failure here is the
// descriptors' or the layouts', not the kernel's softmax or pipeline. Exit 77 without a device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
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

constexpr int kBox = 64 * 128;                          // one box: 64 rows of 64 BF16
constexpr int kQBoxes = 9;                              // Q and the page: 576 channels
constexpr int kImageBytes = 2 * kQBoxes * kBox + kBox;  // Q, the page, P

// One warpgroup: the three images into 1024-byte-aligned shared memory, then S for the keys
// [32 half, 32 half + 32) and O over channels [256 half, 256 half + 256); the accumulators out in
// row-major order.
__global__ void __launch_bounds__(128)
    operands_kernel(const uint4* image, int half, float* s_out, float* o_out) {
  extern __shared__ __align__(16) uint8_t shared_raw[];
  const uint32_t base = swizzle_base(shared_raw);
  uint4* const dst = reinterpret_cast<uint4*>(shared_raw + (base - shared_address(shared_raw)));
  for (int i = threadIdx.x; i < kImageBytes / 16; i += 128) dst[i] = image[i];
  fence_proxy_async_shared();
  __syncthreads();
  const uint32_t q = base, keys = base + kQBoxes * kBox, probs = base + 2 * kQBoxes * kBox;
  float s[16], o[128];
  wgmma_fence();
  for (int step = 0; step < 36; ++step) {
    const uint32_t column = (step / 4) * kBox + (step % 4) * 32;
    wgmma_m64nk16_ss<32>(s, wgmma_descriptor(q + column),
                         wgmma_descriptor(keys + half * 32 * 128 + column), step);
  }
  for (int k = 0; k < 4; ++k) {
    wgmma_m64nk16_ss<256, true>(o, wgmma_descriptor(probs + k * 32),
                                wgmma_descriptor_mn(keys + half * 4 * kBox + k * 16 * 128, kBox),
                                k);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_registers(s);
  wgmma_fence_registers(o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = 16 * warp + g + (e < 2 ? 0 : 8);
    for (int j = 0; j < 4; ++j) s_out[row * 32 + 8 * j + 2 * t4 + e % 2] = s[4 * j + e];
    for (int j = 0; j < 32; ++j) o_out[row * 256 + 8 * j + 2 * t4 + e % 2] = o[4 * j + e];
  }
}

void run_case(int half) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // q [64, 576], page [64 keys, 576], p [64 rows, 64 keys], BF16 values.
  std::vector<float> q(64 * 576), page(64 * 576), p(64 * 64);
  for (float& v : q) v = bf16_to_f32(f32_to_bf16(normal(gpu_checks::rng)));
  for (float& v : page) v = bf16_to_f32(f32_to_bf16(normal(gpu_checks::rng)));
  for (float& v : p) v = bf16_to_f32(f32_to_bf16(std::fabs(normal(gpu_checks::rng))));
  std::vector<uint8_t> image(kImageBytes);
  const auto place = [&](size_t at, float v) {
    const uint16_t bits = f32_to_bf16(v);
    std::memcpy(image.data() + at, &bits, 2);
  };
  for (int r = 0; r < 64; ++r) {
    for (int c = 0; c < 576; ++c) {
      place((c / 64) * kBox + tma_box_offset(r, c % 64), q[r * 576 + c]);
      place(kQBoxes * kBox + (c / 64) * kBox + tma_box_offset(r, c % 64), page[r * 576 + c]);
    }
    for (int k = 0; k < 64; ++k) place(2 * kQBoxes * kBox + tma_box_offset(r, k), p[r * 64 + k]);
  }
  DeviceArray<uint8_t> d_image(image.size());
  QUANTMLA_CUDA_CHECK(
      cudaMemcpy(d_image.data(), image.data(), image.size(), cudaMemcpyHostToDevice));
  DeviceArray<float> d_s(64 * 32), d_o(64 * 256);
  const size_t shared = kImageBytes + 1024;
  QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(
      operands_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
  operands_kernel<<<1, 128, shared>>>(reinterpret_cast<const uint4*>(d_image.data()), half,
                                      d_s.data(), d_o.data());
  QUANTMLA_CUDA_CHECK_LAUNCH();
  std::vector<float> s(64 * 32), o(64 * 256);
  QUANTMLA_CUDA_CHECK(cudaMemcpy(s.data(), d_s.data(), s.size() * 4, cudaMemcpyDeviceToHost));
  QUANTMLA_CUDA_CHECK(cudaMemcpy(o.data(), d_o.data(), o.size() * 4, cudaMemcpyDeviceToHost));

  // Exact products of BF16 values summed in FP32: within n units of FP32 rounding of the sum of
  // magnitudes, n the products summed (576 or 64). The error over that allowance of `got` against
  // the sum of a[i a_stride] b[i b_stride], i < n, in double.
  const auto error_ratio = [](float got, const float* a, int a_stride, const float* b, int b_stride,
                              int n) {
    double sum = 0.0, magnitude = 0.0;
    for (int i = 0; i < n; ++i) {
      const double term = static_cast<double>(a[i * a_stride]) * b[i * b_stride];
      sum += term, magnitude += std::fabs(term);
    }
    return std::fabs(got - sum) / (n * 0x1p-24 * magnitude);
  };
  double worst_s = 0.0, worst_o = 0.0;
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < 32; ++n) {
      const int key = 32 * half + n;
      worst_s =
          std::max(worst_s, error_ratio(s[r * 32 + n], &q[r * 576], 1, &page[key * 576], 1, 576));
    }
    for (int n = 0; n < 256; ++n) {
      const int channel = 256 * half + n;
      worst_o =
          std::max(worst_o, error_ratio(o[r * 256 + n], &p[r * 64], 1, &page[channel], 576, 64));
    }
  }
  char line[160];
  std::snprintf(line, sizeof line,
                "warpgroup %d: S (K-major keys) err/allowed %.3g, O (MN-major values) %.3g", half,
                worst_s, worst_o);
  std::printf("%s\n", line);
  expect(worst_s <= 1.0 && worst_o <= 1.0, line);
}

}  // namespace

int main(int argc, char** argv) {
  return gpu_checks::run(argc, argv, [] {
    for (const int half : {0, 1}) run_case(half);
  });
}
