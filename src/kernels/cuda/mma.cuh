// Warp-level tensor-core and asynchronous-copy instructions (PTX) used by the decode kernel, and
// the special-function unit's exp2.
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A 16x16 row-major: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, +9],
//                      a3 = A[g+8][2t+8, +9]
//   B 16x8:            b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C 16x8 (FP32):     c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
#pragma once

#include <cstdint>

namespace quantmla::gpu {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The shared-space address of a block's dynamic shared memory's first 1024-byte boundary, where
// 128-byte-swizzled boxes must start (tensor-map copies and wgmma descriptors: the swizzle repeats
// every 1024 bytes); the allocation promises only 16-byte alignment, so a kernel asks for 1024
// bytes more. Its generic pointer is `shared_raw + (base - shared_address(shared_raw))`, written
// at the caller so that the compiler keeps seeing a shared-memory pointer.
__device__ __forceinline__ uint32_t swizzle_base(const uint8_t* shared_raw) {
  return (shared_address(shared_raw) + 1023) / 1024 * 1024;
}

// 2^x by the special-function unit alone (ex2.approx.ftz, what exp2f becomes under
// --use_fast_math), for a page's probabilities: exp2f's care for subnormal results costs four
// more instructions an element, and a probability below 2^-126 (of its row's largest) comes out
// as 0 instead.
__device__ __forceinline__ float exp2_flushed(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a * b, BF16 inputs, FP32 accumulation.
__device__ __forceinline__ void mma_bf16_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a * b, FP16 inputs (subnormal ones kept: measured on the H200, decode_fragments.cuh), FP32
// accumulation.
__device__ __forceinline__ void mma_f16_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without passing through registers; src_bytes < 16 fills the rest of
// the 16 bytes with zeros (0: all zeros, nothing read).
__device__ __forceinline__ void cp_async_16(uint32_t shared, const void* global, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(global),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---- Bulk copies completing on a shared-memory barrier (sm_90), for a producer warp that streams
// whole pages while the consumer warps compute.

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(arrivals)
               : "memory");
}
// Makes the initialized barriers visible to the asynchronous proxy (the bulk-copy engine).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's ordinary shared-memory writes before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier))
               : "memory");
}
// One arrival that also expects `bytes` of bulk-copy traffic before the phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}
// `bytes` (a multiple of 16, 16-byte aligned) of global memory requested into L2 by the bulk-copy
// engine, nothing waiting for them: a later copy of them then comes from L2.
__device__ __forceinline__ void bulk_prefetch_l2(const void* global, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared by the bulk-copy
// engine; the barrier's transaction count drops by `bytes` when they have landed.
__device__ __forceinline__ void bulk_copy_to_shared(void* shared, const void* global,
                                                    uint32_t bytes, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(shared_address(shared)),
      "l"(global), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}
// Tensor-map copies (TMA): the box of the map at the given coordinates (innermost first) into
// shared memory at `shared` (1024-byte aligned for the 128-byte swizzle), completing `bytes` of
// the barrier's transaction count (the whole box, zero-filled where it leaves the tensor). `map`
// is a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tma_load_2d(uint32_t shared, const void* map, int c0, int c1,
                                            uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(shared),
      "l"(map), "r"(c0), "r"(c1), "r"(shared_address(barrier))
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t shared, const void* map, int c0, int c1,
                                            int c2, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(shared),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(shared_address(barrier))
      : "memory");
}
// The global timer (ns) and this block's SM, for diagnostics.
__device__ __forceinline__ uint64_t global_time() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
  return id;
}
// A barrier among `threads` threads (a multiple of 32) of the block, id 1-15 (0 is __syncthreads).
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at named barrier `id` without waiting: the other threads of its count wait there with
// named_barrier (a producer signalling consumers).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace quantmla::gpu
