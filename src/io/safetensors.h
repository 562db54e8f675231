// Safetensors files: a bounds-checked header parser, a memory-mapped reader (single file or shards
// listed by model.safetensors.index.json) and a writer.
//
// Format: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
// then the data area; offsets are relative to the start of the data area.
// Every header is treated as untrusted: the parser checks that the length lies inside the file, that
// every offset lies inside the data area, that end - begin == dtype size x product(shape) (without
// overflow), and that no two tensors overlap. Any violation throws tpmoe::Error naming the file and
// the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tpmoe::io {

// A tensor inside a mapped file: no copy. `file` is the path it came from (for error messages).
struct TensorView {
  std::string name;
  std::string file;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  // MXFP8 weights (dtype F8_E4M3) only: the uint8 E8M0 block exponents, shape = shape with the last
  // dimension divided by 32, attached by the checkpoint from the sibling "*_scale_inv" tensor.
  // index() and rows() slice it in step with the data.
  const std::byte* scale = nullptr;

  int64_t numel() const;
  // Bytes of the scale for one last-dimension row (0 without a scale).
  int64_t scale_row_bytes() const { return scale && !shape.empty() ? shape.back() / kMxfp8BlockSize : 0; }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  // Element i of dimension 0, as a view of rank-1 lower (a row of a matrix, an expert of a stack).
  TensorView index(int64_t i) const;
  // Rows [start, start+count) of dimension 0, same rank.
  TensorView rows(int64_t start, int64_t count) const;
  // "[8,128]"
  std::string shape_str() const;
};

// One parsed header entry, before it is attached to mapped memory.
struct HeaderEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data area
  uint64_t end = 0;
};

struct ParsedHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::vector<HeaderEntry> entries;
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header of a complete safetensors file image `bytes` (the whole file).
// `origin` names the file in error messages. This is the fuzzing entry point.
ParsedHeader parse_safetensors_header(std::span<const std::byte> bytes, const std::string& origin);

// A read-only memory-mapped safetensors file.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards listed in
// model.safetensors.index.json (its weight_map must name only files that exist and tensors those
// files hold; a tensor in two shards is an error).
class SafetensorsSet {
 public:
  static SafetensorsSet open_dir(const std::filesystem::path& dir);
  static SafetensorsSet open_file(const std::filesystem::path& file);

  const TensorView* find(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> by_name_;
};

// A tensor to write: owned bytes in `dtype`, little-endian.
struct OwnedTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;

  int64_t numel() const;
  static OwnedTensor from_f32(std::vector<int64_t> shape, std::span<const float> values, DType dtype);
  static OwnedTensor from_i64(std::vector<int64_t> shape, std::span<const int64_t> values);
  static OwnedTensor copy_of(const TensorView& view);
  std::vector<float> to_f32() const;
};

// Converts any floating-point view (BF16, F16, F32, F64) to fp32; throws naming the tensor otherwise.
std::vector<float> to_f32(const TensorView& view);
// Reads an I64 (or I32) view as int64.
std::vector<int64_t> to_i64(const TensorView& view);

// Writes one file; tensors are laid out in name order, 8-byte aligned header as safetensors does.
void write_safetensors(const std::filesystem::path& path, const std::map<std::string, OwnedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace tpmoe::io
