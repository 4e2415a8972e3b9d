// The decode step's fused launches against the separate kernels they replace, bit for bit, on
// fresh random inputs (the seed is printed; --seed S repeats a run). The separate kernels are
// checked against double references by test_model_ops, so equal bits carry those checks over:
// - the skinny product's normalizing prologue (x_f32) = rms_norm, then the product on its BF16
//   output with the same tiling; its normed_out = rms_norm's output;
// - the sort with the shared experts' groups first = the plain sort shifted by their rows;
// - the experts' grouped products with the shared experts as static groups (the down slices read
//   with static_ldw) and the combine in the down product's tail = the products on contiguous
//   copies, then moe_combine; run twice from one captured graph (the tail's counters reset);
// - write_cache_and_queries = mla_write, then rope_queries.
// Every output is poisoned (0xFF) first. Exit status: 0 all passed, 1 a check failed, 77 no
// CUDA device (ctest: skipped).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "checks.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_array.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/skinny_gemm.h"
#include "kernels/cuda/write_queries.h"
#include "quantmla/cache_format.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"

namespace {

using namespace quantmla;
using gpu::DeviceArray;

using gpu_checks::expect;
using gpu_checks::expect_throws;
using gpu_checks::rng;

void sync() { QUANTMLA_CUDA_CHECK(cudaDeviceSynchronize()); }

// Equal bits, with the first difference in the message.
template <class T>
void expect_equal(const std::string& name, const std::vector<T>& got, const std::vector<T>& ref) {
  size_t first = got.size() == ref.size() ? got.size() : 0;
  size_t differing = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (std::memcmp(&got[i], &ref[i], sizeof(T)) != 0) {
      if (differing++ == 0) first = i;
    }
  }
  const bool ok = got.size() == ref.size() && differing == 0;
  std::printf("%-80s %s\n", name.c_str(), ok ? "equal" : "DIFFERENT");
  expect(ok, name + ": " + std::to_string(differing) + " of " + std::to_string(ref.size()) +
                 " elements differ, the first at " + std::to_string(first) + " (sizes " +
                 std::to_string(got.size()) + " and " + std::to_string(ref.size()) + ")");
}

std::vector<float> random_f32(size_t count, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(count);
  for (auto& x : v) x = normal(rng);
  return v;
}

std::vector<uint16_t> random_bf16(size_t count, float scale) {
  std::vector<uint16_t> bits(count);
  std::normal_distribution<float> normal(0.0f, scale);
  for (auto& b : bits) b = f32_to_bf16(normal(rng));
  return bits;
}

// ---------------------------------------------------------------- the normalizing prologue

struct NormCase {
  std::string name;
  int64_t m, n, k, ldx;
  bool silu;
  gpu::SkinnyTiling tiling;  // tile_n 0: the product's own choice, for both runs
  bool normed_out;
};

void run_norm_case(const NormCase& c) {
  std::vector<float> x = random_f32(static_cast<size_t>(c.m * c.ldx), 1.0f);
  for (size_t i = 0; i < x.size(); i += 61) x[i] *= 40.0f;  // a few large channels
  std::vector<float> norm = random_f32(static_cast<size_t>(c.k), 0.3f);
  for (auto& w : norm) w += 1.0f;
  const float eps = 1e-6f;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.k));
  DeviceArray<float> dx(x), dnorm(norm);
  DeviceArray<uint16_t> gate(random_bf16(static_cast<size_t>(c.n * c.k), scale));
  DeviceArray<uint16_t> up(random_bf16(static_cast<size_t>(c.n * c.k), scale));
  DeviceArray<uint16_t> h(static_cast<size_t>(c.m * c.k)), h_fused(h.size());
  const size_t y_bytes = static_cast<size_t>(c.m * c.n) * (c.silu ? 2 : 4);
  DeviceArray<uint8_t> y(y_bytes), y_fused(y_bytes);
  h.fill_bytes(0xff), h_fused.fill_bytes(0xff), y.fill_bytes(0xff), y_fused.fill_bytes(0xff);

  gpu::rms_norm(dx.data(), c.ldx, dnorm.data(), h.data(), c.k, DType::kBF16, c.m, c.k, eps,
                nullptr);
  gpu::SkinnyGemmParams p;
  p.x = h.data(), p.ldx = c.k, p.x_rows = c.m, p.max_rows = c.m;
  p.weight = gate.data(), p.weight2 = c.silu ? up.data() : nullptr;
  p.n = c.n, p.k = c.k, p.y = y.data(), p.ldy = c.n;
  p.out_dtype = c.silu ? DType::kBF16 : DType::kF32;
  p.epilogue = c.silu ? gpu::SkinnyEpilogue::kSiluMul : gpu::SkinnyEpilogue::kStore;
  gpu::SkinnyGemmParams f = p;
  f.x = nullptr, f.x_f32 = dx.data(), f.ldx = c.ldx, f.norm_weight = dnorm.data();
  f.norm_eps = eps, f.y = y_fused.data();
  if (c.normed_out) f.normed_out = h_fused.data(), f.ld_normed = c.k;
  const gpu::SkinnyTiling tiling = c.tiling.tile_n != 0 ? c.tiling : gpu::skinny_gemm_tiling(f);
  gpu::skinny_gemm(p, tiling, nullptr);
  gpu::skinny_gemm(f, tiling, nullptr);
  sync();
  const std::string name = c.name + " (tile " + std::to_string(tiling.tile_n) + ", " +
                           std::to_string(tiling.warps) + " warps, " +
                           std::to_string(16 * tiling.m_tiles) + " rows)";
  expect_equal(name + ": y", y_fused.download(), y.download());
  if (c.normed_out) expect_equal(name + ": normed_out", h_fused.download(), h.download());
}

void run_norm_cases() {
  const gpu::SkinnyTiling own{};
  const std::vector<NormCase> cases = {
      {"norm prologue: q_kv_a m 1 n 3648 k 2048", 1, 3648, 2048, 2048, false, own, false},
      {"norm prologue: router m 4 n 64 k 2048, normed_out", 4, 64, 2048, 2048, false, own, true},
      {"norm prologue: q_b m 3 n 3072 k 1536, ldx 2112", 3, 3072, 1536, 2112, false, own, false},
      {"norm prologue: dense MLP m 2 n 1408 k 2048 silu", 2, 1408, 2048, 2048, true, own, true},
      {"norm prologue: m 5 n 100 k 136 (k past its last chunk)", 5, 100, 136, 144, false, own,
       true},
      {"norm prologue: m 20 n 200 k 512 (32-row tiles)", 20, 200, 512, 512, false, own, true},
  };
  for (const NormCase& c : cases) run_norm_case(c);
  // Every variant of the prologue, at one and at two warps.
  for (const int m_tiles : {1, 2}) {
    for (const int tile_n : {8, 16, 32, 64}) {
      for (const int warps : {1, 2}) {
        for (const bool silu : {false, true}) {
          run_norm_case(
              {"norm prologue: variant m 17 n 136 k 320" + std::string(silu ? " silu" : ""),
               17,
               136,
               320,
               328,
               silu,
               {tile_n, warps, m_tiles},
               true});
        }
      }
    }
  }

  DeviceArray<float> x(16 * 7168), norm(7168);
  DeviceArray<uint16_t> w(64 * 7168);
  DeviceArray<float> y(16 * 64);
  DeviceArray<int32_t> offsets(2);
  gpu::SkinnyGemmParams p;
  p.x_f32 = x.data(), p.ldx = 2048, p.x_rows = 4, p.max_rows = 4, p.norm_weight = norm.data();
  p.weight = w.data(), p.n = 64, p.k = 2048, p.y = y.data(), p.ldy = 64;
  const auto with = [&](auto change) {
    gpu::SkinnyGemmParams q = p;
    change(q);
    return [q] { gpu::skinny_gemm(q, nullptr); };
  };
  expect_throws<InvalidArgument>("x_f32 without norm_weight",
                                 with([](auto& q) { q.norm_weight = nullptr; }));
  expect_throws<InvalidArgument>(
      "x_f32 with x", with([&](auto& q) { q.x = reinterpret_cast<uint16_t*>(w.data()); }));
  expect_throws<InvalidArgument>("x_f32 on a grouped product", with([&](auto& q) {
                                   q.offsets = offsets.data();
                                   q.w = nullptr;
                                 }));
  expect_throws<InvalidArgument>(
      "x_f32 of 16 rows of k 7168 (224 KB of normalized rows)",
      with([](auto& q) { q.k = 7168, q.ldx = 7168, q.x_rows = 16, q.max_rows = 16; }));
  expect(!gpu::skinny_norm_fits(16, 7168) && !gpu::skinny_norm_fits(16, 2048) &&
             gpu::skinny_norm_fits(1, 7168) && gpu::skinny_norm_fits(4, 2048),
         "skinny_norm_fits: 16 x 7168 and 16 x 2048 do not fit, 1 x 7168 and 4 x 2048 do");
}

// ---------------------------------------------------------------- the mixed experts

struct HostSort {
  std::vector<int32_t> offsets, slot_of, token_of_slot;
};

// Distinct random experts per token.
std::vector<int32_t> random_choices(int64_t n, int k, int num_experts) {
  std::vector<int32_t> experts(static_cast<size_t>(n * k));
  std::vector<int32_t> all(static_cast<size_t>(num_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < n; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    std::copy_n(all.begin(), k, experts.begin() + t * k);
  }
  return experts;
}

// The sort with `shared` groups against the sort without them: offsets and slots shifted by the
// shared rows, which come first (group i: rows i n.., token t at row i n + t). Returns the
// shared sort's outputs (on the device in `out`).
void check_shared_sort(const std::string& name, const std::vector<int32_t>& experts, int64_t n,
                       int k, int num_experts, int shared, gpu::MoeSortBuffers& out) {
  const int64_t entries = n * k, base = shared * n;
  DeviceArray<int32_t> dexperts(experts), counts(num_experts), offsets(num_experts + 1),
      slot_of(entries), token_of_slot(entries);
  DeviceArray<uint8_t> workspace(gpu::moe_sort_workspace_bytes(n, k, num_experts));
  gpu::MoeSortBuffers plain{counts.data(), offsets.data(), slot_of.data(), token_of_slot.data(),
                            workspace.data()};
  gpu::moe_sort(dexperts.data(), n, k, num_experts, plain, nullptr);
  gpu::moe_sort(dexperts.data(), n, k, num_experts, out, nullptr);
  sync();
  std::vector<int32_t> ref_offsets(static_cast<size_t>(shared + num_experts + 1));
  const auto plain_offsets = offsets.download();
  for (int i = 0; i < shared; ++i) ref_offsets[i] = static_cast<int32_t>(i * n);
  for (int e = 0; e <= num_experts; ++e) ref_offsets[shared + e] = plain_offsets[e] + base;
  std::vector<int32_t> ref_slot = slot_of.download();
  for (auto& s : ref_slot) s += static_cast<int32_t>(base);
  std::vector<int32_t> ref_token(static_cast<size_t>(base + entries));
  for (int64_t r = 0; r < base; ++r) ref_token[r] = static_cast<int32_t>(r % n);
  const auto plain_token = token_of_slot.download();
  std::copy(plain_token.begin(), plain_token.end(), ref_token.begin() + base);
  const auto download = [](int32_t* p, size_t count) {
    std::vector<int32_t> v(count);
    QUANTMLA_CUDA_CHECK(cudaMemcpy(v.data(), p, count * 4, cudaMemcpyDeviceToHost));
    return v;
  };
  expect_equal(name + ": offsets", download(out.offsets, ref_offsets.size()), ref_offsets);
  expect_equal(name + ": slot_of", download(out.slot_of, entries), ref_slot);
  expect_equal(name + ": token_of_slot", download(out.token_of_slot, ref_token.size()), ref_token);
  expect_equal(name + ": counts (routed only)", download(out.counts, num_experts),
               counts.download());
}

// The experts of one MoE layer for n tokens: E routed of inner each, `shared` shared slices of
// inner in one [shared * inner] MLP; fused (static groups, static_ldw, the tail, one captured
// graph run twice) against the separate products on contiguous copies and moe_combine twice.
void run_mixed_experts_case(int64_t n, int k, int num_experts, int shared, int64_t d,
                            int64_t inner) {
  const std::string name = "mixed experts n " + std::to_string(n) + " k " + std::to_string(k) +
                           " E " + std::to_string(num_experts) + " shared " +
                           std::to_string(shared) + " d " + std::to_string(d) + " inner " +
                           std::to_string(inner);
  const int64_t entries = n * k, rows = entries + shared * n;
  const int groups = shared + num_experts;
  const std::vector<int32_t> experts = random_choices(n, k, num_experts);
  DeviceArray<int32_t> counts(num_experts), offsets(groups + 1), slot_of(entries),
      token_of_slot(rows);
  DeviceArray<uint8_t> workspace(gpu::moe_sort_workspace_bytes(n, k, num_experts));
  for (auto* a : {&offsets, &slot_of, &token_of_slot, &counts}) a->fill_bytes(0xff);
  gpu::MoeSortBuffers sort{counts.data(),        offsets.data(),   slot_of.data(),
                           token_of_slot.data(), workspace.data(), shared};
  check_shared_sort(name + " sort", experts, n, k, num_experts, shared, sort);

  // Weights: the shared MLP as the checkpoint has it, then the routed experts'.
  const float s_in = 1.0f / std::sqrt(static_cast<float>(d));
  const float s_inner = 1.0f / std::sqrt(static_cast<float>(inner));
  DeviceArray<uint16_t> shared_gate(random_bf16(shared * inner * d, s_in));
  DeviceArray<uint16_t> shared_up(random_bf16(shared * inner * d, s_in));
  const std::vector<uint16_t> shared_down_host = random_bf16(d * shared * inner, s_inner);
  DeviceArray<uint16_t> shared_down(shared_down_host);
  DeviceArray<uint16_t> routed_gate(random_bf16(num_experts * inner * d, s_in));
  DeviceArray<uint16_t> routed_up(random_bf16(num_experts * inner * d, s_in));
  DeviceArray<uint16_t> routed_down(random_bf16(num_experts * d * inner, s_inner));
  // The down slices as contiguous [d, inner] copies (the reference's).
  std::vector<uint16_t> slices(static_cast<size_t>(shared * d * inner));
  for (int i = 0; i < shared; ++i) {
    for (int64_t r = 0; r < d; ++r) {
      std::copy_n(shared_down_host.begin() + r * shared * inner + i * inner, inner,
                  slices.begin() + (i * d + r) * inner);
    }
  }
  DeviceArray<uint16_t> slice_copies(slices);
  std::vector<const uint16_t*> gate(groups), up(groups), down(groups), down_copies(groups);
  for (int g = 0; g < groups; ++g) {
    const bool is_shared = g < shared;
    const int64_t e = g - shared;
    gate[g] = is_shared ? shared_gate.data() + g * inner * d : routed_gate.data() + e * inner * d;
    up[g] = is_shared ? shared_up.data() + g * inner * d : routed_up.data() + e * inner * d;
    down[g] = is_shared ? shared_down.data() + g * inner : routed_down.data() + e * d * inner;
    down_copies[g] = is_shared ? slice_copies.data() + g * d * inner : down[g];
  }
  DeviceArray<const uint16_t*> dgate(gate), dup(up), ddown(down), ddown_copies(down_copies);

  const std::vector<uint16_t> h_host = random_bf16(n * d, 1.0f);
  DeviceArray<uint16_t> h(h_host);
  DeviceArray<uint16_t> act(rows * inner), act_ref(rows * inner);
  DeviceArray<float> out(rows * d), out_ref(rows * d);
  const std::vector<float> x0 = random_f32(n * d, 1.0f);
  DeviceArray<float> x(x0), x_ref(x0);
  std::vector<float> weights_host = random_f32(entries, 0.3f);
  DeviceArray<float> weights(weights_host);
  DeviceArray<int32_t> counters((d + 7) / 8);
  counters.fill_bytes(0);
  for (auto* a : {&act, &act_ref}) a->fill_bytes(0xff);
  for (auto* a : {&out, &out_ref}) a->fill_bytes(0xff);

  gpu::SkinnyGemmParams gate_up;
  gate_up.x = h.data(), gate_up.ldx = d, gate_up.x_rows = n;
  gate_up.row_index = token_of_slot.data(), gate_up.offsets = offsets.data();
  gate_up.groups = groups, gate_up.max_rows = rows, gate_up.w = dgate.data(),
  gate_up.w2 = dup.data();
  gate_up.n = inner, gate_up.k = d, gate_up.ldy = inner, gate_up.out_dtype = DType::kBF16;
  gate_up.epilogue = gpu::SkinnyEpilogue::kSiluMul;
  gpu::SkinnyGemmParams down_p;
  down_p.x_rows = rows, down_p.ldx = inner, down_p.offsets = offsets.data();
  down_p.groups = groups, down_p.max_rows = rows, down_p.n = d, down_p.k = inner;
  down_p.ldy = d, down_p.out_dtype = DType::kF32, down_p.routing_ready = true;

  // The reference: no static groups, contiguous down slices, moe_combine.
  gpu::SkinnyGemmParams ref_gate_up = gate_up, ref_down = down_p;
  ref_gate_up.y = act_ref.data();
  ref_down.x = act_ref.data(), ref_down.w = ddown_copies.data(), ref_down.y = out_ref.data();
  const gpu::SkinnyTiling gu_tiling = gpu::skinny_gemm_tiling(ref_gate_up);
  const gpu::SkinnyTiling down_tiling = gpu::skinny_gemm_tiling(ref_down);
  gpu::skinny_gemm(ref_gate_up, gu_tiling, nullptr);
  gpu::skinny_gemm(ref_down, down_tiling, nullptr);
  for (int run = 0; run < 2; ++run) {
    gpu::moe_combine(out_ref.data(), d, slot_of.data(), weights.data(), x_ref.data(), d, n, k, d,
                     nullptr, shared);
  }

  // The fused launches, captured once and replayed twice (programmatic launches on).
  gpu::SkinnyGemmParams fused_gate_up = gate_up, fused_down = down_p;
  fused_gate_up.y = act.data();
  fused_gate_up.static_groups = shared, fused_gate_up.static_rows = n;
  fused_down.x = act.data(), fused_down.w = ddown.data(), fused_down.y = out.data();
  fused_down.static_groups = shared, fused_down.static_rows = n;
  fused_down.static_ldw = shared > 0 ? shared * inner : 0;
  fused_down.combine = {counters.data(), slot_of.data(), weights.data(), k, shared, x.data(), d, n};
  gpu::set_programmatic_launch(true);
  cudaStream_t stream;
  QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  sync();
  QUANTMLA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  gpu::skinny_gemm(fused_gate_up, gu_tiling, stream);
  gpu::skinny_gemm(fused_down, down_tiling, stream);
  QUANTMLA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  QUANTMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int run = 0; run < 2; ++run) QUANTMLA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  QUANTMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  QUANTMLA_CUDA_CHECK(cudaGraphDestroy(graph));
  QUANTMLA_CUDA_CHECK(cudaStreamDestroy(stream));
  gpu::set_programmatic_launch(false);
  sync();
  expect_equal(name + ": gate and up (static groups)", act.download(), act_ref.download());
  expect_equal(name + ": expert outputs (static_ldw slices)", out.download(), out_ref.download());
  expect_equal(name + ": x after two combining tails", x.download(), x_ref.download());
  expect_equal(name + ": counters back to zero", counters.download(),
               std::vector<int32_t>(counters.size(), 0));
}

// moe_route_sort with shared groups (its one-block kernel) against moe_route_sort without.
void run_route_sort_shared_case(int64_t n, int shared) {
  gpu::MoeRouteParams c;
  c.num_experts = 64, c.top_k = 6, c.scoring = gpu::MoeScoring::kSoftmax;
  c.method = gpu::MoeTopkMethod::kGreedy;
  const int e = c.num_experts, k = c.top_k;
  const int64_t entries = n * k, base = shared * n;
  DeviceArray<float> logits(random_f32(n * e, 2.0f));
  DeviceArray<int32_t> experts(entries), experts2(entries), counts(e), counts2(e), offsets(e + 1),
      offsets2(shared + e + 1), slot_of(entries), slot_of2(entries), token(entries),
      token2(base + entries);
  DeviceArray<float> weights(entries), weights2(entries);
  DeviceArray<uint8_t> workspace(gpu::moe_sort_workspace_bytes(n, k, e));
  gpu::MoeSortBuffers plain{counts.data(), offsets.data(), slot_of.data(), token.data(),
                            workspace.data()};
  gpu::MoeSortBuffers with{counts2.data(), offsets2.data(),  slot_of2.data(),
                           token2.data(),  workspace.data(), shared};
  gpu::moe_route_sort(logits.data(), e, nullptr, experts.data(), weights.data(), n, c, plain,
                      nullptr);
  gpu::moe_route_sort(logits.data(), e, nullptr, experts2.data(), weights2.data(), n, c, with,
                      nullptr);
  sync();
  const std::string name = "moe_route_sort n " + std::to_string(n) + " with " +
                           std::to_string(shared) + " shared groups";
  expect_equal(name + ": experts", experts2.download(), experts.download());
  expect_equal(name + ": weights", weights2.download(), weights.download());
  std::vector<int32_t> ref_offsets(static_cast<size_t>(shared + e + 1));
  const auto o = offsets.download();
  for (int i = 0; i < shared; ++i) ref_offsets[i] = static_cast<int32_t>(i * n);
  for (int x = 0; x <= e; ++x) ref_offsets[shared + x] = o[x] + static_cast<int32_t>(base);
  expect_equal(name + ": offsets", offsets2.download(), ref_offsets);
  std::vector<int32_t> ref_slot = slot_of.download();
  for (auto& s : ref_slot) s += static_cast<int32_t>(base);
  expect_equal(name + ": slot_of", slot_of2.download(), ref_slot);
  std::vector<int32_t> ref_token(static_cast<size_t>(base + entries));
  for (int64_t r = 0; r < base; ++r) ref_token[r] = static_cast<int32_t>(r % n);
  const auto t = token.download();
  std::copy(t.begin(), t.end(), ref_token.begin() + base);
  expect_equal(name + ": token_of_slot", token2.download(), ref_token);
}

void run_mixed_errors() {
  DeviceArray<uint16_t> a(64 * 64);
  DeviceArray<float> y(64 * 64);
  DeviceArray<int32_t> offsets(8);
  DeviceArray<const uint16_t*> w(std::vector<const uint16_t*>(4, a.data()));
  gpu::SkinnyGemmParams p;
  p.x = a.data(), p.ldx = 64, p.x_rows = 8, p.offsets = offsets.data(), p.groups = 4;
  p.max_rows = 8, p.w = w.data(), p.n = 64, p.k = 64, p.y = y.data(), p.ldy = 64;
  const auto with = [&](auto change) {
    gpu::SkinnyGemmParams q = p;
    change(q);
    return [q] { gpu::skinny_gemm(q, nullptr); };
  };
  expect_throws<ShapeError>("static groups past max_rows",
                            with([](auto& q) { q.static_groups = 3, q.static_rows = 3; }));
  expect_throws<ShapeError>("static groups past the groups",
                            with([](auto& q) { q.static_groups = 5, q.static_rows = 1; }));
  expect_throws<ShapeError>("static_ldw below k", with([](auto& q) {
                              q.static_groups = 1, q.static_rows = 2, q.static_ldw = 56;
                            }));
  expect_throws<InvalidArgument>(
      "combine on a BF16 product", with([&](auto& q) {
        q.out_dtype = DType::kBF16;
        q.combine = {offsets.data(), offsets.data(), y.data(), 2, 0, y.data(), 64, 4};
      }));
  expect_throws<InvalidArgument>("combine without slot_of", with([&](auto& q) {
                                   q.combine = {offsets.data(), nullptr, y.data(), 2, 0,
                                                y.data(),       64,      4};
                                 }));
  expect_throws<ShapeError>("moe_sort with -1 shared groups", [&] {
    gpu::MoeSortBuffers b{offsets.data(), offsets.data(), offsets.data(),
                          offsets.data(), offsets.data(), -1};
    gpu::moe_sort(offsets.data(), 2, 2, 4, b, nullptr);
  });
  expect_throws<ShapeError>("moe_combine with -1 shared groups", [&] {
    gpu::moe_combine(y.data(), 64, offsets.data(), y.data(), y.data(), 64, 2, 2, 64, nullptr, -1);
  });
}

// ---------------------------------------------------------------- the write and the queries

void run_write_queries_case(const std::string& spec, int64_t tokens, int heads, int nope) {
  const CacheFormat format = CacheFormat::parse(spec);
  const int rope = gpu::kRopeDim, qk = nope + rope, hp = gpu::padded_heads(heads);
  const int64_t stride = static_cast<int64_t>(heads) * qk + gpu::kLatentDim + rope;
  const std::vector<float> proj = random_f32(static_cast<size_t>(tokens * stride), 2.0f);
  std::vector<float> norm = random_f32(gpu::kLatentDim, 0.2f);
  for (auto& w : norm) w += 1.0f;
  std::vector<float> inv_freq(rope / 2);
  for (int i = 0; i < rope / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / rope);
  const int64_t sequences = 3, pages_per_sequence = (tokens + 63) / 64 + 2;
  std::vector<int32_t> table(static_cast<size_t>(sequences * pages_per_sequence));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<int32_t> seq_ids(static_cast<size_t>(tokens)), positions(seq_ids.size());
  std::vector<int64_t> next(static_cast<size_t>(sequences), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    seq_ids[t] = static_cast<int32_t>(t % sequences);
    positions[t] = static_cast<int32_t>(next[seq_ids[t]]++ * 3 + 1);  // within the pages
  }
  DeviceArray<float> dproj(proj), dnorm(norm), dfreq(inv_freq);
  DeviceArray<int32_t> dtable(table), dseq(seq_ids), dpos(positions);
  const size_t pool_bytes = static_cast<size_t>(table.size()) * gpu::kPageTokens *
                            format.record_bytes(gpu::kLatentDim, rope);
  DeviceArray<uint8_t> pool(pool_bytes), pool2(pool_bytes);
  const size_t q_size = static_cast<size_t>(tokens) * heads * qk;
  const size_t dec_size = static_cast<size_t>(tokens) * hp * 576;
  DeviceArray<uint16_t> q(q_size), q2(q_size), dec(dec_size), dec2(dec_size);
  for (auto* a : {&pool, &pool2}) a->fill_bytes(0x5a);
  for (auto* a : {&q, &q2, &dec, &dec2}) a->fill_bytes(0xff);

  gpu::MlaWriteParams w;
  w.c = dproj.data() + heads * qk, w.c_stride = stride;
  w.k_pe = w.c + gpu::kLatentDim, w.k_pe_stride = stride;
  w.norm_weight = dnorm.data(), w.norm_eps = 1e-6f;
  w.inv_freq = dfreq.data(), w.attention_factor = 1.1f;
  w.seq_ids = dseq.data(), w.positions = dpos.data(), w.pool = pool.data();
  w.block_table = dtable.data(), w.block_table_stride = pages_per_sequence;
  w.num_tokens = tokens;
  gpu::RopeQueriesParams r;
  r.q = dproj.data(), r.q_token_stride = stride, r.q_bf16 = q.data(), r.decode_q = dec.data();
  r.heads_padded = hp, r.positions = dpos.data(), r.inv_freq = dfreq.data();
  r.attention_factor = 1.1f, r.tokens = tokens, r.heads = heads, r.nope = nope, r.rope = rope;
  gpu::mla_write(format, w, nullptr);
  gpu::rope_queries(r, nullptr);
  gpu::MlaWriteParams w2 = w;
  w2.pool = pool2.data();
  gpu::RopeQueriesParams r2 = r;
  r2.q_bf16 = q2.data(), r2.decode_q = dec2.data();
  gpu::write_cache_and_queries(format, w2, r2, nullptr);
  sync();
  const std::string name = "write_cache_and_queries " + spec + " tokens " + std::to_string(tokens) +
                           " heads " + std::to_string(heads);
  expect_equal(name + ": pool", pool2.download(), pool.download());
  expect_equal(name + ": q_bf16", q2.download(), q.download());
  expect_equal(name + ": decode_q (RoPE columns, padding heads)", dec2.download(), dec.download());

  gpu::RopeQueriesParams r3 = r2;
  r3.tokens = tokens + 1;
  expect_throws<InvalidArgument>(name + ": token counts differ",
                                 [&] { gpu::write_cache_and_queries(format, w2, r3, nullptr); });
}

}  // namespace

int main(int argc, char** argv) {
  return gpu_checks::run(argc, argv, [] {
    run_norm_cases();
    // V2-Lite's experts at batch 1 and 16, V3's (one shared expert), a sort of several chunks.
    run_mixed_experts_case(1, 6, 64, 2, 2048, 1408);
    run_mixed_experts_case(16, 6, 64, 2, 2048, 1408);
    run_mixed_experts_case(3, 8, 256, 1, 512, 256);
    run_mixed_experts_case(50, 8, 64, 2, 256, 128);
    run_route_sort_shared_case(1, 2);
    run_route_sort_shared_case(16, 2);
    run_mixed_errors();
    run_write_queries_case("bf16", 1, 16, 128);
    run_write_queries_case("content=int4:g64,rope=int4:g64", 37, 16, 128);
    run_write_queries_case("content=int2:g64,rope=int4:g64", 5, 8, 64);
    run_write_queries_case("content=fp8,rope=bf16", 2, 128, 128);
  });
}
