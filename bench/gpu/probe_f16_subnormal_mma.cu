// Probe of the FP16 arithmetic the fragment decode kernel relies on (decode_fragments.cuh;
// docs/benchmarks.md, decode kernel v2, fifth session): does mma.sync m16n8k16 with FP16 inputs
// keep subnormal A operands (the kernel's value codes, code * 2^-24), how many bits do their
// products keep against a double sum, and does HMUL2 round products into the subnormal range
// correctly (the kernel's P times a group scale)? Standalone, no project code:
//   nvcc -std=c++20 -gencode arch=compute_90a,code=sm_90a -O3 -o probe \
//     bench/gpu/probe_f16_subnormal_mma.cu
//   for mode in 0 1 2; do for spread in 1 4 20; do ./probe $mode $spread; done; done
// mode: how A holds the codes 0..15: 0 FP16 subnormals (the bits of code at bit 0 or bit 4, as the
// kernel masks them), 1 normal FP16 numbers, 2 the biased normal numbers 1024 + code. spread: B's
// exponents are spread over 2^spread.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace {

constexpr int kProducts = 4096;  // HMUL2 pairs

__global__ void probe_kernel(const uint32_t* a_fragments, const uint32_t* b_fragments, float* sums,
                             const uint32_t* x, const uint32_t* y, uint32_t* products) {
  const int lane = threadIdx.x;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint32_t* a = a_fragments + 4 * lane;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b_fragments[2 * lane]),
        "r"(b_fragments[2 * lane + 1]));
  for (int i = 0; i < 4; ++i) sums[4 * lane + i] = d[i];
  for (int i = lane; i < kProducts; i += 32) {
    const __half2 product =
        __hmul2(*reinterpret_cast<const __half2*>(x + i), *reinterpret_cast<const __half2*>(y + i));
    products[i] = *reinterpret_cast<const uint32_t*>(&product);
  }
}

uint16_t half_bits(float v) {
  const __half h = __float2half(v);
  return *reinterpret_cast<const uint16_t*>(&h);
}
double half_value(uint16_t bits) { return __half2float(*reinterpret_cast<const __half*>(&bits)); }
uint32_t pack(uint16_t low, uint16_t high) { return low | static_cast<uint32_t>(high) << 16; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MODE(0|1|2) SPREAD\n", argv[0]);
    return 2;
  }
  const int mode = std::atoi(argv[1]), spread = std::max(1, std::atoi(argv[2]));
  std::mt19937 rng(7);
  uint16_t a[16][16], b[16][8];  // A row-major 16 x 16, B 16 x 8
  for (int m = 0; m < 16; ++m) {
    for (int k = 0; k < 16; ++k) {
      const int code = static_cast<int>(rng() % 16);
      a[m][k] = mode == 0   ? static_cast<uint16_t>(k % 2 ? code << 4 : code)
                : mode == 1 ? half_bits(static_cast<float>(code))
                            : half_bits(1024.0f + static_cast<float>(code));
    }
  }
  for (int k = 0; k < 16; ++k) {
    for (int n = 0; n < 8; ++n) {
      const float mantissa = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
      b[k][n] = half_bits(std::ldexp(mantissa, static_cast<int>(rng() % spread) - spread / 2));
    }
  }
  // mma.m16n8k16 fragments (g = lane / 4, t = lane % 4), as in src/kernels/cuda/mma.cuh.
  uint32_t a_fragments[128], b_fragments[64];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    a_fragments[4 * lane + 0] = pack(a[g][2 * t], a[g][2 * t + 1]);
    a_fragments[4 * lane + 1] = pack(a[g + 8][2 * t], a[g + 8][2 * t + 1]);
    a_fragments[4 * lane + 2] = pack(a[g][2 * t + 8], a[g][2 * t + 9]);
    a_fragments[4 * lane + 3] = pack(a[g + 8][2 * t + 8], a[g + 8][2 * t + 9]);
    b_fragments[2 * lane + 0] = pack(b[2 * t][g], b[2 * t + 1][g]);
    b_fragments[2 * lane + 1] = pack(b[2 * t + 8][g], b[2 * t + 9][g]);
  }
  // HMUL2 operands: x down to 2^-24, y (a scale) down to 2^-8, so that products reach subnormals.
  static uint32_t x[kProducts], y[kProducts], products[kProducts];
  const auto random_half = [&](int lowest_exponent) {
    return half_bits(std::ldexp(static_cast<float>(rng() % 1024 + 1) / 1024.0f,
                                -static_cast<int>(rng() % lowest_exponent)));
  };
  for (int i = 0; i < kProducts; ++i) {
    x[i] = pack(random_half(24), random_half(24));
    y[i] = pack(random_half(8), random_half(8));
  }
  uint32_t *device_a, *device_b, *device_x, *device_y, *device_products;
  float* device_sums;
  cudaMalloc(&device_a, sizeof a_fragments);
  cudaMalloc(&device_b, sizeof b_fragments);
  cudaMalloc(&device_sums, 128 * sizeof(float));
  cudaMalloc(&device_x, sizeof x);
  cudaMalloc(&device_y, sizeof y);
  cudaMalloc(&device_products, sizeof products);
  cudaMemcpy(device_a, a_fragments, sizeof a_fragments, cudaMemcpyHostToDevice);
  cudaMemcpy(device_b, b_fragments, sizeof b_fragments, cudaMemcpyHostToDevice);
  cudaMemcpy(device_x, x, sizeof x, cudaMemcpyHostToDevice);
  cudaMemcpy(device_y, y, sizeof y, cudaMemcpyHostToDevice);
  probe_kernel<<<1, 32>>>(device_a, device_b, device_sums, device_x, device_y, device_products);
  float sums[128];
  if (cudaMemcpy(sums, device_sums, sizeof sums, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(products, device_products, sizeof products, cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  double worst = 0.0;
  int flushed = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const int m = lane / 4 + 8 * (i / 2), n = 2 * (lane % 4) + i % 2;
      double exact = 0.0, magnitude = 0.0;
      for (int k = 0; k < 16; ++k) {
        exact += half_value(a[m][k]) * half_value(b[k][n]);
        magnitude += std::fabs(half_value(a[m][k]) * half_value(b[k][n]));
      }
      const double got = sums[4 * lane + i];
      flushed += got == 0.0 && exact != 0.0;
      if (magnitude > 0.0) worst = std::max(worst, std::fabs(got - exact) / magnitude);
    }
  }
  std::printf(
      "mode %d spread %d: mma f16 worst |err| / sum |terms| %.3g (FP32 unit 6e-8), flushed "
      "outputs %d of 128\n",
      mode, spread, worst, flushed);
  int misrounded = 0;
  for (int i = 0; i < kProducts; ++i) {
    for (int half = 0; half < 2; ++half) {
      const auto bits = [&](uint32_t v) { return static_cast<uint16_t>(v >> (16 * half)); };
      // The product of two FP16 values is exact in float; one rounding to FP16 is the answer.
      const float exact = static_cast<float>(half_value(bits(x[i])) * half_value(bits(y[i])));
      misrounded += half_bits(exact) != bits(products[i]);
    }
  }
  std::printf("hmul2 into subnormals: %d of %d differ from the rounded product\n", misrounded,
              2 * kProducts);
  return 0;
}
