// Kernel launches of the model runner's kernels, optionally as programmatic dependent launches
// (Hopper): such a kernel may be scheduled while the previous kernel on its stream drains, and
// waits in wait_for_previous_kernel() (the first statement of every kernel launched here) until
// that kernel has finished and its writes are visible, so only the launch latency and the block
// scheduling overlap, never the data. Off unless set_programmatic_launch(true).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"

namespace quantmla::gpu {

// griddepcontrol (PTX 7.8, sm_90): a no-op for a kernel launched without the attribute.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // This kernel's own dependents may be scheduled once all its blocks got here.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  if (programmatic_launch()) {
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  QUANTMLA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// A launch of a kernel with more than 48 KB of dynamic shared memory, which must be asked for per
// kernel (for the process's first launch of it: one static per kernel, shared_bytes then fixed).
template <auto kKernel, class... Args>
void launch_large_shared(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                         Args&&... args) {
  static const bool attribute_set = [&] {
    QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared_bytes)));
    return true;
  }();
  (void)attribute_set;
  launch_kernel(kKernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
  QUANTMLA_CUDA_CHECK_LAUNCH();
}

// Makes sure `blocks_per_sm` blocks of a large-shared-memory kernel can be resident on one SM at
// once, as a decode plan that splits the work for that many assumes: the shared memory
// attribute set, then the carveout raised to the most shared memory if the driver's default
// leaves fewer; throws CudaError with the figures if even that does not fit them. Once per kernel
// (the result is cached by the caller's static).
template <auto kKernel>
bool require_resident_blocks(int threads, size_t shared_bytes, int blocks_per_sm,
                             const char* name) {
  QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared_bytes)));
  int resident = 0;
  QUANTMLA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kKernel, threads, shared_bytes));
  if (resident < blocks_per_sm) {
    QUANTMLA_CUDA_CHECK(cudaFuncSetAttribute(
        kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    QUANTMLA_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kKernel, threads, shared_bytes));
  }
  if (resident < blocks_per_sm) {
    throw CudaError(std::string(name) + ": " + std::to_string(blocks_per_sm) + " blocks of " +
                    std::to_string(threads) + " threads and " + std::to_string(shared_bytes) +
                    " bytes of shared memory were planned on each SM, but only " +
                    std::to_string(resident) + " fit on this device");
  }
  return true;
}

}  // namespace quantmla::gpu
