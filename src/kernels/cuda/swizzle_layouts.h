// Byte offsets of the 128-byte-swizzled shared-memory layouts that the tensor-map copies write and
// the warpgroup MMAs (wgmma.cuh) read, and the MMAs' descriptors of them, shared by the kernels and
// their host test (tests/gpu/test_host_layouts.cpp).
#pragma once

#include <cstdint>

#include "kernels/cuda/host_device.h"

namespace quantmla::gpu {

// Byte offset of the 16-byte chunk `chunk` (0-7) of row `row` in a 128-byte-swizzled column block.
QUANTMLA_HOST_DEVICE constexpr uint32_t swizzled_chunk_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row % 8)) * 16));
}

// Byte offset, from a 1024-byte-aligned base, where an MN-major (N contiguous) 128-byte-swizzled
// B operand described by wgmma_descriptor_mn(base, n_block_bytes) has element (k, n) of 16-bit
// values: the PTX ISA's canonical layout ((8 chunks, N / 64 blocks), (8 rows, K / 8 groups)) with
// strides ((16 bytes, n_block_bytes), (128 bytes, 1024 bytes)), then the swizzle, which moves a
// row's 16-byte chunk c to c ^ (row % 8) (row = offset / 128 from the aligned base).
QUANTMLA_HOST_DEVICE constexpr uint32_t mn_major_offset(int k, int n, uint32_t n_block_bytes) {
  const uint32_t linear = static_cast<uint32_t>((n % 64) / 8 * 16 + (n % 8) * 2) +
                          static_cast<uint32_t>(n / 64) * n_block_bytes +
                          static_cast<uint32_t>(k % 8) * 128 + static_cast<uint32_t>(k / 8) * 1024;
  return linear ^ (((linear >> 7) & 7u) << 4);
}

// Where a tensor-map copy with the 128-byte swizzle puts element (row, column) of a box of 64
// 16-bit columns (1024-byte-aligned destination): row r at 128 r, its chunk c at c ^ (r % 8).
QUANTMLA_HOST_DEVICE constexpr uint32_t tma_box_offset(int row, int column) {
  return swizzled_chunk_offset(row, column / 8) + static_cast<uint32_t>(column % 8) * 2;
}

// Descriptor of a K-major, 128-byte-swizzled operand starting at shared `address`: the stride
// between 8-row groups is 1024 bytes; the leading offset is unused by this layout (set to 1, as
// the PTX ISA's canonical layouts have it).
QUANTMLA_HOST_DEVICE constexpr uint64_t wgmma_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// Descriptor of an MN-major, 128-byte-swizzled B operand (imm-trans-b 1) at shared `address`
// (mn_major_offset): 64 consecutive N of one k in each 128-byte row, the next 8 k 1024 bytes on
// (the stride offset), the next 64 N `n_block_bytes` on (the leading offset). A page of keys
// copied as column blocks of 64 channels reads as its values this way, untransposed.
QUANTMLA_HOST_DEVICE constexpr uint64_t wgmma_descriptor_mn(uint32_t address,
                                                            uint32_t n_block_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(n_block_bytes >> 4) << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) past the one `descriptor` describes:
// only its start address field (bits 0-13, address / 16) changes, and a shared-memory address
// stays below 2^18, so a 32-bit add of the low word cannot carry out of it (test_host_layouts
// checks every address and offset). One uniform-datapath instruction where a descriptor made anew
// from an address takes about five: a k-loop of products should make its operands' descriptors
// once and step them with this.
QUANTMLA_HOST_DEVICE constexpr uint64_t descriptor_at(uint64_t descriptor, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

}  // namespace quantmla::gpu
