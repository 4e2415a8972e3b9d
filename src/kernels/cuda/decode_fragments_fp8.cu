// The fragment decode kernel (decode_fragments.cuh) for content fp8, both RoPE formats.
#include <cuda_runtime.h>

#include "kernels/cuda/decode_fragments.cuh"
#include "kernels/cuda/dispatch.cuh"

namespace quantmla::gpu {

template void launch_decode_fragments<ContentFp8, RopeBf16>(const DecodeKernelParams&, int, bool,
                                                            cudaStream_t);
template void launch_decode_fragments<ContentFp8, RopeInt4>(const DecodeKernelParams&, int, bool,
                                                            cudaStream_t);

}  // namespace quantmla::gpu
