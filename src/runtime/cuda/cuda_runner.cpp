// The CUDA runner: the whole DeepSeek forward on one GPU over a device PagePool. Weights are
// uploaded once as BF16 (checkpoint BF16 tensors byte for byte, others rounded one tensor at a
// time, never a host copy of the whole model); GEMMs run on cuBLASLt (BF16 in, FP32 accumulate);
// the residual stream stays FP32; attention writes the new rows with mla_write and reads the pool
// with mla_decode, prefill chunks included (s_q = the chunk's length, causal by position).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/moe_ops.h"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/skinny_gemm.h"
#include "kernels/cuda/write_queries.h"
#include "model/rope.h"
#include "quantmla/dtype.h"
#include "quantmla/error.h"
#include "quantmla/gpu_mla.h"
#include "quantmla/runner.h"
#include "quantmla/safetensors.h"

namespace quantmla {
namespace {

size_t sz(int64_t count) { return static_cast<size_t>(count); }

using ExpertProducts = CudaRunnerOptions::ExpertProducts;

// Steps of at most this many tokens run their projections through the skinny kernel.
constexpr int64_t kSkinnyMaxRows = 16;

// The skinny kernel's shape rule (skinny_gemm.h): K and the row stride of x multiples of 8.
bool skinny_shape(int64_t k, int64_t ldx) { return k % 8 == 0 && ldx % 8 == 0; }
// Prefill chunks of at least this many tokens may take the expanded attention
// (prefill_attention.h): below it the up-projection of the whole context costs more than the
// absorbed form saves.
constexpr int64_t kExpandedMinChunk = 128;
// The routed experts run as grouped skinny products while they average at most this many rows.
constexpr int64_t kGroupedRowsPerExpert = 32;
// Steps of at most this many tokens normalize inside the product that reads the norm (the skinny
// kernel's prologue: each CTA normalizes its rows itself, which costs more than a launch once
// every CTA re-reads many rows), and run the shared experts as the first groups of the routed
// experts' products with the mixture's combine in the down product's tail.
constexpr int64_t kFusedNormMaxRows = 4;
constexpr int64_t kMixedExpertsMaxRows = kSkinnyMaxRows;
// Steps of at most this many tokens write the cache and rotate the queries in one launch (every
// decode batch of the runner benchmark, as measured with the fused launch); a prefill takes the
// two launches (measured when the fused kernel's (token, head) pairs were two to a block of 64
// threads each: a 2K chunk of V2-Lite 31 us a layer against 18 us for the two; not measured since
// both take a warp a pair with vector loads).
constexpr int64_t kFusedWriteMaxRows = 256;

// One cudaMalloc for many buffers, each aligned to 256 bytes: the weights, and the step's
// activations (sized once for the largest step).
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  ~DeviceArena() { cudaFree(base_); }

  // First pass: count; second pass (after allocate()): hand out.
  template <class T>
  T* take(int64_t count) {
    const int64_t bytes = (count * static_cast<int64_t>(sizeof(T)) + 255) / 256 * 256;
    const int64_t offset = used_;
    used_ += bytes;
    if (base_ == nullptr) return nullptr;
    if (used_ > size_) throw InvalidArgument("device arena overrun (internal)");
    return reinterpret_cast<T*>(static_cast<uint8_t*>(base_) + offset);
  }
  void allocate() {
    size_ = used_;
    used_ = 0;
    QUANTMLA_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(std::max<int64_t>(size_, 256))));
  }
  int64_t bytes() const { return size_; }

 private:
  void* base_ = nullptr;
  int64_t used_ = 0;
  int64_t size_ = 0;
};

class DevicePageStorage final : public PageStorage {
 public:
  DevicePageStorage(int64_t num_layers, int64_t layer_bytes, int64_t staging_bytes)
      : layer_bytes_(layer_bytes), staging_bytes_(staging_bytes) {
    QUANTMLA_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(num_layers * layer_bytes)));
  }
  ~DevicePageStorage() override {
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
    cudaFreeHost(staging_);
    cudaFree(base_);
  }
  PoolMemory memory() const override { return PoolMemory::kDevice; }
  uint8_t* layer_pages(int64_t layer) override { return base_ + layer * layer_bytes_; }
  void read_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                  uint8_t* host) override {
    copy(num_layers, pages, page_bytes, host, /*to_host=*/true);
  }
  void write_pages(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes,
                   const uint8_t* host) override {
    // Read only: copy() writes the host side only when copying to the host.
    copy(num_layers, pages, page_bytes, const_cast<uint8_t*>(host), /*to_host=*/false);
  }

 private:
  // A swap moves a sequence's pages at preemption and readmission, between steps (every step has
  // ended when it returns, its tokens having come back to the host). The caller's buffer is
  // pageable, through which each page's copy would be a synchronous transfer staged by the
  // driver, so the pages go through a pinned staging buffer of the pool's own (allocated at the
  // first swap, CudaRunnerOptions::swap_staging_bytes), as many whole pages at a time as it holds:
  // one cudaMemcpyBatchAsync of those pages on a stream of the pool's own (one cudaMemcpyAsync a
  // page where the driver refuses the batch), and one memcpy between staging and the caller.
  void copy(int64_t num_layers, std::span<const int32_t> pages, int64_t page_bytes, uint8_t* host,
            bool to_host) {
    const int64_t count = num_layers * static_cast<int64_t>(pages.size());
    if (count == 0) return;
    if (copy_stream_ == nullptr) {
      QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    }
    // page_bytes is the pool's own: every swap takes the same rounds. Without staging
    // (swap_staging_bytes 0), or where pinned memory is refused (a locked-memory limit), the
    // copies go straight from the caller's memory, slower.
    const int64_t staging_pages = std::max<int64_t>(1, staging_bytes_ / page_bytes);
    if (staging_bytes_ > 0 && staging_ == nullptr && !staging_refused_ &&
        cudaMallocHost(&staging_, static_cast<size_t>(staging_pages * page_bytes)) != cudaSuccess) {
      cudaGetLastError();  // not sticky
      staging_ = nullptr;
      staging_refused_ = true;
    }
    const int64_t chunk = staging_ != nullptr ? staging_pages : count;
    std::vector<void*> dsts(static_cast<size_t>(chunk)), srcs(dsts.size());
    std::vector<size_t> sizes(dsts.size(), static_cast<size_t>(page_bytes));
    for (int64_t first = 0; first < count; first += chunk) {
      const int64_t n = std::min(chunk, count - first);
      const size_t bytes = static_cast<size_t>(n * page_bytes);
      uint8_t* const outside = host + first * page_bytes;  // pages in (layer, page) order
      uint8_t* const near = staging_ != nullptr ? staging_ : outside;
      if (!to_host && near != outside) std::memcpy(near, outside, bytes);
      for (int64_t k = 0; k < n; ++k) {
        const int64_t index = first + k;
        const int64_t layer = index / static_cast<int64_t>(pages.size());
        const int32_t page = pages[static_cast<size_t>(index % static_cast<int64_t>(pages.size()))];
        uint8_t* device = layer_pages(layer) + page * page_bytes;
        uint8_t* staged = near + k * page_bytes;
        dsts[static_cast<size_t>(k)] = to_host ? staged : device;
        srcs[static_cast<size_t>(k)] = to_host ? device : staged;
      }
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attributes_first = 0;
      if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), static_cast<size_t>(n),
                               &attributes, &attributes_first, 1, copy_stream_) != cudaSuccess) {
        cudaGetLastError();  // not sticky: the copies go one by one instead
        for (int64_t k = 0; k < n; ++k) {
          QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(dsts[static_cast<size_t>(k)],
                                              srcs[static_cast<size_t>(k)], sizes[0],
                                              cudaMemcpyDefault, copy_stream_));
        }
      }
      QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
      if (to_host && near != outside) std::memcpy(outside, near, bytes);
    }
  }

  uint8_t* base_ = nullptr;
  int64_t layer_bytes_;
  int64_t staging_bytes_;
  uint8_t* staging_ = nullptr;  // pinned: staging_bytes_ / page_bytes whole pages, at least one
                                // (none while staging_bytes_ is 0)
  bool staging_refused_ = false;
  cudaStream_t copy_stream_ = nullptr;
};

struct DeviceLinear {
  const uint16_t* w = nullptr;  // [out, in] BF16
  int64_t out = 0, in = 0;
};
struct DeviceMlp {
  DeviceLinear gate, up, down;
};
struct DeviceLayer {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  // The projections that read the attention input, stacked as one matrix [q rows ; kv_a rows] so
  // that one GEMM (one skinny launch at decode) makes both: q_proj (or q_a_proj with a q LoRA)
  // and kv_a_proj_with_mqa.
  DeviceLinear q_kv_a;
  DeviceLinear q_b, kv_b, o;
  // The absorbed products of a one-token decode step as one grouped skinny product each (a group
  // per head): W_UK_h^T ([rank, nope] per head, transposed copies of kv_b's rows) and W_UV_h
  // (kv_b's own rows), as device arrays of per-head pointers.
  const uint16_t* const* head_uk_t = nullptr;
  const uint16_t* const* head_uv = nullptr;
  const float* q_a_norm = nullptr;
  const float* kv_a_norm = nullptr;
  bool is_moe = false;
  DeviceMlp mlp;  // dense layers
  DeviceLinear router;
  const float* correction_bias = nullptr;
  std::vector<const uint16_t*> expert_gate, expert_up, expert_down;  // host arrays of pointers
  // The same pointers on the device (skinny_gemm's grouped products).
  const uint16_t* const* device_gate = nullptr;
  const uint16_t* const* device_up = nullptr;
  const uint16_t* const* device_down = nullptr;
  // Elements from one expert's weights to the next when every expert's gate, up and down sit at
  // the same offsets of equal blocks (gate and up adjacent: one [2 inner, d] matrix), so that
  // they are one strided-batched operand; 0 otherwise.
  int64_t expert_stride = 0;
  bool has_shared = false;
  DeviceMlp shared;
  // Decode steps run the shared experts as the first groups of the routed experts' grouped
  // products (MoeSortBuffers::shared_groups): the shared MLP [S * inner] as S slices of inner,
  // S = n_shared_experts (the down slices are column slices, row stride S * inner:
  // SkinnyGemmParams::static_ldw), then the routed experts. Device arrays of S + E pointers.
  const uint16_t* const* mixed_gate = nullptr;
  const uint16_t* const* mixed_up = nullptr;
  const uint16_t* const* mixed_down = nullptr;
};

// Uploads the checkpoint's tensors: matrices as BF16, vectors (norms, biases) as FP32.
class WeightUploader {
 public:
  WeightUploader(const TensorStore& store, DeviceArena& arena, bool counting)
      : store_(store), arena_(arena), counting_(counting) {}

  DeviceLinear linear(const std::string& name, int64_t out, int64_t in) {
    return stacked({{name, out}}, in);
  }
  // Linears of the same input width as one [sum of outs, in] matrix, in the order given.
  DeviceLinear stacked(const std::vector<std::pair<std::string, int64_t>>& parts, int64_t in) {
    int64_t out = 0;
    for (const auto& [name, rows] : parts) out += rows;
    uint16_t* device = arena_.take<uint16_t>(out * in);
    uint16_t* at = device;
    for (const auto& [name, rows] : parts) {
      const TensorView& view = store_.get(name + ".weight", {rows, in});
      if (!counting_) copy_bf16(view, at);
      at += rows * in;
    }
    return {device, out, in};
  }
  const float* vector(const std::string& name, int64_t size) {
    const TensorView& view = store_.get(name, {size});
    float* device = arena_.take<float>(size);
    if (!counting_) {
      const std::vector<float> values = to_f32(view);
      QUANTMLA_CUDA_CHECK(
          cudaMemcpy(device, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
    }
    return device;
  }
  // W_UK_h^T of every head, [heads, rank, nope] contiguous, from kv_b_proj's [heads * (nope + v),
  // rank] matrix (its first nope rows of each head).
  const uint16_t* transposed_uk(const std::string& name, int64_t heads, int64_t nope, int64_t v,
                                int64_t rank) {
    const TensorView& view = store_.get(name + ".weight", {heads * (nope + v), rank});
    uint16_t* device = arena_.take<uint16_t>(heads * rank * nope);
    if (!counting_) {
      const std::vector<float> values = to_f32(view);
      std::vector<uint16_t> bits(static_cast<size_t>(heads * rank * nope));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < nope; ++i) {
          for (int64_t r = 0; r < rank; ++r) {
            bits[static_cast<size_t>((h * rank + r) * nope + i)] =
                f32_to_bf16(values[static_cast<size_t>((h * (nope + v) + i) * rank + r)]);
          }
        }
      }
      QUANTMLA_CUDA_CHECK(cudaMemcpy(device, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    }
    return device;
  }
  // A host array copied as it is (per-group pointers, offsets).
  template <class T>
  const T* array(const std::vector<T>& host) {
    T* device = arena_.take<T>(static_cast<int64_t>(host.size()));
    if (!counting_) {
      QUANTMLA_CUDA_CHECK(
          cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    return device;
  }
  const uint16_t* const* pointers(const std::vector<const uint16_t*>& host) { return array(host); }
  DeviceMlp mlp(const std::string& prefix, int64_t hidden, int64_t inner) {
    return {linear(prefix + ".gate_proj", inner, hidden),
            linear(prefix + ".up_proj", inner, hidden),
            linear(prefix + ".down_proj", hidden, inner)};
  }

 private:
  static void copy_bf16(const TensorView& view, uint16_t* device) {
    if (view.dtype == DType::kBF16) {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(device, view.data, view.nbytes, cudaMemcpyHostToDevice));
      return;
    }
    const std::vector<float> values = to_f32(view);
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = f32_to_bf16(values[i]);
    QUANTMLA_CUDA_CHECK(cudaMemcpy(device, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
  }

  const TensorStore& store_;
  DeviceArena& arena_;
  bool counting_;
};

struct DeviceModel {
  const uint16_t* embed = nullptr;  // [vocab, hidden] BF16
  std::vector<DeviceLayer> layers;
  const float* final_norm = nullptr;
  DeviceLinear lm_head;
  const float* inv_freq = nullptr;
  const int32_t* head_offsets = nullptr;  // [heads + 1] = 0, 1, ..., heads (a group per head)
};

int64_t uniform_expert_stride(const DeviceLayer& layer, int64_t d, int64_t inner) {
  const size_t e = layer.expert_gate.size();
  if (e < 2 || layer.expert_gate[0] == nullptr) return 0;  // counting pass: no pointers yet
  const int64_t stride = layer.expert_gate[1] - layer.expert_gate[0];
  for (size_t i = 0; i < e; ++i) {
    const uint16_t* gate = layer.expert_gate[i];
    if (gate != layer.expert_gate[0] + static_cast<int64_t>(i) * stride ||
        layer.expert_up[i] != gate + inner * d || layer.expert_down[i] != gate + 2 * inner * d) {
      return 0;
    }
  }
  return stride;
}

DeviceModel upload_model(const ModelConfig& c, const TensorStore& store, DeviceArena& arena,
                         bool counting, const std::vector<float>& inv_freq) {
  WeightUploader up(store, arena, counting);
  DeviceModel model;
  model.embed = up.linear("model.embed_tokens", c.vocab_size, c.hidden_size).w;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    DeviceLayer layer;
    layer.input_norm = up.vector(p + "input_layernorm.weight", c.hidden_size);
    layer.post_norm = up.vector(p + "post_attention_layernorm.weight", c.hidden_size);
    const std::string a = p + "self_attn.";
    const int64_t qk = c.qk_head_dim();
    const std::pair<std::string, int64_t> kv_a{a + "kv_a_proj_with_mqa", c.cache_row_width()};
    if (c.q_lora_rank > 0) {
      layer.q_kv_a = up.stacked({{a + "q_a_proj", c.q_lora_rank}, kv_a}, c.hidden_size);
      layer.q_a_norm = up.vector(a + "q_a_layernorm.weight", c.q_lora_rank);
      layer.q_b = up.linear(a + "q_b_proj", c.num_heads * qk, c.q_lora_rank);
    } else {
      layer.q_kv_a = up.stacked({{a + "q_proj", c.num_heads * qk}, kv_a}, c.hidden_size);
    }
    layer.kv_a_norm = up.vector(a + "kv_a_layernorm.weight", c.kv_lora_rank);
    layer.kv_b = up.linear(a + "kv_b_proj", c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                           c.kv_lora_rank);
    layer.o = up.linear(a + "o_proj", c.hidden_size, c.num_heads * c.v_head_dim);
    {
      const int64_t heads = c.num_heads, nope = c.qk_nope_head_dim, v = c.v_head_dim;
      const int64_t rank = c.kv_lora_rank;
      const uint16_t* uk_t = up.transposed_uk(a + "kv_b_proj", heads, nope, v, rank);
      std::vector<const uint16_t*> uk(static_cast<size_t>(heads)), uv(uk.size());
      for (int64_t h = 0; h < heads; ++h) {
        uk[static_cast<size_t>(h)] = uk_t == nullptr ? nullptr : uk_t + h * rank * nope;
        uv[static_cast<size_t>(h)] =
            layer.kv_b.w == nullptr ? nullptr : layer.kv_b.w + (h * (nope + v) + nope) * rank;
      }
      layer.head_uk_t = up.pointers(uk);
      layer.head_uv = up.pointers(uv);
    }
    layer.is_moe = c.is_moe_layer(l);
    if (layer.is_moe) {
      const std::string m = p + "mlp.";
      layer.router = up.linear(m + "gate", c.n_routed_experts, c.hidden_size);
      if (c.topk_method == "noaux_tc") {
        layer.correction_bias = up.vector(m + "gate.e_score_correction_bias", c.n_routed_experts);
      }
      for (int64_t e = 0; e < c.n_routed_experts; ++e) {
        const DeviceMlp expert =
            up.mlp(m + "experts." + std::to_string(e), c.hidden_size, c.moe_intermediate_size);
        layer.expert_gate.push_back(expert.gate.w);
        layer.expert_up.push_back(expert.up.w);
        layer.expert_down.push_back(expert.down.w);
      }
      layer.expert_stride = uniform_expert_stride(layer, c.hidden_size, c.moe_intermediate_size);
      layer.device_gate = up.pointers(layer.expert_gate);
      layer.device_up = up.pointers(layer.expert_up);
      layer.device_down = up.pointers(layer.expert_down);
      if (c.n_shared_experts > 0) {
        layer.has_shared = true;
        const int64_t inner = c.moe_intermediate_size, d = c.hidden_size;
        layer.shared = up.mlp(m + "shared_experts", d, c.n_shared_experts * inner);
        std::vector<const uint16_t*> gate, up_, down;
        const bool counting_pass = layer.shared.gate.w == nullptr;
        for (int64_t i = 0; i < c.n_shared_experts; ++i) {
          gate.push_back(counting_pass ? nullptr : layer.shared.gate.w + i * inner * d);
          up_.push_back(counting_pass ? nullptr : layer.shared.up.w + i * inner * d);
          down.push_back(counting_pass ? nullptr : layer.shared.down.w + i * inner);
        }
        gate.insert(gate.end(), layer.expert_gate.begin(), layer.expert_gate.end());
        up_.insert(up_.end(), layer.expert_up.begin(), layer.expert_up.end());
        down.insert(down.end(), layer.expert_down.begin(), layer.expert_down.end());
        layer.mixed_gate = up.pointers(gate);
        layer.mixed_up = up.pointers(up_);
        layer.mixed_down = up.pointers(down);
      }
    } else {
      layer.mlp = up.mlp(p + "mlp", c.hidden_size, c.intermediate_size);
    }
    model.layers.push_back(std::move(layer));
  }
  model.final_norm = up.vector("model.norm.weight", c.hidden_size);
  if (c.tie_word_embeddings && !store.contains("lm_head.weight")) {
    model.lm_head = {model.embed, c.vocab_size, c.hidden_size};
  } else {
    model.lm_head = up.linear("lm_head", c.vocab_size, c.hidden_size);
  }
  std::vector<int32_t> offsets(static_cast<size_t>(c.num_heads + 1));
  for (size_t h = 0; h < offsets.size(); ++h) offsets[h] = static_cast<int32_t>(h);
  model.head_offsets = up.array(offsets);
  float* freq = arena.take<float>(static_cast<int64_t>(inv_freq.size()));
  if (!counting) {
    QUANTMLA_CUDA_CHECK(
        cudaMemcpy(freq, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice));
  }
  model.inv_freq = freq;
  return model;
}

// What the GPU kernels need of a model; anything else is refused at load, naming the value.
void check_model(const ModelConfig& c) {
  const auto refuse = [](const std::string& what) {
    throw InvalidArgument("the CUDA runner cannot run this model: " + what);
  };
  if (c.kv_lora_rank != gpu::kLatentDim || c.qk_rope_head_dim != gpu::kRopeDim) {
    refuse("kv_lora_rank " + std::to_string(c.kv_lora_rank) + " and qk_rope_head_dim " +
           std::to_string(c.qk_rope_head_dim) + " (the kernels need " +
           std::to_string(gpu::kLatentDim) + " and " + std::to_string(gpu::kRopeDim) + ")");
  }
  if (c.n_routed_experts > gpu::kMaxRoutedExperts) {
    refuse(std::to_string(c.n_routed_experts) + " routed experts (at most " +
           std::to_string(gpu::kMaxRoutedExperts) + ")");
  }
  if (c.n_routed_experts > 0 && c.num_experts_per_tok > gpu::kMaxExpertsPerToken) {
    refuse(std::to_string(c.num_experts_per_tok) + " experts per token (at most " +
           std::to_string(gpu::kMaxExpertsPerToken) + ")");
  }
  if (c.n_routed_experts > 0 && c.n_group > gpu::kMaxExpertGroups) {
    refuse(std::to_string(c.n_group) + " expert groups (at most " +
           std::to_string(gpu::kMaxExpertGroups) + ")");
  }
}

class CudaRunner final : public Runner {
 public:
  CudaRunner(const std::filesystem::path& dir, const CudaRunnerOptions& options)
      : options_(options) {
    QUANTMLA_CUDA_CHECK(cudaSetDevice(options.device));
    gpu::set_programmatic_launch(options.programmatic_launch);
    cudaDeviceProp prop{};
    QUANTMLA_CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
    device_name_ = prop.name;
    if (!std::filesystem::exists(dir / "config.json")) {
      throw IoError("model directory " + dir.string() + " has no config.json");
    }
    config_ = ModelConfig::from_file(dir / "config.json");
    check_model(config_);
    if (options.max_batch_tokens < 1 || options.max_sequences < 1) {
      throw InvalidArgument("CUDA runner: max_batch_tokens " +
                            std::to_string(options.max_batch_tokens) + " and max_sequences " +
                            std::to_string(options.max_sequences) + " must be positive");
    }
    const Rope rope(config_);
    attention_factor_ = rope.attention_factor();
    const TensorStore store = TensorStore::open_dir(dir);
    if (options.swap_staging_bytes < 0) {
      throw InvalidArgument("CUDA runner: swap_staging_bytes " +
                            std::to_string(options.swap_staging_bytes) + " must be >= 0");
    }
    if (options.prefill_expanded_max_context < 0) {
      throw InvalidArgument("CUDA runner: prefill_expanded_max_context " +
                            std::to_string(options.prefill_expanded_max_context) + " must be >= 0");
    }
    // Head dimensions the expanded prefill is not compiled for take the decode kernel's form.
    if (!gpu::prefill_attention_supports(static_cast<int>(config_.qk_nope_head_dim),
                                         static_cast<int>(config_.qk_rope_head_dim),
                                         static_cast<int>(config_.v_head_dim))) {
      options_.prefill_expanded_max_context = 0;
    }
    if (options_.batch_invariant) {
      // Each of these takes another arithmetic at some step sizes (CudaRunnerOptions).
      options_.prefill_expanded_max_context = 0;
      options_.fused_decode = false;
      options_.max_graph_tokens = 0;  // decode plans then follow the lengths (no fixed grid)
    }
    upload_model(config_, store, weights_arena_, /*counting=*/true, rope.inv_freq());
    weights_arena_.allocate();
    model_ = upload_model(config_, store, weights_arena_, /*counting=*/false, rope.inv_freq());
    size_activations();
    activations_.allocate();
    size_activations();
    if (buf_.combine_counters != nullptr) {  // each combining launch leaves them zero again
      QUANTMLA_CUDA_CHECK(
          cudaMemset(buf_.combine_counters, 0, sizeof(int32_t) * sz(combine_counter_count())));
      // The batched experts' padding rows of the activation are never written (silu_mul skips
      // them) but are multiplied: zeros from the start, so that they hold finite values.
      QUANTMLA_CUDA_CHECK(cudaMemset(
          buf_.expert_act, 0, sizeof(uint16_t) * sz(expert_rows_ * config_.moe_intermediate_size)));
    }
    QUANTMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    QUANTMLA_CUDA_CHECK(cudaEventCreateWithFlags(&offsets_copied_, cudaEventDisableTiming));
    QUANTMLA_CUDA_CHECK(cudaEventCreate(&kernels_start_));
    QUANTMLA_CUDA_CHECK(cudaEventCreate(&kernels_end_));
    if (config_.n_routed_experts > 0) {
      QUANTMLA_CUDA_CHECK(
          cudaMallocHost(&host_offsets_, sizeof(int32_t) * sz(config_.n_routed_experts + 1)));
    }
    gemm_ = std::make_unique<gpu::GemmRunner>(gpu::GemmRunner::kDefaultWorkspaceBytes, nullptr,
                                              gpu::GemmRunner::kDefaultTuneMinRows,
                                              options_.batch_invariant);
    if (config_.n_routed_experts > 0) route_ = gpu::moe_route_params(config_);
    read_ablation();
    std::fprintf(stderr,
                 "cuda runner: %s, weights %.2f GiB (BF16), activations %.2f GiB for %lld tokens "
                 "a step\n",
                 device_name_.c_str(), weights_arena_.bytes() / double(1 << 30),
                 activations_.bytes() / double(1 << 30),
                 static_cast<long long>(options.max_batch_tokens));
  }
  // Profiling aid (the GPU machine has no timeline profiler): QUANTMLA_ABLATE=op,op,... leaves
  // those operations of every layer out of the step, so that the step's time without them is
  // their cost inside the captured graph, programmatic launches included. The outputs are then
  // wrong; the runner says so at load. Ops: input_norm q_kv_a write rope_queries uk decode uv
  // o_proj post_norm router route_sort shared experts combine mlp, and prefill_attention (the
  // expanded form's gather and attention kernels).
  void read_ablation() {
    static const std::set<std::string> known = {
        "input_norm", "q_kv_a",  "write",     "rope_queries",     "uk",         "decode",
        "uv",         "o_proj",  "post_norm", "router",           "route_sort", "shared",
        "experts",    "combine", "mlp",       "prefill_attention"};
    const char* env = std::getenv("QUANTMLA_ABLATE");
    if (env == nullptr || *env == 0) return;
    std::string list = env;
    for (size_t start = 0; start <= list.size();) {
      const size_t comma = std::min(list.find(',', start), list.size());
      const std::string op = list.substr(start, comma - start);
      if (!known.count(op)) {
        throw InvalidArgument("QUANTMLA_ABLATE: unknown operation '" + op + "'");
      }
      ablated_.insert(op);
      start = comma + 1;
    }
    std::fprintf(stderr,
                 "cuda runner: QUANTMLA_ABLATE=%s: those operations are left out, the "
                 "outputs are wrong (profiling only)\n",
                 env);
  }
  bool runs(const char* op) const { return ablated_.empty() || ablated_.count(op) == 0; }

  ~CudaRunner() override {
    clear_graphs();
    for (PlanWorkspace& w : plan_workspaces_) cudaFree(w.device);
    if (offsets_copied_ != nullptr) cudaEventDestroy(offsets_copied_);
    if (kernels_start_ != nullptr) cudaEventDestroy(kernels_start_);
    if (kernels_end_ != nullptr) cudaEventDestroy(kernels_end_);
    if (host_offsets_ != nullptr) cudaFreeHost(host_offsets_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return config_; }
  std::string device() const override { return device_name_; }
  StepStats last_step_stats() const override { return stats_; }
  DeviceMemory device_memory() const override {
    size_t free_bytes = 0, total_bytes = 0;
    QUANTMLA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return {static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
  }

  std::unique_ptr<PagePool> make_pool(const CacheFormat& format, int64_t num_pages) override {
    gpu::check_gpu_format(format);
    const CacheShape shape{config_.num_layers, config_.kv_lora_rank, config_.qk_rope_head_dim};
    const int64_t layer_bytes = std::max<int64_t>(num_pages, 1) * kPageTokens *
                                format.record_bytes(shape.kv_lora_rank, shape.rope_dim);
    auto pool =
        std::make_unique<PagePool>(shape, format, num_pages,
                                   std::make_unique<DevicePageStorage>(
                                       shape.num_layers, layer_bytes, options_.swap_staging_bytes));
    std::fprintf(stderr, "cuda runner: cache pool of %lld pages (%lld tokens) in %s, %.3f GiB\n",
                 static_cast<long long>(num_pages), static_cast<long long>(num_pages * kPageTokens),
                 format.to_string().c_str(),
                 static_cast<double>(shape.num_layers * layer_bytes) / double(1 << 30));
    return pool;
  }

  void step(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) override {
    if (pool.memory() != PoolMemory::kDevice) {
      throw InvalidArgument("step: the CUDA runner needs a pool made by make_pool (device memory)");
    }
    check_step(batch, pool, config_, outputs);
    const int64_t n = batch.num_tokens();
    if (n > options_.max_batch_tokens ||
        static_cast<int64_t>(batch.chunks.size()) > options_.max_sequences) {
      throw InvalidArgument(
          "step: " + std::to_string(n) + " tokens of " + std::to_string(batch.chunks.size()) +
          " sequences, the runner was sized for " + std::to_string(options_.max_batch_tokens) +
          " tokens and " + std::to_string(options_.max_sequences) + " sequences");
    }
    const auto called = std::chrono::steady_clock::now();
    stats_ = {};
    want_logits_ = !outputs.logits.empty();
    want_tokens_ = !outputs.tokens.empty();
    const bool decode_only = n == static_cast<int64_t>(batch.chunks.size());
    const bool graph = decode_only && n <= options_.max_graph_tokens && moe_grouped(n);
    prepare(batch, pool, graph);
    QUANTMLA_CUDA_CHECK(cudaEventRecord(kernels_start_, stream_));
    if (graph) {
      run_graph(pool);
    } else {
      forward(pool);
    }
    QUANTMLA_CUDA_CHECK(cudaEventRecord(kernels_end_, stream_));
    const double queued_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - called)
            .count();
    finish(batch, pool, outputs);
    float kernels_ms = 0;
    QUANTMLA_CUDA_CHECK(cudaEventElapsedTime(&kernels_ms, kernels_start_, kernels_end_));
    stats_.host_queue_ms = queued_ms;
    stats_.device_ms = kernels_ms;
  }

 private:
  // Chunks of equal length share one attention call (s_q = that length), so the step's tokens are
  // laid out group by group; logits come back in the caller's chunk order.
  struct Group {
    int64_t first_chunk;  // in the grouped order
    int64_t num_chunks;
    int64_t first_token;
    int64_t s_q;
    bool expanded;  // attention through prefill_attention, not the decode kernel
    std::unique_ptr<gpu::MlaDecodePlan> plan;
  };

  // Device memory of one group's decode plan, kept across steps and grown to the largest need
  // seen (rounded up to a power of two), so that steady-state steps allocate nothing.
  struct PlanWorkspace {
    void* device = nullptr;
    size_t bytes = 0;
  };

  // A captured decode step: its kernels bake in the batch size, the block-table width and the
  // pool's page addresses, so those are its key.
  struct GraphKey {
    int64_t tokens;
    int64_t logit_rows;
    int64_t block_stride;
    const uint8_t* pages;
    int64_t layer_stride;
    std::string format;
    bool logits, sampled;
    bool long_context;  // gpu::decode_long_context of the lengths: the plan's kernel depends on it
    auto operator<=>(const GraphKey&) const = default;
  };
  struct CapturedStep {
    cudaGraphExec_t exec = nullptr;
    int runs = 0;     // uncaptured runs so far (the first warms the plan and kernel caches)
    StepStats stats;  // the dense GEMMs' counts (the routed experts' come from the device)
  };
  // Enough for every decode batch size up to max_graph_tokens' default (256) at two block-table
  // widths: a serving run meets most batch sizes below its peak, and a full map is cleared whole,
  // so with 64 the formats that run the largest batches recaptured their graphs over and over
  // (workload P on INT2/INT4: 85 batch sizes, bench-serve --schedule-only --step-log). A graph
  // holds its kernels' parameters only (the activations live in the runner's buffers).
  static constexpr size_t kMaxGraphs = 512;

  void size_activations() {
    DeviceArena& a = activations_;
    const ModelConfig& c = config_;
    const int64_t t = options_.max_batch_tokens;
    const int64_t heads = c.num_heads, hp = gpu::padded_heads(static_cast<int>(heads));
    const int64_t k = std::max<int64_t>(c.num_experts_per_tok, 1);
    const int64_t inner =
        std::max({c.intermediate_size, c.n_shared_experts * c.moe_intermediate_size});
    buf_.ids = a.take<int32_t>(t);
    buf_.positions = a.take<int32_t>(t);
    buf_.seq_ids = a.take<int32_t>(t);
    buf_.x = a.take<float>(t * c.hidden_size);
    buf_.h = a.take<uint16_t>(t * c.hidden_size);
    if (options_.prefill_expanded_max_context > 0) {
      const int64_t context = options_.prefill_expanded_max_context;
      buf_.gathered = a.take<uint16_t>(context * gpu::kKeyDim);
      prefill_workspace_.max_context = context;
      prefill_workspace_.bytes = gpu::PrefillAttentionWorkspace::bytes_for(
          static_cast<int>(heads), static_cast<int>(c.qk_nope_head_dim),
          static_cast<int>(c.v_head_dim), context);
      prefill_workspace_.device = a.take<uint8_t>(static_cast<int64_t>(prefill_workspace_.bytes));
    }
    const int64_t q_width = heads * c.qk_head_dim();
    buf_.proj =
        a.take<float>(t * ((c.q_lora_rank > 0 ? c.q_lora_rank : q_width) + c.cache_row_width()));
    if (c.q_lora_rank > 0) {
      buf_.q_low_bf16 = a.take<uint16_t>(t * c.q_lora_rank);
      buf_.q = a.take<float>(t * q_width);
    }
    buf_.q_bf16 = a.take<uint16_t>(t * q_width);
    buf_.q_dec = a.take<uint16_t>(t * hp * gpu::kKeyDim);
    buf_.attn = a.take<uint16_t>(t * hp * gpu::kLatentDim);
    buf_.head_out = a.take<uint16_t>(t * heads * c.v_head_dim);
    buf_.gate_up = a.take<float>(t * 2 * inner);
    buf_.act = a.take<uint16_t>(t * inner);
    buf_.block_table = a.take<int32_t>(options_.max_sequences * max_pages_per_sequence());
    buf_.seq_lens = a.take<int32_t>(options_.max_sequences);
    buf_.logit_rows = a.take<int32_t>(t);
    buf_.final_rows = a.take<float>(t * c.hidden_size);
    buf_.logits = a.take<float>(t * c.vocab_size);
    buf_.sample_params = a.take<gpu::SampleParams>(t);
    buf_.sampled = a.take<int32_t>(t);
    if (c.n_routed_experts > 0) {
      const int64_t e = c.n_routed_experts, slots = t * k;
      // The shared experts' rows ahead of the routed ones (steps of few tokens).
      const int64_t shared_rows = c.n_shared_experts * std::min(t, kMixedExpertsMaxRows);
      buf_.router_logits = a.take<float>(t * e);
      buf_.experts = a.take<int32_t>(slots);
      buf_.expert_weights = a.take<float>(slots);
      buf_.layer_expert_counts = a.take<int32_t>(c.num_layers * e);
      buf_.sort.offsets = a.take<int32_t>(c.n_shared_experts + e + 1);
      buf_.sort.slot_of = a.take<int32_t>(slots);
      buf_.sort.token_of_slot = a.take<int32_t>(shared_rows + slots);
      buf_.sort.workspace = a.take<uint8_t>(static_cast<int64_t>(
          gpu::moe_sort_workspace_bytes(t, static_cast<int>(k), static_cast<int>(e))));
      buf_.combine_counters = a.take<int32_t>(combine_counter_count());
      // Room for the padded layout of the batched experts (each expert's rows padded to the
      // busiest expert's count) while the imbalance stays under 1.5x, and for the shared
      // experts' rows.
      expert_rows_ = slots + std::max(slots / 2, shared_rows);
      buf_.padded_slot_of = a.take<int32_t>(slots);
      buf_.token_of_row = a.take<int32_t>(expert_rows_);
      buf_.sorted = a.take<uint16_t>(expert_rows_ * c.hidden_size);
      buf_.expert_gate_up = a.take<float>(expert_rows_ * 2 * c.moe_intermediate_size);
      buf_.expert_act = a.take<uint16_t>(expert_rows_ * c.moe_intermediate_size);
      buf_.expert_out = a.take<float>(expert_rows_ * c.hidden_size);
    }
  }

  // The combining tail's counters: one per column tile of the down product (tile_n >= 8).
  int64_t combine_counter_count() const { return (config_.hidden_size + 7) / 8; }

  int64_t max_pages_per_sequence() const {
    return PagePool::pages_for_tokens(config_.max_position_embeddings);
  }

  // The routed experts run as two grouped skinny products (no host synchronization, so the step
  // can be captured) when they average few rows each; otherwise as one cuBLASLt GEMM per expert
  // after the expert offsets are copied to the host.
  bool moe_grouped(int64_t tokens) const {
    const ModelConfig& c = config_;
    if (c.n_routed_experts == 0) return true;
    return !options_.batch_invariant &&
           tokens * c.num_experts_per_tok <= kGroupedRowsPerExpert * c.n_routed_experts &&
           skinny_shape(c.hidden_size, c.hidden_size) &&
           skinny_shape(c.moe_intermediate_size, c.moe_intermediate_size);
  }

  gpu::MlaDecodeWorkspace plan_workspace(size_t group, size_t bytes) {
    if (plan_workspaces_.size() <= group) plan_workspaces_.resize(group + 1);
    PlanWorkspace& w = plan_workspaces_[group];
    if (w.bytes < bytes) {
      size_t grown = 4096;
      while (grown < bytes) grown *= 2;
      // The old plan may still be read by queued kernels.
      QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(stream_));
      QUANTMLA_CUDA_CHECK(cudaFree(w.device));
      w.device = nullptr;
      w.bytes = 0;
      if (group == 0) clear_graphs();  // they read the old address
      if (cudaMalloc(&w.device, grown) != cudaSuccess) {
        (void)cudaGetLastError();  // an allocation failure is not sticky: later steps may run
        w.device = nullptr;
        throw CapacityError("step: the decode plan's workspace needs " + std::to_string(grown) +
                            " bytes of device memory and they are not free (a batch-invariant "
                            "runner's prefill chunks need more at long contexts: a smaller "
                            "--max-batched-tokens bounds them)");
      }
      w.bytes = grown;
    }
    return {w.device, w.bytes};
  }

  // Lays out the step on the host and uploads it: token order by group, positions, block table
  // (its width rounded up to a power of two so that captured steps are reused as sequences grow),
  // decode plans, and the rows that need logits with their sampling parameters.
  void prepare(const StepBatch& batch, PagePool& pool, bool fixed_grid) {
    const int64_t chunks = static_cast<int64_t>(batch.chunks.size());
    order_.resize(sz(chunks));
    for (int64_t i = 0; i < chunks; ++i) order_[sz(i)] = i;
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) {
      return batch.chunks[a].tokens.size() < batch.chunks[b].tokens.size();
    });
    int64_t pages = 1;
    for (const SequenceChunk& chunk : batch.chunks) {
      pages = std::max<int64_t>(pages, pool.block_table(chunk.sequence).size());
    }
    if (pages > max_pages_per_sequence()) {
      throw InvalidArgument("step: a sequence holds " + std::to_string(pages) +
                            " pages, more than max_position_embeddings allows");
    }
    int64_t stride = 16;
    while (stride < pages) stride *= 2;
    block_stride_ = std::min(stride, max_pages_per_sequence());
    host_ids_.clear();
    host_positions_.clear();
    host_seq_ids_.clear();
    host_seq_lens_.assign(sz(chunks), 0);
    host_block_table_.assign(sz(chunks * block_stride_), 0);
    chunk_first_token_.assign(sz(chunks), 0);
    groups_.clear();
    for (int64_t g = 0; g < chunks; ++g) {
      const SequenceChunk& chunk = batch.chunks[order_[sz(g)]];
      const int64_t s_q = static_cast<int64_t>(chunk.tokens.size());
      const int64_t pos0 = pool.length(chunk.sequence);
      if (groups_.empty() || groups_.back().s_q != s_q) {
        groups_.push_back({g, 0, static_cast<int64_t>(host_ids_.size()), s_q,
                           s_q >= kExpandedMinChunk && options_.prefill_expanded_max_context > 0,
                           nullptr});
      }
      ++groups_.back().num_chunks;
      chunk_first_token_[sz(order_[sz(g)])] = static_cast<int64_t>(host_ids_.size());
      for (int64_t i = 0; i < s_q; ++i) {
        host_ids_.push_back(chunk.tokens[sz(i)]);
        host_positions_.push_back(static_cast<int32_t>(pos0 + i));
        host_seq_ids_.push_back(static_cast<int32_t>(g));
      }
      host_seq_lens_[sz(g)] = static_cast<int32_t>(pos0 + s_q);
      if (pos0 + s_q > options_.prefill_expanded_max_context) groups_.back().expanded = false;
      const std::vector<int32_t>& table = pool.block_table(chunk.sequence);
      std::copy(table.begin(), table.end(), host_block_table_.begin() + g * block_stride_);
    }
    any_absorbed_ = std::any_of(groups_.begin(), groups_.end(),
                                [](const Group& group) { return !group.expanded; });
    const int hp = gpu::padded_heads(config_.num_heads);
    for (size_t i = 0; i < groups_.size(); ++i) {
      Group& group = groups_[i];
      if (group.expanded) continue;
      const std::vector<int32_t> lens(
          host_seq_lens_.begin() + group.first_chunk,
          host_seq_lens_.begin() + group.first_chunk + group.num_chunks);
      const int s_q = static_cast<int>(group.s_q);
      // A fixed grid is sized for the most sequences a step may hold, so it never grows.
      const gpu::DecodeSplit split = options_.batch_invariant ? gpu::DecodeSplit::kBatchInvariant
                                                              : gpu::DecodeSplit::kFillDevice;
      const size_t bytes =
          fixed_grid ? gpu::MlaDecodePlan::workspace_bytes(
                           pool.format(), static_cast<int>(options_.max_sequences), s_q, hp)
                     : gpu::MlaDecodePlan::workspace_bytes(pool.format(), lens, s_q, hp, split);
      group.plan = std::make_unique<gpu::MlaDecodePlan>(
          pool.format(), lens, s_q, hp, plan_workspace(i, bytes), fixed_grid, stream_, split);
    }
    host_rows_.clear();
    host_sample_params_.clear();
    for (size_t i = 0; i < batch.chunks.size(); ++i) {
      const SequenceChunk& chunk = batch.chunks[i];
      const int64_t first = chunk_first_token_[i];
      const int64_t count = static_cast<int64_t>(chunk.tokens.size());
      const int64_t pos0 = pool.length(chunk.sequence);
      const auto add = [&](int64_t t) {
        host_rows_.push_back(static_cast<int32_t>(first + t));
        host_sample_params_.push_back({chunk.sampling.temperature, chunk.sampling.top_p,
                                       chunk.sampling.seed, static_cast<uint64_t>(pos0 + t + 1)});
      };
      if (chunk.logits == LogitRows::kAll) {
        for (int64_t t = 0; t < count; ++t) add(t);
      } else if (chunk.logits == LogitRows::kLast) {
        add(count - 1);
      }
    }
    const auto upload = [&](auto* device, const auto& host) {
      if (host.empty()) return;
      QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(host[0]),
                                          cudaMemcpyHostToDevice, stream_));
    };
    upload(buf_.ids, host_ids_);
    upload(buf_.positions, host_positions_);
    upload(buf_.seq_ids, host_seq_ids_);
    upload(buf_.seq_lens, host_seq_lens_);
    upload(buf_.block_table, host_block_table_);
    upload(buf_.logit_rows, host_rows_);
    if (want_tokens_) upload(buf_.sample_params, host_sample_params_);
    n_ = static_cast<int64_t>(host_ids_.size());
  }

  // The step's kernels, from the embedding to the sampled tokens, all on stream_ (captured as a
  // graph for decode steps): nothing here synchronizes or copies from the host.
  void forward(PagePool& pool) {
    gpu::embed(buf_.ids, model_.embed, buf_.x, n_, config_.hidden_size, config_.vocab_size,
               stream_);
    for (int64_t l = 0; l < config_.num_layers; ++l) run_layer(l, pool);
    const ModelConfig& c = config_;
    const int64_t d = c.hidden_size, vocab = c.vocab_size;
    const int64_t r = static_cast<int64_t>(host_rows_.size());
    if (r == 0 || (!want_logits_ && !want_tokens_)) return;
    gpu::gather_rows(buf_.x, d, n_, buf_.logit_rows, r, buf_.final_rows, d, DType::kF32, d,
                     stream_);
    gpu::rms_norm(buf_.final_rows, d, model_.final_norm, buf_.h, d, DType::kBF16, r, d,
                  static_cast<float>(c.rms_norm_eps), stream_);
    gemm(r, vocab, d, buf_.h, d, model_.lm_head.w, buf_.logits, vocab, DType::kF32, 0.0f);
    if (want_tokens_) {
      gpu::sample_tokens(buf_.logits, vocab, r, vocab, buf_.sample_params, buf_.sampled, stream_);
    }
  }

  // A decode step through its captured graph: run uncaptured the first time a key is seen
  // (plans, cuBLASLt's heuristics and kernel attributes are set up outside any capture), captured
  // and replayed the second time, replayed after.
  void run_graph(PagePool& pool) {
    const GraphKey key{
        n_,
        static_cast<int64_t>(host_rows_.size()),
        block_stride_,
        pool.storage().layer_pages(0),
        config_.num_layers > 1 ? pool.storage().layer_pages(1) - pool.storage().layer_pages(0) : 0,
        pool.format().to_string(),
        want_logits_,
        want_tokens_,
        gpu::decode_long_context(host_seq_lens_)};
    if (graphs_.size() >= kMaxGraphs && graphs_.find(key) == graphs_.end()) clear_graphs();
    CapturedStep& captured = graphs_[key];
    if (captured.exec == nullptr && captured.runs++ == 0) {
      forward(pool);
      return;
    }
    if (captured.exec == nullptr) {
      QUANTMLA_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      cudaGraph_t graph = nullptr;
      try {
        forward(pool);
      } catch (...) {
        cudaStreamEndCapture(stream_, &graph);
        if (graph != nullptr) cudaGraphDestroy(graph);
        graphs_.erase(key);
        throw;
      }
      QUANTMLA_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      const cudaError_t made = cudaGraphInstantiate(&captured.exec, graph, 0);
      cudaGraphDestroy(graph);
      QUANTMLA_CUDA_CHECK(made);
      captured.stats = stats_;
    }
    QUANTMLA_CUDA_CHECK(cudaGraphLaunch(captured.exec, stream_));
    stats_ = captured.stats;
    stats_.graph_replayed = true;
  }

  void clear_graphs() {
    for (auto& [key, captured] : graphs_) {
      if (captured.exec != nullptr) cudaGraphExecDestroy(captured.exec);
    }
    graphs_.clear();
  }

  void run_layer(int64_t l, PagePool& pool) {
    const ModelConfig& c = config_;
    const DeviceLayer& layer = model_.layers[sz(l)];
    const int64_t d = c.hidden_size, heads = c.num_heads, qk = c.qk_head_dim();
    const int64_t nope = c.qk_nope_head_dim, v_dim = c.v_head_dim, rank = c.kv_lora_rank;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const int64_t n = n_;
    const auto linear = [&](const DeviceLinear& w, const uint16_t* x, int64_t ldx, void* y,
                            int64_t ldy, DType out,
                            float beta) { gemm(n, w.out, w.in, x, ldx, w.w, y, ldy, out, beta); };

    // [q | kv] = h [W_q ; W_kv_a]^T in one product (with a q LoRA, q_a in place of q), h the
    // normalized x (normalized inside the product for a few tokens).
    const int64_t proj = layer.q_kv_a.out, width = c.cache_row_width();
    const bool fuse_input_norm = fuse_norm(d, d);
    if (runs("input_norm") && !fuse_input_norm) {
      gpu::rms_norm(buf_.x, d, layer.input_norm, buf_.h, d, DType::kBF16, n, d, eps, stream_);
    }
    if (runs("q_kv_a") && fuse_input_norm) {
      normed_gemm(layer.q_kv_a, buf_.x, d, layer.input_norm, buf_.proj, proj, nullptr);
    } else if (runs("q_kv_a")) {
      linear(layer.q_kv_a, buf_.h, d, buf_.proj, proj, DType::kF32, 0.0f);
    }
    const float* q = buf_.proj;
    int64_t ldq = proj;
    if (c.q_lora_rank > 0) {
      if (fuse_norm(c.q_lora_rank, proj)) {
        normed_gemm(layer.q_b, buf_.proj, proj, layer.q_a_norm, buf_.q, heads * qk, nullptr);
      } else {
        gpu::rms_norm(buf_.proj, proj, layer.q_a_norm, buf_.q_low_bf16, c.q_lora_rank, DType::kBF16,
                      n, c.q_lora_rank, eps, stream_);
        linear(layer.q_b, buf_.q_low_bf16, c.q_lora_rank, buf_.q, heads * qk, DType::kF32, 0.0f);
      }
      q = buf_.q;
      ldq = heads * qk;
    }
    // Cache rows: the write normalizes c = kv[:rank] (kv_a_layernorm), rotates k_pe = kv[rank:]
    // and encodes both.
    const float* kv = buf_.proj + (proj - width);
    uint8_t* pages = pool.storage().layer_pages(l);
    gpu::MlaWriteParams write;
    write.c = kv;
    write.c_stride = proj;
    write.k_pe = kv + rank;
    write.k_pe_stride = proj;
    write.norm_weight = layer.kv_a_norm;
    write.norm_eps = eps;
    write.inv_freq = model_.inv_freq;
    write.attention_factor = attention_factor_;
    write.seq_ids = buf_.seq_ids;
    write.positions = buf_.positions;
    write.pool = pages;
    write.block_table = buf_.block_table;
    write.block_table_stride = block_stride_;
    write.num_tokens = n;

    // The queries in BF16, RoPE applied; for the decode kernel's groups also its query's RoPE
    // columns (the absorption GEMM writes the content columns). One launch with the write.
    gpu::RopeQueriesParams rq;
    rq.q = q;
    rq.q_token_stride = ldq;
    rq.q_bf16 = buf_.q_bf16;
    rq.decode_q = any_absorbed_ ? buf_.q_dec : nullptr;
    rq.heads_padded = gpu::padded_heads(static_cast<int>(heads));
    rq.positions = buf_.positions;
    rq.inv_freq = model_.inv_freq;
    rq.attention_factor = attention_factor_;
    rq.tokens = n;
    rq.heads = static_cast<int>(heads);
    rq.nope = static_cast<int>(nope);
    rq.rope = static_cast<int>(c.qk_rope_head_dim);
    if (options_.fused_decode && n <= kFusedWriteMaxRows && runs("write") && runs("rope_queries")) {
      gpu::write_cache_and_queries(pool.format(), write, rq, stream_);
    } else {
      if (runs("write")) gpu::mla_write(pool.format(), write, stream_);
      if (runs("rope_queries")) gpu::rope_queries(rq, stream_);
    }

    for (const Group& group : groups_) {
      if (group.expanded) {
        if (runs("prefill_attention")) expanded_attention(layer, group, pages, pool.format());
      } else {
        absorbed_attention(layer, group, pages, pool.format());
      }
    }
    if (runs("o_proj")) linear(layer.o, buf_.head_out, heads * v_dim, buf_.x, d, DType::kF32, 1.0f);

    // h = the normalized x, made by the first product that reads it for a few tokens (the
    // router, which writes h for the experts, or the dense MLP's gate and up when they run as one
    // skinny product).
    const bool mlp_skinny = layer.is_moe || mlp_runs_skinny(layer.mlp.gate.out);
    const float* post_norm = fuse_norm(d, d) && mlp_skinny ? layer.post_norm : nullptr;
    if (runs("post_norm") && post_norm == nullptr) {
      gpu::rms_norm(buf_.x, d, layer.post_norm, buf_.h, d, DType::kBF16, n, d, eps, stream_);
    }
    if (layer.is_moe) {
      run_moe(l, layer, post_norm);
    } else if (runs("mlp")) {
      run_mlp(layer.mlp, post_norm);
    }
  }

  // Whether an MLP of this inner width runs its gate and up as one skinny product this step.
  bool mlp_runs_skinny(int64_t inner) const {
    const int64_t d = config_.hidden_size;
    return !options_.batch_invariant && n_ <= kSkinnyMaxRows && skinny_shape(d, d) &&
           skinny_shape(inner, inner);
  }

  // Whether this step normalizes an FP32 input of width k (row stride ldx) inside the product
  // that reads it (SkinnyGemmParams::x_f32).
  bool fuse_norm(int64_t k, int64_t ldx) const {
    return options_.fused_decode && n_ <= kFusedNormMaxRows && skinny_shape(k, ldx) &&
           gpu::skinny_norm_fits(n_, k);
  }

  // y = rms_norm(x) W^T by the skinny kernel's normalizing prologue (fuse_norm's steps);
  // normed_out: the normalized rows also written there (BF16, row stride w.in) for later kernels.
  void normed_gemm(const DeviceLinear& w, const float* x, int64_t ldx, const float* norm, float* y,
                   int64_t ldy, uint16_t* normed_out) {
    gpu::SkinnyGemmParams p;
    p.x_f32 = x;
    p.ldx = ldx;
    p.x_rows = n_;
    p.max_rows = n_;
    p.norm_weight = norm;
    p.norm_eps = static_cast<float>(config_.rms_norm_eps);
    p.normed_out = normed_out;
    p.ld_normed = w.in;
    p.weight = w.w;
    p.n = w.out;
    p.k = w.in;
    p.y = y;
    p.ldy = ldy;
    gpu::skinny_gemm(p, stream_);
    count(w.out * w.in, n_ * w.out * w.in);
  }

  // The decode kernel over the pool, in the absorbed form: q_dec[t, h] = [bf16(q_nope_h W_UK_h) ;
  // bf16(q_pe_h)] (padding heads 0), the attended latents, then o_h = W_UV_h attended_h.
  void absorbed_attention(const DeviceLayer& layer, const Group& group, const uint8_t* pages,
                          const CacheFormat& format) {
    const ModelConfig& c = config_;
    const int64_t heads = c.num_heads, qk = c.qk_head_dim();
    const int64_t nope = c.qk_nope_head_dim, v_dim = c.v_head_dim, rank = c.kv_lora_rank;
    const int hp = gpu::padded_heads(static_cast<int>(heads));
    const int64_t first = group.first_token, tokens = group.num_chunks * group.s_q;
    const uint16_t* q_nope = buf_.q_bf16 + first * heads * qk;
    uint16_t* q_dec = buf_.q_dec + first * hp * gpu::kKeyDim;
    uint16_t* attended = buf_.attn + first * hp * gpu::kLatentDim;
    uint16_t* head_out = buf_.head_out + first * heads * v_dim;
    // One token: each absorbed product as a grouped skinny product, a group (one row) per head,
    // which takes part in the programmatic launches (its weights requested before the wait);
    // more tokens: a cuBLASLt product batched over the heads.
    const bool skinny = tokens == 1 && !options_.batch_invariant;
    const auto per_head = [&](const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t n,
                              int64_t k, uint16_t* y, int64_t ldy) {
      gpu::SkinnyGemmParams p;
      p.x = x;
      p.ldx = ldx;
      p.x_rows = heads;
      p.offsets = model_.head_offsets;
      p.groups = static_cast<int>(heads);
      p.max_rows = heads;
      p.w = w;
      p.n = n;
      p.k = k;
      p.y = y;
      p.ldy = ldy;
      p.out_dtype = DType::kBF16;
      p.routing_ready = true;  // offsets and pointers are the model's constants
      gpu::skinny_gemm(p, stream_);
    };
    // kv_b per head: W_UK_h [nope, rank] rows, then W_UV_h [v, rank].
    const auto over_heads = [&](const uint16_t* x, int64_t ldx, int64_t stride_x, const uint16_t* w,
                                gpu::GemmOp op_w, int64_t n, int64_t k, uint16_t* y, int64_t ldy,
                                int64_t stride_y) {
      gpu::BatchedGemmParams p;
      p.batch = heads;
      p.m = tokens;
      p.n = n;
      p.k = k;
      p.x = x;
      p.ldx = ldx;
      p.stride_x = stride_x;
      p.w = w;
      p.ldw = rank;
      p.stride_w = (nope + v_dim) * rank;
      p.op_w = op_w;
      p.y = y;
      p.ldy = ldy;
      p.stride_y = stride_y;
      p.out_dtype = DType::kBF16;
      gemm_->batched(p, stream_);
    };

    // q_dec content columns = q_nope_h W_UK_h.
    if (skinny && runs("uk")) {
      per_head(q_nope, qk, layer.head_uk_t, rank, nope, q_dec, gpu::kKeyDim);
    } else if (runs("uk")) {
      over_heads(q_nope, heads * qk, qk, layer.kv_b.w, gpu::GemmOp::kN, rank, nope, q_dec,
                 hp * gpu::kKeyDim, gpu::kKeyDim);
    }
    count(heads * nope * rank, tokens * heads * nope * rank);

    gpu::MlaDecodeParams p;
    p.q = q_dec;
    p.pool = pages;
    p.block_table = buf_.block_table + group.first_chunk * block_stride_;
    p.block_table_stride = block_stride_;
    p.seq_lens = buf_.seq_lens + group.first_chunk;
    p.out = attended;
    p.batch = static_cast<int>(group.num_chunks);
    p.s_q = static_cast<int>(group.s_q);
    p.num_heads = hp;
    p.softmax_scale = static_cast<float>(c.softmax_scale());
    // The cache write, the block tables, the lengths and the plans all come before W_UK's
    // product, the kernel the decode follows, which writes only q_dec: the decode may request its
    // pages while that product runs (not where an ablation leaves the product out).
    p.pool_ready = runs("uk");
    if (runs("decode")) gpu::mla_decode(format, p, *group.plan, stream_);

    // o_h = W_UV_h attended_h.
    if (skinny && runs("uv")) {
      per_head(attended, gpu::kLatentDim, layer.head_uv, v_dim, rank, head_out, v_dim);
    } else if (runs("uv")) {
      over_heads(attended, hp * gpu::kLatentDim, gpu::kLatentDim, layer.kv_b.w + nope * rank,
                 gpu::GemmOp::kT, v_dim, rank, head_out, heads * v_dim, v_dim);
    }
    count(heads * v_dim * rank, tokens * heads * v_dim * rank);
  }

  // Long prefill chunks: each sequence's cache rows dequantized back to BF16, up-projected to
  // per-head keys and values, attended to by its chunk (prefill_attention.h).
  void expanded_attention(const DeviceLayer& layer, const Group& group, const uint8_t* pages,
                          const CacheFormat& format) {
    const ModelConfig& c = config_;
    const int64_t heads = c.num_heads, qk = c.qk_head_dim(), v_dim = c.v_head_dim;
    const int64_t kv = c.qk_nope_head_dim + v_dim;
    for (int64_t i = 0; i < group.num_chunks; ++i) {
      const int64_t chunk = group.first_chunk + i;
      const int64_t context = host_seq_lens_[sz(chunk)];
      const int64_t first = group.first_token + i * group.s_q;
      gpu::MlaGatherParams gather;
      gather.pool = pages;
      gather.block_table = buf_.block_table + chunk * block_stride_;
      gather.num_tokens = context;
      gather.out = buf_.gathered;
      gpu::mla_gather(format, gather, stream_);
      gpu::PrefillAttentionParams p;
      p.q = buf_.q_bf16 + first * heads * qk;
      p.keys = buf_.gathered;
      p.keys_stride = gpu::kKeyDim;
      p.kv_b = layer.kv_b.w;
      p.out = buf_.head_out + first * heads * v_dim;
      p.out_stride = heads * v_dim;
      p.tokens = group.s_q;
      p.context = context;
      p.heads = static_cast<int>(heads);
      p.nope = static_cast<int>(c.qk_nope_head_dim);
      p.rope = static_cast<int>(c.qk_rope_head_dim);
      p.v = static_cast<int>(v_dim);
      p.rank = static_cast<int>(c.kv_lora_rank);
      p.softmax_scale = static_cast<float>(c.softmax_scale());
      gpu::prefill_attention(*gemm_, p, prefill_workspace_, stream_);
      count(heads * kv * c.kv_lora_rank, context * heads * kv * c.kv_lora_rank);
    }
  }

  // y[m, out] = x W^T (+ beta y): the skinny kernel for decode-sized steps (the weight read is
  // the time), cuBLASLt otherwise; counted for last_step_stats.
  void gemm(int64_t m, int64_t out, int64_t in, const uint16_t* x, int64_t ldx, const uint16_t* w,
            void* y, int64_t ldy, DType out_dtype, float beta) {
    if (m <= kSkinnyMaxRows && skinny_shape(in, ldx) && !options_.batch_invariant) {
      gpu::SkinnyGemmParams p;
      p.x = x;
      p.ldx = ldx;
      p.x_rows = m;
      p.max_rows = m;
      p.weight = w;
      p.n = out;
      p.k = in;
      p.y = y;
      p.ldy = ldy;
      p.out_dtype = out_dtype;
      p.beta = beta;
      gpu::skinny_gemm(p, stream_);
    } else {
      gemm_->linear(m, out, in, x, ldx, w, in, y, ldy, out_dtype, beta, stream_);
    }
    count(out * in, m * out * in);
  }
  void count(int64_t weights, int64_t multiply_adds) {
    stats_.weight_bytes_read += 2 * weights;
    stats_.gemm_flops += 2 * multiply_adds;
  }

  // x += down(silu(gate h) * up h); norm set (fuse_norm's steps, whose shapes take the skinny
  // product): h = rms_norm(x) with that weight inside the gate and up product.
  void run_mlp(const DeviceMlp& mlp, const float* norm = nullptr) {
    const int64_t d = config_.hidden_size, inner = mlp.gate.out, n = n_;
    if (mlp_runs_skinny(inner)) {
      gpu::SkinnyGemmParams p;
      if (norm != nullptr) {
        p.x_f32 = buf_.x;
        p.norm_weight = norm;
        p.norm_eps = static_cast<float>(config_.rms_norm_eps);
      } else {
        p.x = buf_.h;
      }
      p.ldx = d;
      p.x_rows = n;
      p.max_rows = n;
      p.weight = mlp.gate.w;
      p.weight2 = mlp.up.w;
      p.n = inner;
      p.k = d;
      p.y = buf_.act;
      p.ldy = inner;
      p.out_dtype = DType::kBF16;
      p.epilogue = gpu::SkinnyEpilogue::kSiluMul;
      gpu::skinny_gemm(p, stream_);
      count(2 * inner * d, 2 * n * inner * d);
    } else {
      if (mlp.up.w == mlp.gate.w + inner * d) {
        // Uploaded one after the other: one product over the stacked [2 inner, d] (fuller waves
        // than two products of half the columns).
        gemm(n, 2 * inner, d, buf_.h, d, mlp.gate.w, buf_.gate_up, 2 * inner, DType::kF32, 0.0f);
      } else {
        gemm(n, inner, d, buf_.h, d, mlp.gate.w, buf_.gate_up, 2 * inner, DType::kF32, 0.0f);
        gemm(n, inner, d, buf_.h, d, mlp.up.w, buf_.gate_up + inner, 2 * inner, DType::kF32, 0.0f);
      }
      gpu::silu_mul(buf_.gate_up, 2 * inner, buf_.act, inner, n, inner, stream_);
    }
    gemm(n, d, inner, buf_.act, inner, mlp.down.w, buf_.x, d, DType::kF32, 1.0f);
  }

  // The routed experts. Their weight reads and FLOPs are counted in finish from the per-layer
  // expert counts, which the sort writes into that layer's row. post_norm set (fuse_norm's
  // steps): h = rms_norm(x) is made by the router's product, which also writes it for the
  // experts. Steps of at most kMixedExpertsMaxRows tokens run the shared experts as the first
  // groups of the routed experts' grouped products and combine in the down product's tail.
  void run_moe(int64_t l, const DeviceLayer& layer, const float* post_norm) {
    const ModelConfig& c = config_;
    const int64_t d = c.hidden_size, e = c.n_routed_experts, n = n_;
    const int64_t inner = c.moe_intermediate_size;
    const int k = static_cast<int>(c.num_experts_per_tok);
    if (runs("router") && post_norm != nullptr) {
      normed_gemm(layer.router, buf_.x, d, post_norm, buf_.router_logits, e, buf_.h);
    } else if (runs("router")) {
      gemm(n, e, d, buf_.h, d, layer.router.w, buf_.router_logits, e, DType::kF32, 0.0f);
    }
    const bool grouped = moe_grouped(n);
    const bool few = options_.fused_decode && grouped && n <= kMixedExpertsMaxRows;
    // Shared experts as groups of the routed products (their slices of inner each).
    const int shared =
        few && layer.has_shared && runs("shared") ? static_cast<int>(c.n_shared_experts) : 0;
    gpu::MoeSortBuffers sort = buf_.sort;
    sort.counts = buf_.layer_expert_counts + l * e;  // this layer's row, read back in finish
    sort.shared_groups = shared;
    if (runs("route_sort")) {
      gpu::moe_route_sort(buf_.router_logits, e, layer.correction_bias, buf_.experts,
                          buf_.expert_weights, n, route_, sort, stream_);
    }
    if (!grouped) {
      // The host sizes the routed products from the expert offsets: their copy is queued before
      // the shared experts and waited for on its own, so the GPU runs the shared experts while
      // the host reads the offsets and queues the routed products.
      QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(host_offsets_, buf_.sort.offsets, (e + 1) * 4,
                                          cudaMemcpyDeviceToHost, stream_));
      QUANTMLA_CUDA_CHECK(cudaEventRecord(offsets_copied_, stream_));
    }
    // Otherwise the shared experts between the sort and the routed ones: the routed products
    // then find their routing settled and request their weights before the previous kernel ends
    // (SkinnyGemmParams::routing_ready).
    const bool separate_shared = layer.has_shared && !few && runs("shared");
    if (separate_shared) run_mlp(layer.shared);
    if (shared > 0) {
      count(3 * shared * inner * d, 3 * n * shared * inner * d);
    }
    bool tail = few && runs("combine");
    // What the combine reads: the routed experts' outputs in buf_.expert_out (FP32, or BF16 bits
    // where expert_out_bf16) and each token's slots among them.
    const int32_t* slot_of = buf_.sort.slot_of;
    bool expert_out_bf16 = false;
    if (grouped && runs("experts")) {
      const int groups = shared + static_cast<int>(e);
      const int64_t rows = n * k + shared * n;
      gpu::SkinnyGemmParams gate_up;
      gate_up.x = buf_.h;
      gate_up.ldx = d;
      gate_up.x_rows = n;
      gate_up.row_index = buf_.sort.token_of_slot;
      gate_up.offsets = buf_.sort.offsets;
      gate_up.groups = groups;
      gate_up.max_rows = rows;
      gate_up.w = shared > 0 ? layer.mixed_gate : layer.device_gate;
      gate_up.w2 = shared > 0 ? layer.mixed_up : layer.device_up;
      gate_up.n = inner;
      gate_up.k = d;
      gate_up.y = buf_.expert_act;
      gate_up.ldy = inner;
      gate_up.out_dtype = DType::kBF16;
      gate_up.epilogue = gpu::SkinnyEpilogue::kSiluMul;
      gate_up.routing_ready = separate_shared;
      gate_up.static_groups = shared;
      gate_up.static_rows = n;
      gpu::skinny_gemm(gate_up, stream_);
      gpu::SkinnyGemmParams down;
      down.x = buf_.expert_act;
      down.ldx = inner;
      down.x_rows = rows;
      down.offsets = buf_.sort.offsets;
      down.groups = groups;
      down.max_rows = rows;
      down.w = shared > 0 ? layer.mixed_down : layer.device_down;
      down.n = d;
      down.k = inner;
      down.y = buf_.expert_out;
      down.ldy = d;
      down.out_dtype = DType::kF32;
      down.routing_ready = true;  // the sort ran before gate_up
      down.static_groups = shared;
      down.static_rows = n;
      down.static_ldw = shared > 0 ? shared * inner : 0;
      // The tail's last CTA of a column tile combines tokens x tile_n elements alone: only worth
      // it while that is at most one element per thread (measured: at 16 tokens, 32-column tiles
      // of 2 warps, the tail made a V2-Lite step 9% slower than the separate combine).
      const gpu::SkinnyTiling down_tiling = gpu::skinny_gemm_tiling(down);
      tail = tail && n * down_tiling.tile_n <= 32 * down_tiling.warps;
      if (tail) {
        down.combine.counters = buf_.combine_counters;
        down.combine.slot_of = buf_.sort.slot_of;
        down.combine.weights = buf_.expert_weights;
        down.combine.k = k;
        down.combine.shared_groups = shared;
        down.combine.x = buf_.x;
        down.combine.ldx = d;
        down.combine.tokens = n;
      }
      gpu::skinny_gemm(down, down_tiling, stream_);
    } else if (runs("experts")) {
      QUANTMLA_CUDA_CHECK(cudaEventSynchronize(offsets_copied_));
      int64_t busiest = 0;
      for (int64_t i = 0; i < e; ++i) {
        busiest = std::max<int64_t>(busiest, host_offsets_[i + 1] - host_offsets_[i]);
      }
      // Batch-invariant: the experts' exact rows at every step, by gpu::expert_gemm where the
      // shapes fit (a row's products are one k order whatever the expert's row count), else one
      // cuBLASLt product per expert; never the padded batch, whose row count is the busiest's.
      const bool invariant = options_.batch_invariant;
      const bool exact = (invariant || options_.expert_products == ExpertProducts::kOurs) &&
                         expert_gemm_fits(layer);
      // Rounded up so that steps of similar sizes share cuBLASLt plans.
      const int64_t padded_rows = (busiest + 15) / 16 * 16;
      if (!exact && !invariant && layer.expert_stride > 0 && e * padded_rows <= expert_rows_) {
        batched_experts(layer, padded_rows, busiest);
        slot_of = buf_.padded_slot_of;
        expert_out_bf16 = true;
      } else {
        const int64_t slots = host_offsets_[e];
        gpu::moe_gather(buf_.h, d, n, buf_.sort.token_of_slot, slots, buf_.sorted, d, d, stream_);
        if (exact) {
          expert_out_bf16 = !invariant;  // exact_experts says why
          exact_experts(layer, slots, busiest, expert_out_bf16);
        } else {
          const gpu::MoeExpertWeights weights{layer.expert_gate.data(), layer.expert_up.data(),
                                              layer.expert_down.data()};
          gpu::moe_expert_mlps(*gemm_, host_offsets_, static_cast<int>(e), buf_.sorted, d, weights,
                               d, inner, buf_.expert_gate_up, buf_.expert_act, buf_.expert_out, d,
                               stream_);
        }
      }
    }
    if (runs("combine") && !(tail && runs("experts"))) {
      if (expert_out_bf16) {
        gpu::moe_combine(reinterpret_cast<const uint16_t*>(buf_.expert_out), d, slot_of,
                         buf_.expert_weights, buf_.x, d, n, k, d, stream_, shared);
      } else {
        gpu::moe_combine(buf_.expert_out, d, slot_of, buf_.expert_weights, buf_.x, d, n, k, d,
                         stream_, shared);
      }
    }
  }

  // Whether the shapes fit gpu::expert_gemm (and the experts' weights sit one stride apart: one
  // tensor map covers them).
  bool expert_gemm_fits(const DeviceLayer& layer) const {
    return layer.expert_stride > 0 && config_.hidden_size % 128 == 0 &&
           config_.moe_intermediate_size % 64 == 0;
  }

  // gpu::expert_gemm's gated product of the routed experts: buf_.sorted's x_rows rows (each
  // expert's from its offset, or from e rows_per_expert in the padded layout) times gate and up
  // as one [2 inner, d] operand per expert, the activation into buf_.expert_act; busiest: the
  // largest expert's rows.
  gpu::ExpertGemmParams gated_experts(const DeviceLayer& layer, int64_t x_rows, int64_t busiest,
                                      int64_t rows_per_expert) const {
    const int64_t d = config_.hidden_size, inner = config_.moe_intermediate_size;
    gpu::ExpertGemmParams p;
    p.x = buf_.sorted;
    p.ldx = d;
    p.x_rows = x_rows;
    p.w = layer.expert_gate[0];
    p.w_stride = layer.expert_stride;
    p.offsets = buf_.sort.offsets;
    p.num_experts = static_cast<int>(config_.n_routed_experts);
    p.n = inner;
    p.k = d;
    p.act = buf_.expert_act;
    p.ld_act = inner;
    p.max_rows = busiest;
    p.rows_per_expert = rows_per_expert;
    return p;
  }

  // The routed experts of a prefill-sized step over their exact rows, gathered in moe_sort's
  // order in buf_.sorted, into buf_.expert_out (the gated product, then down); slots: the rows
  // of all experts, busiest: the largest expert's. bf16_out: the outputs in BF16 in
  // expert_out's bytes (as a BF16 model's forward has them, and half the bytes for the down
  // product to write and moe_combine to read); else FP32, as the decode steps' products write
  // them (the batch-invariant mode's choice: a token's outputs the same bits in every step).
  void exact_experts(const DeviceLayer& layer, int64_t slots, int64_t busiest, bool bf16_out) {
    const int64_t d = config_.hidden_size, inner = config_.moe_intermediate_size;
    gpu::ExpertGemmParams p = gated_experts(layer, slots, busiest, 0);
    gpu::expert_gemm(p, stream_);
    p.act = nullptr;
    p.x = buf_.expert_act;
    p.ldx = inner;
    p.w = layer.expert_down[0];
    p.n = d;
    p.k = inner;
    if (bf16_out) {
      p.y_bf16 = reinterpret_cast<uint16_t*>(buf_.expert_out);
    } else {
      p.y = buf_.expert_out;
    }
    p.ldy = d;
    gpu::expert_gemm(p, stream_);
  }

  // The routed experts of a prefill-sized step as two strided-batched GEMMs over all experts at
  // once (one launch fills the GPU, where a GEMM per expert of a few hundred rows leaves most SMs
  // idle): each expert's rows padded with zero rows to the busiest expert's count. The layout is
  // made on the device from the sort (moe_pad_layout); only the offsets came back, for `rows`
  // (>= busiest, the largest expert's rows). With ExpertProducts::kOursGated the gate/up product
  // and the activation are gpu::expert_gemm's over the real rows of the same layout. The outputs
  // in BF16 bits in buf_.expert_out, a token's slots in buf_.padded_slot_of (run_moe combines).
  void batched_experts(const DeviceLayer& layer, int64_t rows, int64_t busiest) {
    const ModelConfig& c = config_;
    const int64_t d = c.hidden_size, e = c.n_routed_experts, n = n_;
    const int64_t inner = c.moe_intermediate_size;
    const int k = static_cast<int>(c.num_experts_per_tok);
    gpu::moe_pad_layout(buf_.sort.offsets, static_cast<int>(e), buf_.sort.token_of_slot,
                        buf_.experts, buf_.sort.slot_of, n * k, rows, buf_.token_of_row,
                        buf_.padded_slot_of, stream_);
    gpu::moe_gather(buf_.h, d, n, buf_.token_of_row, e * rows, buf_.sorted, d, d, stream_);
    const bool gated_ours =
        options_.expert_products == ExpertProducts::kOursGated && expert_gemm_fits(layer);
    // Padding rows multiplied: by the down product alone when ours makes the activation.
    stats_.padding_flops += 2 * (e * rows - host_offsets_[e]) * (gated_ours ? 1 : 3) * inner * d;
    // y_x = x_x W_x^T for every expert x: [rows, k] -> [rows, n], weights one stride apart.
    const auto all_experts = [&](const uint16_t* x, int64_t k, const uint16_t* w, int64_t n,
                                 void* y, DType out_dtype) {
      gpu::BatchedGemmParams p;
      p.batch = e;
      p.m = rows;
      p.n = n;
      p.k = k;
      p.x = x;
      p.ldx = k;
      p.stride_x = rows * k;
      p.w = w;
      p.ldw = k;
      p.stride_w = layer.expert_stride;
      p.op_w = gpu::GemmOp::kT;
      p.y = y;
      p.ldy = n;
      p.stride_y = rows * n;
      p.out_dtype = out_dtype;
      p.tune_by_batch_rows = true;
      gemm_->batched(p, stream_);
    };
    // The padding rows' activations are never read back (moe_combine reads real rows only, and a
    // product's row depends on its own row alone), so they are not computed.
    if (gated_ours) {
      gpu::expert_gemm(gated_experts(layer, e * rows, busiest, rows), stream_);
    } else {
      // gate and up stacked: [rows, 2 inner] per expert.
      all_experts(buf_.sorted, d, layer.expert_gate[0], 2 * inner, buf_.expert_gate_up,
                  DType::kF32);
      gpu::silu_mul(buf_.expert_gate_up, 2 * inner, buf_.expert_act, inner, e * rows, inner,
                    stream_, buf_.token_of_row);
    }
    // The experts' outputs in BF16 (as a BF16 model's own forward has them), in expert_out's
    // bytes: the down product writes and moe_combine reads e x rows x d of them, ~120 MB a MoE
    // layer of a 2K prefill in FP32, which bound the combine and add to the product's weight
    // stream (the product 146 -> 136 µs at 2K; the step's gain is inside the spread between
    // processes: docs/benchmarks.md).
    all_experts(buf_.expert_act, inner, layer.expert_down[0], d, buf_.expert_out, DType::kBF16);
  }

  // The outputs copied back, the routed experts counted, the lengths committed.
  void finish(const StepBatch& batch, PagePool& pool, const StepOutputs& outputs) {
    const ModelConfig& c = config_;
    const int64_t r = static_cast<int64_t>(host_rows_.size());
    if (r > 0 && want_tokens_) {
      QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(outputs.tokens.data(), buf_.sampled, r * 4,
                                          cudaMemcpyDeviceToHost, stream_));
    }
    if (r > 0 && want_logits_) {
      // The returned chunks' rows (in chunk order, as buf_.logits holds them), one copy a run of
      // consecutive returned rows.
      int64_t row = 0, to = 0, run_first = 0, run_rows = 0;
      const auto copy_run = [&] {
        if (run_rows == 0) return;
        QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(
            outputs.logits.data() + to * c.vocab_size, buf_.logits + run_first * c.vocab_size,
            run_rows * c.vocab_size * 4, cudaMemcpyDeviceToHost, stream_));
        to += run_rows, run_rows = 0;
      };
      for (const SequenceChunk& chunk : batch.chunks) {
        const int64_t rows = chunk.num_logit_rows();
        if (!chunk.return_logits) {
          copy_run();
        } else if (rows > 0) {
          if (run_rows == 0) run_first = row;
          run_rows += rows;
        }
        row += rows;
      }
      copy_run();
    }
    const int64_t e = c.n_routed_experts;
    if (e > 0) {
      host_expert_counts_.resize(sz(c.num_layers * e));
      QUANTMLA_CUDA_CHECK(cudaMemcpyAsync(host_expert_counts_.data(), buf_.layer_expert_counts,
                                          host_expert_counts_.size() * 4, cudaMemcpyDeviceToHost,
                                          stream_));
    }
    QUANTMLA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const int64_t inner = c.moe_intermediate_size;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      if (!model_.layers[sz(l)].is_moe) continue;
      for (int64_t i = 0; i < e; ++i) {
        const int64_t rows = host_expert_counts_[sz(l * e + i)];
        if (rows > 0) count(3 * inner * c.hidden_size, 3 * rows * inner * c.hidden_size);
      }
    }
    for (const SequenceChunk& chunk : batch.chunks) {
      pool.set_length(chunk.sequence,
                      pool.length(chunk.sequence) + static_cast<int64_t>(chunk.tokens.size()));
    }
  }

  struct Buffers {
    int32_t *ids, *positions, *seq_ids, *block_table, *seq_lens, *logit_rows, *sampled;
    float *x, *gate_up, *final_rows, *logits;
    float* proj;  // [n, q_kv_a.out]: q (or q_a with a q LoRA), then the cache rows' kv_a output
    float* q = nullptr;              // [n, heads * qk] q_b's output (q LoRA only)
    uint16_t* q_low_bf16 = nullptr;  // [n, q_lora_rank] (q LoRA only)
    uint16_t *h, *q_bf16, *q_dec, *attn, *head_out, *act;
    uint16_t* gathered = nullptr;  // [prefill_expanded_max_context, 576] one sequence's rows
    gpu::SampleParams* sample_params;
    float* router_logits = nullptr;
    int32_t* experts = nullptr;
    float* expert_weights = nullptr;
    int32_t* layer_expert_counts = nullptr;  // [layers, E]: each layer's slots per expert
    gpu::MoeSortBuffers sort;
    uint16_t* sorted = nullptr;
    float* expert_gate_up = nullptr;
    uint16_t* expert_act = nullptr;
    float* expert_out = nullptr;
    int32_t* token_of_row = nullptr;      // [expert_rows_] the padded layout's gather (-1: padding)
    int32_t* padded_slot_of = nullptr;    // [n * k] slot_of in the padded layout
    int32_t* combine_counters = nullptr;  // [combine_counter_count()] SkinnyGemmParams::combine
  };

  CudaRunnerOptions options_;
  std::string device_name_;
  std::set<std::string> ablated_;  // QUANTMLA_ABLATE (profiling only)
  ModelConfig config_;
  float attention_factor_ = 1.0f;
  DeviceArena weights_arena_;
  DeviceArena activations_;
  DeviceModel model_;
  Buffers buf_{};
  cudaStream_t stream_ = nullptr;
  cudaEvent_t kernels_start_ = nullptr, kernels_end_ = nullptr;  // StepStats::device_ms
  cudaEvent_t offsets_copied_ = nullptr;  // the expert offsets of a prefill step are on the host
  std::unique_ptr<gpu::GemmRunner> gemm_;
  StepStats stats_;
  gpu::MoeRouteParams route_;
  gpu::PrefillAttentionWorkspace prefill_workspace_;
  std::vector<PlanWorkspace> plan_workspaces_;  // one per group of a step
  std::map<GraphKey, CapturedStep> graphs_;
  // The step being run.
  int64_t n_ = 0;
  bool want_logits_ = false, want_tokens_ = false;
  std::vector<int32_t> host_rows_, host_expert_counts_;
  std::vector<gpu::SampleParams> host_sample_params_;
  int64_t block_stride_ = 1;
  std::vector<int64_t> order_, chunk_first_token_;
  std::vector<Group> groups_;
  bool any_absorbed_ = false;  // a group of the step runs the decode kernel (needs q_dec)
  std::vector<int32_t> host_ids_, host_positions_, host_seq_ids_, host_seq_lens_;
  std::vector<int32_t> host_block_table_;
  // [E + 1] the expert offsets of a prefill step, pinned so that their copy is asynchronous.
  int32_t* host_offsets_ = nullptr;
  int64_t expert_rows_ = 0;  // rows of the expert buffers (slots, plus room for padding)
};

}  // namespace

std::unique_ptr<Runner> make_cuda_runner(const std::filesystem::path& model_dir,
                                         const CudaRunnerOptions& options) {
  return std::make_unique<CudaRunner>(model_dir, options);
}

}  // namespace quantmla
