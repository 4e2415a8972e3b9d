// Memory-mapped safetensors files and Hugging Face model directories (single file or sharded).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "quantmla/dtype.h"

namespace quantmla {

// One tensor inside a mapped file. `data` stays valid while the owning file/store lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  std::string file;  // path of the file it lives in, for error messages

  int64_t numel() const;
  std::string shape_string() const;  // "[1024,512]"
};

// A validated, read-only, memory-mapped .safetensors file. open() checks: the 8-byte header length
// fits the file; the header is well-formed JSON; every entry has a known dtype, a shape and
// data_offsets; offsets lie inside the data section, do not overlap, and dtype x shape = byte
// length. Any violation throws FormatError naming the file, the tensor and the numbers.
class SafetensorsFile {
 public:
  static std::shared_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(std::string_view name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All weights of a model directory: `model.safetensors`, or `model.safetensors.index.json` plus the
// shards it names (every shard validated; every index entry must exist in the shard it names).
class TensorStore {
 public:
  static TensorStore open_dir(const std::filesystem::path& dir);

  bool contains(std::string_view name) const;
  // Throws FormatError "tensor NAME: missing from DIR" when absent.
  const TensorView& get(std::string_view name) const;
  // As get(), and throws ShapeError "tensor NAME: shape [a,b], expected [c,d] (in FILE)" on
  // mismatch.
  const TensorView& get(std::string_view name, std::span<const int64_t> expected_shape) const;
  const TensorView& get(std::string_view name,
                        std::initializer_list<int64_t> expected_shape) const {
    return get(name, std::span<const int64_t>(expected_shape.begin(), expected_shape.size()));
  }
  std::vector<std::string> names() const;  // sorted
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> index_;
};

// Converts any floating or integer tensor to FP32 (exact for BF16/F16/F32).
std::vector<float> to_f32(const TensorView& tensor);
// Copies an I32 or I64 tensor into int32 values (throws ShapeError on other dtypes or overflow).
std::vector<int32_t> to_i32(const TensorView& tensor);

// A tensor to be written by write_safetensors().
struct TensorData {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // numel * dtype_size bytes, little-endian
};
TensorData make_f32_tensor(std::string name, std::vector<int64_t> shape,
                           std::span<const float> values);
TensorData make_bf16_tensor(std::string name, std::vector<int64_t> shape,
                            std::span<const float> values);

// Writes a safetensors file (header padded to 8 bytes, tensors in the given order).
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// The name, dtype and shape of one tensor of a file that SafetensorsWriter writes.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// Writes a safetensors file tensor by tensor, for files too large to hold in memory. The header
// (the layout write_safetensors writes) is computed from the specs and written by the constructor;
// append() then takes the tensors' bytes in the specs' order, in pieces of any size, and finish()
// checks that every byte arrived and closes the file. Throws InvalidArgument for a reserved or
// repeated name, ShapeError for a bad shape or bytes beyond the last tensor, IoError when the file
// cannot be created or written. A writer destroyed before finish() leaves a truncated file.
// Written data is handed to the disk 8 MiB at a time and dropped from the page cache once there,
// so that a file larger than memory streams at the disk's speed instead of thrashing the cache.
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorSpec> tensors,
                    const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void append(std::span<const std::byte> bytes);
  void finish();

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  uint64_t data_bytes() const { return data_bytes_; }  // sum of the tensors' bytes
  uint64_t written_bytes() const { return written_; }  // data bytes appended so far

 private:
  std::string file_;
  int fd_ = -1;
  std::vector<TensorSpec> tensors_;
  uint64_t data_bytes_ = 0;
  uint64_t written_ = 0;
  uint64_t file_offset_ = 0;  // header + data written
  uint64_t queued_ = 0;       // file bytes handed to writeback
};

}  // namespace quantmla
