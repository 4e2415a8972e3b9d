#include "kernels/cuda/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cuda_check.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    QUANTMLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                         cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || function == nullptr) {
      throw CudaError("cuTensorMapEncodeTiled: not found in the CUDA driver (query result " +
                      std::to_string(static_cast<int>(found)) + ")");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

std::string describe(int rank, const int64_t* dims, const int64_t* strides, const int* box) {
  std::string s = "dims";
  for (int i = 0; i < rank; ++i) s += " " + std::to_string(dims[i]);
  s += ", strides";
  for (int i = 0; i + 1 < rank; ++i) s += " " + std::to_string(strides[i]);
  s += ", box";
  for (int i = 0; i < rank; ++i) s += " " + std::to_string(box[i]);
  return s;
}

}  // namespace

CUtensorMap bf16_tensor_map(const void* base, int rank, const int64_t* dims, const int64_t* strides,
                            const int* box) {
  if (rank < 2 || rank > 3 || box[0] != 64 || reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    throw InvalidArgument("bf16_tensor_map: rank " + std::to_string(rank) +
                          " (2 or 3), box[0] 64, base 16-byte aligned; got " +
                          describe(rank, dims, strides, box));
  }
  cuuint64_t global_dims[3] = {}, global_strides[2] = {};
  cuuint32_t box_dims[3] = {}, element_strides[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 1 || box[i] < 1 || box[i] > 256) {
      throw InvalidArgument("bf16_tensor_map: " + describe(rank, dims, strides, box));
    }
    global_dims[i] = static_cast<cuuint64_t>(dims[i]);
    box_dims[i] = static_cast<cuuint32_t>(box[i]);
  }
  for (int i = 0; i + 1 < rank; ++i) {
    if (strides[i] % 8 != 0) {  // 16 bytes
      throw InvalidArgument("bf16_tensor_map: strides must be multiples of 8 elements, " +
                            describe(rank, dims, strides, box));
    }
    global_strides[i] = static_cast<cuuint64_t>(strides[i]) * 2;
  }
  CUtensorMap map{};
  const CUresult result =
      encode_function()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank),
                        const_cast<void*>(base), global_dims, global_strides, box_dims,
                        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw InvalidArgument("cuTensorMapEncodeTiled failed (CUresult " +
                          std::to_string(static_cast<int>(result)) + ") for " +
                          describe(rank, dims, strides, box));
  }
  return map;
}

}  // namespace quantmla::gpu
