// A typed device allocation (the decode plan's buffers, the GPU tests and benchmarks): freed on
// scope exit, copies checked.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace quantmla::gpu {

template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (count > 0) QUANTMLA_CUDA_CHECK(cudaMalloc(&data_, count * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) { upload(host); }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    if (host.size() != count_) throw InvalidArgument("DeviceArray::upload: size mismatch");
    if (count_ > 0) {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice));
    }
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) {
      QUANTMLA_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    }
    return host;
  }
  void fill_bytes(int value) {
    if (count_ > 0) QUANTMLA_CUDA_CHECK(cudaMemset(data_, value, bytes()));
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace quantmla::gpu
