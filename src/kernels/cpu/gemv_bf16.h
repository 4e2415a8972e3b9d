// Matrix-vector products on BF16 weights with FP32 inputs and accumulation: the decode path reads
// each weight once per token, so halving its bytes against FP32 halves the time (and BF16
// checkpoints lose nothing). AVX2+FMA when the CPU has it (checked at run time), else scalar.
#pragma once

#include <cstdint>

namespace quantmla::cpu {

// y[n] (+)= W[n, k] x[k]; W row-major with leading dimension ldw.
void gemv_bf16(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t n, int64_t k,
               bool accumulate);
// y[n] (+)= x[k] W[k, n]  (the transposed product).
void gemv_t_bf16(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t k, int64_t n,
                 bool accumulate);

// Plain scalar references of the same functions (double accumulation), for the tests.
void gemv_bf16_reference(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t n,
                         int64_t k, bool accumulate);
void gemv_t_bf16_reference(const uint16_t* w, int64_t ldw, const float* x, float* y, int64_t k,
                           int64_t n, bool accumulate);

// True when the AVX2 path is in use on this CPU.
bool gemv_bf16_uses_avx2();

}  // namespace quantmla::cpu
