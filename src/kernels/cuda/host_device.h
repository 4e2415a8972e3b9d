// QUANTMLA_HOST_DEVICE: __host__ __device__ under nvcc, nothing for the host compiler, so that
// index maps shared by a kernel and its host test compile in both.
#pragma once

#if defined(__CUDACC__)
#define QUANTMLA_HOST_DEVICE __host__ __device__
#else
#define QUANTMLA_HOST_DEVICE
#endif
