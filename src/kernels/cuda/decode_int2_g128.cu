// Decode kernels for content int2 g128 (both RoPE formats).
#include "kernels/cuda/decode_launch.cuh"

namespace quantmla::gpu {
using InstantiatedContent = ContentInt<2, 128>;
}  // namespace quantmla::gpu
QUANTMLA_INSTANTIATE_DECODE(InstantiatedContent)
