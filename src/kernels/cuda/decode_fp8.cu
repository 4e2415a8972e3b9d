// Decode kernels for content fp8 (both RoPE formats).
#include "kernels/cuda/decode_launch.cuh"

namespace quantmla::gpu {
using InstantiatedContent = ContentFp8;
}  // namespace quantmla::gpu
QUANTMLA_INSTANTIATE_DECODE(InstantiatedContent)
