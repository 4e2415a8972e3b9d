// What GemmRunner's tuning asks of a cuBLASLt algorithm (gemm.h, tune_min_rows), for the code
// that looks at the candidates itself (bench_prefill_gemms). Kept out of gemm.h so that its
// users need no cuBLASLt header.
#pragma once

#include <cublasLt.h>

namespace quantmla::gpu {

// Whether the algorithm sums each output's k products in one pass (no split-K, no stream-K
// reduction): every such algorithm adds in the same order, so the choice among them does not
// change the result's bits. False also when cuBLASLt cannot say.
bool sums_in_one_pass(const cublasLtMatmulAlgo_t& algo);

}  // namespace quantmla::gpu
