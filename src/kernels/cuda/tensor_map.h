// Tensor maps for the tensor-memory-accelerator copies (TMA, sm_90) of BF16 operands: a tiled map
// with the 128-byte swizzle that wgmma.cuh's shared-memory descriptors read (each box row 64 BF16
// = 128 bytes), encoded through the driver's cuTensorMapEncodeTiled, found at run time through
// the runtime (no link to libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace quantmla::gpu {

// A rank-`rank` (2 or 3) BF16 tensor at `base`: dims[0] the contiguous extent (elements),
// strides[i] the elements from one index of dimension i + 1 to the next, box[i] the extent of one
// copy (box[0] = 64: one swizzled column block). Reads outside the tensor are zero-filled.
// Throws InvalidArgument for a shape the hardware refuses (with the values), CudaError when the
// driver has no cuTensorMapEncodeTiled.
CUtensorMap bf16_tensor_map(const void* base, int rank, const int64_t* dims, const int64_t* strides,
                            const int* box);

}  // namespace quantmla::gpu
