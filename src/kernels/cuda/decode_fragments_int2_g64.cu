// The fragment decode kernel (decode_fragments.cuh) for content int2 g64, both RoPE
// formats.
#include <cuda_runtime.h>

#include "kernels/cuda/decode_fragments.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace quantmla::gpu {

template void launch_decode_fragments<ContentInt<2, 64>, RopeBf16>(const DecodeKernelParams&, int,
                                                                   bool, cudaStream_t);
template void launch_decode_fragments<ContentInt<2, 64>, RopeInt4>(const DecodeKernelParams&, int,
                                                                   bool, cudaStream_t);

}  // namespace quantmla::gpu
