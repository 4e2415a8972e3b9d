// The cache write and the queries' RoPE in one launch (decode steps, where each launch costs
// microseconds in the chain of a step): mla_write (quantmla/gpu_mla.h) and rope_queries
// (model_ops.h) over the same tokens, each block doing one or the other, with their arithmetic
// and outputs bit for bit.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/model_ops.h"
#include "quantmla/cache_format.h"
#include "quantmla/gpu_mla.h"

namespace quantmla::gpu {

// Throws as mla_write and rope_queries, and InvalidArgument when their token counts differ.
void write_cache_and_queries(const CacheFormat& format, const MlaWriteParams& params,
                             const RopeQueriesParams& queries, cudaStream_t stream);

}  // namespace quantmla::gpu
