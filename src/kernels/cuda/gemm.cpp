// GemmRunner: row-major BF16 products on cuBLASLt with a plan cache, cuBLAS as the fallback.
//
// cuBLAS is column-major. A row-major [r, c] matrix with row stride ld is the column-major [c, r]
// matrix with the same ld, so the row-major product y[m, n] = x[m, k] op(W) is the column-major
// y^T[n, m] = op(W)^T x^T, computed as C = op(A) op(B) with
//   B = x^T: column-major [k, m], ld = ldx, no transpose;
//   A = W:   op kT (row-major W[n, k], y = x W^T): column-major [k, n], transposed -> [n, k];
//            op kN (row-major W[k, n], y = x W):   column-major [n, k], not transposed;
//   C = y^T: column-major [n, m], ld = ldy.
// linear() is op kT with batch 1 ("TN" in cuBLAS terms, the layout its kernels prefer).
#include "kernels/cuda/gemm.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm_algorithm.h"
#include "quantmla/error.h"

namespace quantmla::gpu {
namespace {

// The heuristic's default assumption is 256-byte aligned buffers; a pointer into the middle of a
// row (q_pe at column 128 of a head) or an odd stride is less aligned, and an algorithm chosen for
// 256 would read misaligned vectors. So each matrix's real alignment is part of the key.
constexpr uint32_t kMaxAlignment = 256;

// Plans beyond this are dropped all at once (MoE experts see many distinct row counts); a dropped
// plan costs one heuristic query when its shape comes back.
constexpr size_t kMaxCachedPlans = 4096;

uint32_t alignment_of(const void* ptr, int64_t ld, bool uses_ld, int64_t stride, bool uses_stride,
                      size_t element_bytes) {
  uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | kMaxAlignment;
  if (uses_ld) bits |= static_cast<uint64_t>(ld) * element_bytes;
  if (uses_stride) bits |= static_cast<uint64_t>(stride) * element_bytes;
  return static_cast<uint32_t>(bits & (~bits + 1));  // lowest set bit
}

std::string str(int64_t v) { return std::to_string(v); }

struct PlanKey {
  int64_t batch, m, n, k, ldx, ldw, ldy, stride_x, stride_w, stride_y;
  int op_w, out_dtype;
  uint32_t align_x, align_w, align_y;
  bool tune_by_batch_rows;
  auto operator<=>(const PlanKey&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // W
  cublasLtMatrixLayout_t b = nullptr;  // x
  cublasLtMatrixLayout_t c = nullptr;  // y (C and D)
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;  // false: cuBLASLt offered nothing for this shape; cuBLAS runs it
  // The heuristic's candidates that keep the k sum in one pass (the first is algo), until tuned.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  bool tuned = false;

  void destroy() {
    // Destructor path: statuses are ignored, nothing useful can be done with them.
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    *this = Plan{};
  }
};

struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~EventPair() {
    if (stop != nullptr) cudaEventDestroy(stop);
    if (start != nullptr) cudaEventDestroy(start);
  }
};

cudaDataType_t cuda_type(DType dtype) { return dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

void make_layout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int64_t rows, int64_t cols,
                 int64_t ld, int64_t batch, int64_t stride) {
  QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(layout, type, static_cast<uint64_t>(rows),
                                                   static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    QUANTMLA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
}

}  // namespace

struct GemmRunner::State {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool owns_workspace = false;
  int64_t tune_min_rows = 0;
  bool batch_invariant = false;
  size_t tuned = 0;
  EventPair events;
  std::map<PlanKey, Plan> plans;
  // The algorithm that timing chose for each shape with m rounded up to a power of two: a later
  // plan in the same bucket takes it (where cuBLASLt accepts it for that m) instead of timing
  // again, so that a server whose steps keep bringing new row counts tunes each shape a few times
  // only. Kept when the plan cache is cleared.
  std::map<PlanKey, cublasLtMatmulAlgo_t> tuned_by_bucket;
  // batch_invariant: the one algorithm of each shape (m 0 in the key), for every m.
  std::map<PlanKey, cublasLtMatmulAlgo_t> pinned;

  ~State() {
    for (auto& [key, plan] : plans) plan.destroy();
    if (blas != nullptr) cublasDestroy(blas);
    if (lt != nullptr) cublasLtDestroy(lt);
    if (owns_workspace) cudaFree(workspace);
  }

  Plan& plan_for(const PlanKey& key) {
    const auto found = plans.find(key);
    if (found != plans.end()) return found->second;
    if (plans.size() >= kMaxCachedPlans) {
      for (auto& [old_key, plan] : plans) plan.destroy();
      plans.clear();
    }
    Plan plan;
    try {
      build(key, plan);
    } catch (...) {
      plan.destroy();
      throw;
    }
    return plans.emplace(key, plan).first->second;
  }

  void build(const PlanKey& key, Plan& plan) {
    const bool transpose_w = key.op_w == static_cast<int>(GemmOp::kT);
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = CUBLAS_OP_N;
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                         &op_a, sizeof(op_a)));
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                         &op_b, sizeof(op_b)));
    make_layout(&plan.a, CUDA_R_16BF, transpose_w ? key.k : key.n, transpose_w ? key.n : key.k,
                key.ldw, key.batch, key.stride_w);
    make_layout(&plan.b, CUDA_R_16BF, key.k, key.m, key.ldx, key.batch, key.stride_x);
    make_layout(&plan.c, cuda_type(static_cast<DType>(key.out_dtype)), key.n, key.m, key.ldy,
                key.batch, key.stride_y);

    if (batch_invariant) {
      plan.algo = pinned_algo(key, plan);
      plan.has_algo = true;
      plan.tuned = true;
      return;
    }
    const int64_t rows = key.tune_by_batch_rows ? key.m * key.batch : key.m;
    const bool tunes = tune_min_rows > 0 && rows >= tune_min_rows;
    cublasLtMatmulHeuristicResult_t results[GemmRunner::kTuneCandidates]{};
    const int returned = heuristic(key, plan.desc, plan.a, plan.b, plan.c,
                                   tunes ? GemmRunner::kTuneCandidates : 1, results);
    // None (odd alignments): cuBLAS takes the shape.
    plan.has_algo = returned > 0;
    if (plan.has_algo) plan.algo = results[0].algo;
    // The first choice is kept as it is; the others only where they sum alike.
    const bool first_single = plan.has_algo && sums_in_one_pass(results[0].algo);
    for (int i = 0; first_single && i < returned; ++i) {
      if (i == 0 || sums_in_one_pass(results[i].algo)) plan.candidates.push_back(results[i].algo);
    }
    plan.tuned = plan.candidates.size() < 2;
  }

  // cuBLASLt's first `count` algorithms for key's alignments and this workspace, into results;
  // returns how many (0 where none fits).
  int heuristic(const PlanKey& key, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, int count,
                cublasLtMatmulHeuristicResult_t* results) {
    cublasLtMatmulPreference_t preference = nullptr;
    QUANTMLA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    int returned = 0;
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    const auto set = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value));
      }
    };
    const uint64_t max_workspace = workspace_bytes;
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_w);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_x);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_y);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_y);
    if (status == CUBLAS_STATUS_SUCCESS) {
      // NOT_SUPPORTED here means no algorithm fits.
      const cublasStatus_t found = cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, preference,
                                                                  count, results, &returned);
      if (found != CUBLAS_STATUS_SUCCESS) returned = 0;
    }
    cublasLtMatmulPreferenceDestroy(preference);
    QUANTMLA_CUBLAS_CHECK(status);
    return returned;
  }

  // The batch-invariant algorithm of key's shape (every m): cuBLASLt's first for
  // kInvariantReferenceRows rows that sums in one pass, chosen once; checked against plan's m.
  cublasLtMatmulAlgo_t pinned_algo(const PlanKey& key, const Plan& plan) {
    PlanKey shape = key;
    shape.m = 0;
    const auto describe = [&] {
      return "batch " + str(key.batch) + ", n " + str(key.n) + ", k " + str(key.k) + ", ldx " +
             str(key.ldx) + ", ldw " + str(key.ldw) + ", ldy " + str(key.ldy) + ", alignments " +
             str(key.align_x) + "/" + str(key.align_w) + "/" + str(key.align_y);
    };
    auto found = pinned.find(shape);
    if (found == pinned.end()) {
      constexpr int64_t kRows = GemmRunner::kInvariantReferenceRows;
      Plan reference;  // its b and c layouts at the reference rows (destroyed on every path)
      cublasLtMatmulHeuristicResult_t results[GemmRunner::kTuneCandidates]{};
      int returned = 0;
      try {
        make_layout(&reference.b, CUDA_R_16BF, key.k, kRows, key.ldx, key.batch, key.stride_x);
        make_layout(&reference.c, cuda_type(static_cast<DType>(key.out_dtype)), key.n, kRows,
                    key.ldy, key.batch, key.stride_y);
        returned = heuristic(key, plan.desc, plan.a, reference.b, reference.c,
                             GemmRunner::kTuneCandidates, results);
      } catch (...) {
        reference.destroy();
        throw;
      }
      reference.destroy();
      const auto one_pass = std::find_if(results, results + returned,
                                         [](const auto& r) { return sums_in_one_pass(r.algo); });
      if (one_pass == results + returned) {
        throw InvalidArgument(
            "GemmRunner (batch-invariant): no cuBLASLt algorithm sums in one "
            "pass for " +
            describe());
      }
      found = pinned.emplace(shape, one_pass->algo).first;
    }
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(lt, plan.desc, plan.a, plan.b, plan.c, plan.c, &found->second,
                                &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes) {
      throw InvalidArgument("GemmRunner (batch-invariant): the algorithm of " + describe() +
                            " does not run m " + str(key.m));
    }
    return found->second;
  }

  void run(const BatchedGemmParams& p, const char* who, cudaStream_t stream) {
    const std::string name = std::string("GemmRunner::") + who;
    if (p.out_dtype != DType::kF32 && p.out_dtype != DType::kBF16) {
      throw InvalidArgument(name + ": out_dtype must be F32 or BF16, got " +
                            std::string(dtype_name(p.out_dtype)));
    }
    // Measured on the H200: cuBLASLt's algorithm for a BF16 y with beta = 1 (m 7, n 2048, k 1536)
    // missed the once-rounded sum by 1.4 BF16 ulps. Nothing here needs it (residual adds go into
    // the FP32 stream), so it is refused rather than left approximate.
    if (p.out_dtype == DType::kBF16 && p.beta != 0.0f) {
      throw InvalidArgument(name + ": a BF16 output takes beta 0 only, got beta " +
                            std::to_string(p.beta));
    }
    if (p.batch < 1 || p.m < 0 || p.n < 0 || p.k < 1) {
      throw ShapeError(name + ": batch " + str(p.batch) + ", m " + str(p.m) + ", n " + str(p.n) +
                       ", k " + str(p.k) + " (need batch >= 1, m, n >= 0, k >= 1)");
    }
    if (p.m == 0 || p.n == 0) return;
    const bool transpose_w = p.op_w == GemmOp::kT;
    const int64_t w_cols = transpose_w ? p.k : p.n;  // row-major W is [n, k] or [k, n]
    if (p.ldx < p.k || p.ldw < w_cols || p.ldy < p.n) {
      throw ShapeError(name + ": row strides ldx " + str(p.ldx) + ", ldw " + str(p.ldw) + ", ldy " +
                       str(p.ldy) + " too small for m " + str(p.m) + ", n " + str(p.n) + ", k " +
                       str(p.k) + " (need ldx >= k, ldw >= " + (transpose_w ? "k" : "n") +
                       ", ldy >= n)");
    }
    if (p.stride_x < 0 || p.stride_w < 0 || p.stride_y < 0) {
      throw ShapeError(name + ": negative batch stride (x " + str(p.stride_x) + ", w " +
                       str(p.stride_w) + ", y " + str(p.stride_y) + ")");
    }
    if (p.x == nullptr || p.w == nullptr || p.y == nullptr) {
      throw InvalidArgument(name + ": x, w and y must be device pointers, got null");
    }
    const size_t y_bytes = p.out_dtype == DType::kF32 ? 4 : 2;
    const bool batched = p.batch > 1;
    // A batch-invariant shape's key must not change with m, so its rows' alignment always counts.
    const bool rows_vary = p.m > 1 || batch_invariant;
    const PlanKey key{p.batch,
                      p.m,
                      p.n,
                      p.k,
                      p.ldx,
                      p.ldw,
                      p.ldy,
                      batched ? p.stride_x : 0,
                      batched ? p.stride_w : 0,
                      batched ? p.stride_y : 0,
                      static_cast<int>(p.op_w),
                      static_cast<int>(p.out_dtype),
                      alignment_of(p.x, p.ldx, rows_vary, p.stride_x, batched, 2),
                      alignment_of(p.w, p.ldw, true, p.stride_w, batched, 2),
                      alignment_of(p.y, p.ldy, rows_vary, p.stride_y, batched, y_bytes),
                      batched && p.tune_by_batch_rows};
    Plan& plan = plan_for(key);
    const float alpha = 1.0f;
    const float beta = p.beta;
    if (!plan.tuned) tune(plan, key, p, y_bytes, stream);
    if (plan.has_algo) {
      QUANTMLA_CUBLAS_CHECK(cublasLtMatmul(lt, plan.desc, &alpha, p.w, plan.a, p.x, plan.b, &beta,
                                           p.y, plan.c, p.y, plan.c, &plan.algo, workspace,
                                           workspace_bytes, stream));
      return;
    }
    run_cublas(p, name, alpha, beta, stream);
  }

  // Times plan's candidates on p's operands (GemmRunner's tune_min_rows) and keeps the fastest.
  // Not while the stream is captured (no timing inside a graph): the plan stays untuned and a
  // later call outside the capture tunes it.
  void tune(Plan& plan, const PlanKey& key, const BatchedGemmParams& p, size_t y_bytes,
            cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    QUANTMLA_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return;
    plan.tuned = true;
    PlanKey bucket = key;
    bucket.m = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(key.m)));
    if (key.tune_by_batch_rows) bucket.stride_x = bucket.stride_y = 0;  // they follow m
    const auto known = tuned_by_bucket.find(bucket);
    if (known != tuned_by_bucket.end()) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt, plan.desc, plan.a, plan.b, plan.c, plan.c, &known->second,
                                  &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= workspace_bytes) {
        plan.algo = known->second;
        plan.candidates.clear();
        return;
      }
    }
    void* out = p.y;
    void* scratch = nullptr;
    if (p.beta != 0.0f) {
      // y's extent, from its last batch's last row.
      const size_t elements =
          static_cast<size_t>((p.batch - 1) * p.stride_y + (p.m - 1) * p.ldy + p.n);
      if (cudaMalloc(&scratch, elements * y_bytes) != cudaSuccess) {
        (void)cudaGetLastError();  // no room: keep the first choice
        plan.candidates.clear();
        return;
      }
      out = scratch;
    }
    if (events.start == nullptr) {
      QUANTMLA_CUDA_CHECK(cudaEventCreate(&events.start));
      QUANTMLA_CUDA_CHECK(cudaEventCreate(&events.stop));
    }
    const float alpha = 1.0f, beta = p.beta;
    float best_ms = 0.0f;
    bool found = false;
    try {
      for (const cublasLtMatmulAlgo_t& algo : plan.candidates) {
        const auto call = [&] {
          return cublasLtMatmul(lt, plan.desc, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.y, plan.c,
                                out, plan.c, &algo, workspace, workspace_bytes, stream);
        };
        if (call() != CUBLAS_STATUS_SUCCESS) continue;  // the first run also loads its kernel
        QUANTMLA_CUDA_CHECK(cudaEventRecord(events.start, stream));
        bool ran = true;
        for (int r = 0; r < 3 && ran; ++r) ran = call() == CUBLAS_STATUS_SUCCESS;
        QUANTMLA_CUDA_CHECK(cudaEventRecord(events.stop, stream));
        QUANTMLA_CUDA_CHECK(cudaEventSynchronize(events.stop));
        float ms = 0.0f;
        QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
        if (ran && (!found || ms < best_ms)) {
          best_ms = ms;
          plan.algo = algo;
          found = true;
        }
      }
    } catch (...) {
      if (scratch != nullptr) cudaFree(scratch);
      throw;
    }
    if (scratch != nullptr) QUANTMLA_CUDA_CHECK(cudaFree(scratch));
    plan.candidates.clear();
    tuned_by_bucket[bucket] = plan.algo;
    ++tuned;
  }

  void run_cublas(const BatchedGemmParams& p, const std::string& name, float alpha, float beta,
                  cudaStream_t stream) {
    constexpr int64_t kIntMax = std::numeric_limits<int>::max();
    if (std::max({p.m, p.n, p.k, p.ldx, p.ldw, p.ldy, p.batch}) > kIntMax) {
      throw ShapeError(name + ": shape beyond cuBLAS's int range (m " + str(p.m) + ", n " +
                       str(p.n) + ", k " + str(p.k) + ") and cuBLASLt has no algorithm for it");
    }
    // cublasSetStream resets the workspace to cuBLAS's own pool, so the workspace follows it.
    QUANTMLA_CUBLAS_CHECK(cublasSetStream(blas, stream));
    QUANTMLA_CUBLAS_CHECK(cublasSetWorkspace(blas, workspace, workspace_bytes));
    const bool transpose_w = p.op_w == GemmOp::kT;
    QUANTMLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        blas, transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(p.n),
        static_cast<int>(p.m), static_cast<int>(p.k), &alpha, p.w, CUDA_R_16BF,
        static_cast<int>(p.ldw), p.stride_w, p.x, CUDA_R_16BF, static_cast<int>(p.ldx), p.stride_x,
        &beta, p.y, cuda_type(p.out_dtype), static_cast<int>(p.ldy), p.stride_y,
        static_cast<int>(p.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
};

bool sums_in_one_pass(const cublasLtMatmulAlgo_t& algo) {
  uint32_t splits = 1, scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                           sizeof(splits), &written) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                           sizeof(scheme), &written) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  return splits <= 1 && scheme == CUBLASLT_REDUCTION_SCHEME_NONE;
}

GemmRunner::GemmRunner(size_t workspace_bytes, void* workspace, int64_t tune_min_rows,
                       bool batch_invariant)
    : state_(std::make_unique<State>()) {
  if (tune_min_rows < 0) {
    throw InvalidArgument("GemmRunner: tune_min_rows must be >= 0 (0: never tune), got " +
                          std::to_string(tune_min_rows));
  }
  state_->tune_min_rows = batch_invariant ? 0 : tune_min_rows;
  state_->batch_invariant = batch_invariant;
  if (workspace != nullptr && reinterpret_cast<uintptr_t>(workspace) % kMaxAlignment != 0) {
    throw InvalidArgument("GemmRunner: the workspace must be 256-byte aligned (cuBLAS), got " +
                          std::to_string(reinterpret_cast<uintptr_t>(workspace) % kMaxAlignment) +
                          " bytes past a boundary");
  }
  state_->workspace_bytes = workspace_bytes;
  if (workspace != nullptr) {
    state_->workspace = workspace;
  } else if (workspace_bytes > 0) {
    QUANTMLA_CUDA_CHECK(cudaMalloc(&state_->workspace, workspace_bytes));
    state_->owns_workspace = true;
  }
  QUANTMLA_CUBLAS_CHECK(cublasLtCreate(&state_->lt));
  QUANTMLA_CUBLAS_CHECK(cublasCreate(&state_->blas));
}

GemmRunner::~GemmRunner() = default;

void GemmRunner::linear(int64_t m, int64_t n, int64_t k, const uint16_t* x, int64_t ldx,
                        const uint16_t* w, int64_t ldw, void* y, int64_t ldy, DType out_dtype,
                        float beta, cudaStream_t stream) {
  BatchedGemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.x = x;
  p.ldx = ldx;
  p.w = w;
  p.ldw = ldw;
  p.op_w = GemmOp::kT;
  p.y = y;
  p.ldy = ldy;
  p.out_dtype = out_dtype;
  p.beta = beta;
  state_->run(p, "linear", stream);
}

void GemmRunner::batched(const BatchedGemmParams& params, cudaStream_t stream) {
  state_->run(params, "batched", stream);
}

size_t GemmRunner::cached_plans() const { return state_->plans.size(); }

size_t GemmRunner::tuned_plans() const { return state_->tuned; }

}  // namespace quantmla::gpu
