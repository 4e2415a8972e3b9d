// Warpgroup matrix multiply-accumulate (wgmma, sm_90a) and the shared-memory descriptors it reads
// its operands through. A warpgroup is 4 consecutive warps starting at a warp index divisible by
// 4; every wgmma below is issued by all 128 of its threads.
//
// Operand tiles in shared memory use the 128-byte swizzle, K-major (the K dimension contiguous):
// a tile of R rows x K columns of BF16 is stored as K / 64 column blocks of R x 64, each R rows of
// 128 bytes; the 16-byte chunk c of row r sits at chunk c ^ (r % 8) of its row. Every column block
// starts at a multiple of 1024 bytes (the swizzle repeats every 8 rows), so a descriptor for the
// 16 columns of k-step s starts at block s / 4, byte (s % 4) * 32 of its first row.
//
// Accumulator fragments of an m64nN product (FP32, N / 2 registers a thread): thread t of the
// warpgroup holds rows 16 * (t / 32) + (t % 32) / 4 (+ 8), and d[4 * j + e] is column
// 8 * j + 2 * (t % 4) + (e % 2) of the first row (e < 2) or of the second (e >= 2): per warp,
// the fragments of mma.m16n8 (mma.cuh). A from registers (m64k16) has mma.m16n8k16's A layout
// per warp, over the warp's 16 rows.
#pragma once

#include <cstdint>

#include "kernels/cuda/swizzle_layouts.h"

namespace quantmla::gpu {

// Within 8 rows: each row's chunks stay in the row and take its 8 positions once each, and each
// logical chunk takes the 8 positions once each over the rows (8 rows reading one chunk hit
// distinct banks).
constexpr bool swizzle_is_a_permutation() {
  for (int a = 0; a < 8; ++a) {
    bool in_row[8] = {}, over_rows[8] = {};
    for (int b = 0; b < 8; ++b) {
      const uint32_t chunk_b_of_row_a = swizzled_chunk_offset(a, b);
      const uint32_t chunk_a_of_row_b = swizzled_chunk_offset(b, a) % 128 / 16;
      if (chunk_b_of_row_a / 128 != static_cast<uint32_t>(a)) return false;
      if (in_row[chunk_b_of_row_a % 128 / 16] || over_rows[chunk_a_of_row_b]) return false;
      in_row[chunk_b_of_row_a % 128 / 16] = over_rows[chunk_a_of_row_b] = true;
    }
  }
  return true;
}
static_assert(swizzle_is_a_permutation(), "the 128-byte swizzle permutes chunks within a row");

// The kernels' tile copies: kThreads threads, thread t moving the 16-byte chunk t % 8 of rows
// t / 8 + (kThreads / 8) i of a kRows-row column block, each at its offset for its first row
// plus i (kThreads / 8) rows of 128 bytes. True when that is the swizzled place of every row it
// copies (kThreads / 8 a multiple of 8) and the passes fill the block exactly once.
template <int kThreads, int kRows>
constexpr bool copies_fill_a_block_once() {
  constexpr int kCopyRows = kThreads / 8;
  bool filled[kRows * 8] = {};
  for (int thread = 0; thread < kThreads; ++thread) {
    const int chunk = thread % 8, row = thread / 8;
    for (int i = 0; i < kRows / kCopyRows; ++i) {
      const uint32_t at = swizzled_chunk_offset(row, chunk) + i * kCopyRows * 128;
      if (at != swizzled_chunk_offset(row + kCopyRows * i, chunk) || filled[at / 16]) return false;
      filled[at / 16] = true;
    }
  }
  for (const bool f : filled) {
    if (!f) return false;
  }
  return true;
}

// Orders register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// The calling warpgroup's registers a thread raised or lowered to kRegs (a multiple of 8 in
// [24, 256]): warp-specialized roles share the register file unevenly, the launch's even share
// being what each starts with.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg's range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg's range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Keeps the compiler from moving accesses to registers an asynchronous product reads or writes
// (its accumulators, its A operand) across the wgmma_wait that ends it.
template <int kCount>
__device__ __forceinline__ void wgmma_fence_registers(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kCount>
__device__ __forceinline__ void wgmma_fence_registers(uint32_t (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// The accumulator operands of the wrappers below, in order: 8 to 128 FP32 registers as "+f"
// constraints, and their place holders %0.. in the instruction text (the operands that follow
// them are numbered from the count).
#define QUANTMLA_WGMMA_D8_AT(d, i)                                                            \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define QUANTMLA_WGMMA_D8(d) QUANTMLA_WGMMA_D8_AT(d, 0)
#define QUANTMLA_WGMMA_D16(d) QUANTMLA_WGMMA_D8_AT(d, 0), QUANTMLA_WGMMA_D8_AT(d, 8)
#define QUANTMLA_WGMMA_D32(d) \
  QUANTMLA_WGMMA_D16(d), QUANTMLA_WGMMA_D8_AT(d, 16), QUANTMLA_WGMMA_D8_AT(d, 24)
#define QUANTMLA_WGMMA_D48(d) \
  QUANTMLA_WGMMA_D32(d), QUANTMLA_WGMMA_D8_AT(d, 32), QUANTMLA_WGMMA_D8_AT(d, 40)
#define QUANTMLA_WGMMA_D64(d) \
  QUANTMLA_WGMMA_D48(d), QUANTMLA_WGMMA_D8_AT(d, 48), QUANTMLA_WGMMA_D8_AT(d, 56)
#define QUANTMLA_WGMMA_D80(d) \
  QUANTMLA_WGMMA_D64(d), QUANTMLA_WGMMA_D8_AT(d, 64), QUANTMLA_WGMMA_D8_AT(d, 72)
#define QUANTMLA_WGMMA_D96(d) \
  QUANTMLA_WGMMA_D80(d), QUANTMLA_WGMMA_D8_AT(d, 80), QUANTMLA_WGMMA_D8_AT(d, 88)
#define QUANTMLA_WGMMA_D112(d) \
  QUANTMLA_WGMMA_D96(d), QUANTMLA_WGMMA_D8_AT(d, 96), QUANTMLA_WGMMA_D8_AT(d, 104)
#define QUANTMLA_WGMMA_D128(d) \
  QUANTMLA_WGMMA_D112(d), QUANTMLA_WGMMA_D8_AT(d, 112), QUANTMLA_WGMMA_D8_AT(d, 120)
#define QUANTMLA_WGMMA_REGS8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define QUANTMLA_WGMMA_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QUANTMLA_WGMMA_REGS32 \
  QUANTMLA_WGMMA_REGS16       \
  ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QUANTMLA_WGMMA_REGS48 \
  QUANTMLA_WGMMA_REGS32       \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define QUANTMLA_WGMMA_REGS64 \
  QUANTMLA_WGMMA_REGS48       \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QUANTMLA_WGMMA_REGS80 \
  QUANTMLA_WGMMA_REGS64       \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define QUANTMLA_WGMMA_REGS96 \
  QUANTMLA_WGMMA_REGS80       \
  ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define QUANTMLA_WGMMA_REGS112                                                               \
  QUANTMLA_WGMMA_REGS96                                                                      \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, " \
  "%111"
#define QUANTMLA_WGMMA_REGS128                                                             \
  QUANTMLA_WGMMA_REGS112                                                                   \
  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, " \
  "%126, %127"

// d (+)= A B^T over 64 x N x 16 (N a multiple of 32 up to 256), A and B from shared memory
// (descriptors; A K-major, B K-major or, with kTransposeB, MN-major: wgmma_descriptor_mn);
// accumulate into d when accumulate != 0, overwrite it otherwise. The product uses the first
// N / 2 accumulators of d (the rest are left alone).
template <int kN, bool kTransposeB = false, int kCount>
__device__ __forceinline__ void wgmma_m64nk16_ss(float (&d)[kCount], uint64_t a, uint64_t b,
                                                 int accumulate) {
  static_assert(kN % 32 == 0 && kN >= 32 && kN <= 256 && kCount >= kN / 2, "an m64nNk16 shape");
  constexpr int kTransposeBit = kTransposeB ? 1 : 0;
// One shape: N, its accumulators' count (N / 2) as text, and the place holders of a, b,
// accumulate and the transpose bit (numbered after the accumulators).
#define QUANTMLA_WGMMA_SS(kShape, kRegs, kA, kB, kAccumulate, kTranspose)  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #kAccumulate           \
               ", 0;\n"                                                    \
               "wgmma.mma_async.sync.aligned.m64n" #kShape                 \
               "k16.f32.bf16.bf16 {" QUANTMLA_WGMMA_REGS##kRegs            \
               "}, %" #kA ", %" #kB ", p, 1, 1, 0, %" #kTranspose ";\n}\n" \
               : QUANTMLA_WGMMA_D##kRegs(d)                                \
               : "l"(a), "l"(b), "r"(accumulate), "n"(kTransposeBit))
  if constexpr (kN == 32) {
    QUANTMLA_WGMMA_SS(32, 16, 16, 17, 18, 19);
  } else if constexpr (kN == 64) {
    QUANTMLA_WGMMA_SS(64, 32, 32, 33, 34, 35);
  } else if constexpr (kN == 96) {
    QUANTMLA_WGMMA_SS(96, 48, 48, 49, 50, 51);
  } else if constexpr (kN == 128) {
    QUANTMLA_WGMMA_SS(128, 64, 64, 65, 66, 67);
  } else if constexpr (kN == 160) {
    QUANTMLA_WGMMA_SS(160, 80, 80, 81, 82, 83);
  } else if constexpr (kN == 192) {
    QUANTMLA_WGMMA_SS(192, 96, 96, 97, 98, 99);
  } else if constexpr (kN == 224) {
    QUANTMLA_WGMMA_SS(224, 112, 112, 113, 114, 115);
  } else if constexpr (kN == 256) {
    QUANTMLA_WGMMA_SS(256, 128, 128, 129, 130, 131);
  }
#undef QUANTMLA_WGMMA_SS
}

// The product kWgmma(scale-d, imm-trans-a) with both written into the instruction's text: one of
// four, by kTransposeA and `accumulate` (wgmma_m64n16k16_ss and wgmma_m64n32k16_ss).
#define QUANTMLA_WGMMA_SCALE_AND_TRANSPOSE(kWgmma) \
  if constexpr (kTransposeA) {                     \
    if (accumulate) {                              \
      kWgmma(1, 1);                                \
    } else {                                       \
      kWgmma(0, 1);                                \
    }                                              \
  } else {                                         \
    if (accumulate) {                              \
      kWgmma(1, 0);                                \
    } else {                                       \
      kWgmma(0, 0);                                \
    }                                              \
  }

// d (+)= A B^T over 64 x 16 x 16, both operands BF16 from shared memory (descriptors): A K-major
// or, with kTransposeA, MN-major (wgmma_descriptor_mn: 64 consecutive M of one k in each 128-byte
// row); B K-major. d holds the accumulators as mma.m16n8's two n-tiles (d[n][i]: columns
// 8 n + 2 (t % 4) + i % 2 of row 16 (t / 32) + (t % 32) / 4, + 8 for i >= 2), an m64n16 product's
// 8 registers. Accumulates into d when `accumulate`, overwrites it otherwise (written into the
// instruction's text: a constant once the caller's loops are unrolled).
template <bool kTransposeA>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float (&d)[2][4], uint64_t a, uint64_t b,
                                                   bool accumulate) {
#define QUANTMLA_WGMMA_N16_SS(kScaleD, kTranspose)                                            \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " #kScaleD                                   \
               ", 0;\n"                                                                       \
               "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"                         \
               " {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, " #kTranspose ", 0;\n}\n" \
               : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),   \
                 "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])                                  \
               : "l"(a), "l"(b))
  QUANTMLA_WGMMA_SCALE_AND_TRANSPOSE(QUANTMLA_WGMMA_N16_SS);
#undef QUANTMLA_WGMMA_N16_SS
}

// wgmma_m64n16k16_ss's twin for 32 columns: d[n][i] as there, four n-tiles, an m64n32 product's
// 16 registers.
template <bool kTransposeA>
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[4][4], uint64_t a, uint64_t b,
                                                   bool accumulate) {
#define QUANTMLA_WGMMA_N32_SS(kScaleD, kTranspose)                                                \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, " #kScaleD                                                \
      ", 0;\n"                                                                                    \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"                                      \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17,"        \
      " p, 1, 1, " #kTranspose ", 0;\n}\n"                                                        \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])                                \
      : "l"(a), "l"(b))
  QUANTMLA_WGMMA_SCALE_AND_TRANSPOSE(QUANTMLA_WGMMA_N32_SS);
#undef QUANTMLA_WGMMA_N32_SS
}
#undef QUANTMLA_WGMMA_SCALE_AND_TRANSPOSE

// One of the two above by the n-tiles of d (2: 16 columns, 4: 32).
template <bool kTransposeA, int kNTiles>
__device__ __forceinline__ void wgmma_m64k16_ss_tiles(float (&d)[kNTiles][4], uint64_t a,
                                                      uint64_t b, bool accumulate) {
  static_assert(kNTiles == 2 || kNTiles == 4, "m64n16 or m64n32");
  if constexpr (kNTiles == 2) {
    wgmma_m64n16k16_ss<kTransposeA>(d, a, b, accumulate);
  } else {
    wgmma_m64n32k16_ss<kTransposeA>(d, a, b, accumulate);
  }
}

// d (+)= A B^T over 64 x N x 16 (N 16, or a multiple of 32 up to 256), A from registers
// (mma.m16n8k16's A fragments of the warp's 16 rows), B from shared memory (descriptor; K-major
// or, with kTransposeB, MN-major). Accumulates as wgmma_m64nk16_ss.
template <int kN, bool kTransposeB = false, int kCount>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[kCount], const uint32_t (&a)[4],
                                                uint64_t b, int accumulate) {
  static_assert((kN == 16 || (kN % 32 == 0 && kN >= 32 && kN <= 256)) && kCount >= kN / 2,
                "an m64nNk16 shape");
  constexpr int kTransposeBit = kTransposeB ? 1 : 0;
// One shape: N, its accumulators' count as text, and the place holders of A's four registers, b,
// accumulate and the transpose bit (numbered after the accumulators).
#define QUANTMLA_WGMMA_RS(kShape, kRegs, kA0, kA1, kA2, kA3, kB, kAccumulate, kTranspose)          \
  asm volatile(                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" #kAccumulate                                            \
      ", 0;\n"                                                                                     \
      "wgmma.mma_async.sync.aligned.m64n" #kShape "k16.f32.bf16.bf16 {" QUANTMLA_WGMMA_REGS##kRegs \
      "}, {%" #kA0 ", %" #kA1 ", %" #kA2 ", %" #kA3 "}, %" #kB ", p, 1, 1, %" #kTranspose ";\n}\n" \
      : QUANTMLA_WGMMA_D##kRegs(d)                                                                 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransposeBit))
  if constexpr (kN == 16) {
    QUANTMLA_WGMMA_RS(16, 8, 8, 9, 10, 11, 12, 13, 14);
  } else if constexpr (kN == 32) {
    QUANTMLA_WGMMA_RS(32, 16, 16, 17, 18, 19, 20, 21, 22);
  } else if constexpr (kN == 64) {
    QUANTMLA_WGMMA_RS(64, 32, 32, 33, 34, 35, 36, 37, 38);
  } else if constexpr (kN == 128) {
    QUANTMLA_WGMMA_RS(128, 64, 64, 65, 66, 67, 68, 69, 70);
  } else if constexpr (kN == 256) {
    QUANTMLA_WGMMA_RS(256, 128, 128, 129, 130, 131, 132, 133, 134);
  } else {
    static_assert(kN == 16 || kN == 32 || kN == 64 || kN == 128 || kN == 256,
                  "instantiated shapes");
  }
#undef QUANTMLA_WGMMA_RS
}

// wgmma_m64k16_rs by the n-tiles of d (2: 16 columns, 4: 32), laid out as wgmma_m64n16k16_ss's:
// d[n][i] is register 4 n + i of the product.
template <int kNTiles>
__device__ __forceinline__ void wgmma_m64k16_rs_tiles(float (&d)[kNTiles][4],
                                                      const uint32_t (&a)[4], uint64_t b,
                                                      bool accumulate) {
  static_assert(kNTiles == 2 || kNTiles == 4, "m64n16 or m64n32");
  wgmma_m64k16_rs<8 * kNTiles>(reinterpret_cast<float(&)[4 * kNTiles]>(d), a, b, accumulate);
}

#undef QUANTMLA_WGMMA_REGS128
#undef QUANTMLA_WGMMA_REGS112
#undef QUANTMLA_WGMMA_REGS96
#undef QUANTMLA_WGMMA_REGS80
#undef QUANTMLA_WGMMA_REGS64
#undef QUANTMLA_WGMMA_REGS48
#undef QUANTMLA_WGMMA_REGS32
#undef QUANTMLA_WGMMA_REGS16
#undef QUANTMLA_WGMMA_REGS8
#undef QUANTMLA_WGMMA_D128
#undef QUANTMLA_WGMMA_D112
#undef QUANTMLA_WGMMA_D96
#undef QUANTMLA_WGMMA_D80
#undef QUANTMLA_WGMMA_D64
#undef QUANTMLA_WGMMA_D48
#undef QUANTMLA_WGMMA_D32
#undef QUANTMLA_WGMMA_D16
#undef QUANTMLA_WGMMA_D8
#undef QUANTMLA_WGMMA_D8_AT

}  // namespace quantmla::gpu
