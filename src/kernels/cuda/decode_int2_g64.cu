// Decode kernels for content int2 g64 (both RoPE formats).
#include "kernels/cuda/decode_launch.cuh"

namespace quantmla::gpu {
using InstantiatedContent = ContentInt<2, 64>;
}  // namespace quantmla::gpu
QUANTMLA_INSTANTIATE_DECODE(InstantiatedContent)
