// The fragment-dequantizing decode kernel (decode_fragments.cuh) for content int4 g64, both RoPE
// formats.
#include <cuda_runtime.h>

#include "kernels/cuda/decode_fragments.cuh"
#include "kernels/cuda/dispatch.cuh"
#include "kernels/cuda/launch.cuh"

namespace quantmla::gpu {

template <class Rope>
void launch_decode_fragments(const DecodeKernelParams& params, int blocks, cudaStream_t stream) {
  using Layout = FragmentLayout<Rope>;
  launch_large_shared<mla_decode_fragments_kernel<Rope>>(blocks, Layout::kThreads,
                                                         Layout::kSharedBytes, stream, params);
}

template void launch_decode_fragments<RopeBf16>(const DecodeKernelParams&, int, cudaStream_t);
template void launch_decode_fragments<RopeInt4>(const DecodeKernelParams&, int, cudaStream_t);

}  // namespace quantmla::gpu
