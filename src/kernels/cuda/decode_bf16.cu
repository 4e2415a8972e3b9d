// Decode kernels for content bf16 (both RoPE formats).
#include "kernels/cuda/decode_launch.cuh"

namespace quantmla::gpu {
using InstantiatedContent = ContentBf16;
}  // namespace quantmla::gpu
QUANTMLA_INSTANTIATE_DECODE(InstantiatedContent)
