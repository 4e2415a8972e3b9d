// Every CUDA runtime call goes through QUANTMLA_CUDA_CHECK, every cuBLAS / cuBLASLt call through
// QUANTMLA_CUBLAS_CHECK: a failure throws CudaError naming the call, the file and line, and the
// library's own status name and message.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <string>

#include "quantmla/error.h"

namespace quantmla::gpu {

inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) {
    throw CudaError(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                    cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
  }
}

// cuBLASLt returns the same cublasStatus_t as cuBLAS, so one check serves both.
inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                    cublasGetStatusName(status) + ": " + cublasGetStatusString(status));
  }
}

}  // namespace quantmla::gpu

#define QUANTMLA_CUDA_CHECK(call) ::quantmla::gpu::cuda_check((call), #call, __FILE__, __LINE__)
// After a kernel launch: the launch's own error (bad configuration, too much shared memory).
#define QUANTMLA_CUDA_CHECK_LAUNCH() QUANTMLA_CUDA_CHECK(cudaGetLastError())
#define QUANTMLA_CUBLAS_CHECK(call) ::quantmla::gpu::cublas_check((call), #call, __FILE__, __LINE__)
