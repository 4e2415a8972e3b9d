# Sourced by the scripts that compile kernels outside CMake and claim the library's machine code
# (census-fragments.sh, same-machine-code.sh): nvcc and the flags of a Release build of
# src/kernels/cuda (CMakeLists.txt's QUANTMLA_CUDA_FLAGS and CMAKE_CUDA_STANDARD, the kernel
# library's -lineinfo, Release's -O3 -DNDEBUG). Change them together with those.
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
library_nvcc_flags=(-O3 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
  -lineinfo -std=c++20)
