// A non-owning view of a backend buffer: weights and activations alike. The backend that made a
// Tensor owns its memory; the model only passes Tensors between ops.
#pragma once

#include <array>
#include <cstdint>

#include "core/dtype.h"

namespace tpmoe {

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, 3> shape{0, 0, 0};
  // MXFP8 weights (dtype kF8E4M3) only: uint8 E8M0 exponents, one per 32 consecutive elements of the
  // last dimension ([.., K/32], rows in step with data): value = fp8(data) * 2^(scale - 127).
  void* scale = nullptr;

  static Tensor make(void* data, DType dtype, int64_t d0) { return {data, dtype, 1, {d0, 1, 1}}; }
  static Tensor make(void* data, DType dtype, int64_t d0, int64_t d1) { return {data, dtype, 2, {d0, d1, 1}}; }
  static Tensor make(void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2) {
    return {data, dtype, 3, {d0, d1, d2}};
  }

  bool empty() const { return data == nullptr; }
  int64_t dim(int i) const { return shape[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }

  // Row r of the first dimension of a 2-D or 3-D tensor, [d0, d1(, d2)] -> [d1(, d2)], sharing its
  // storage (and its MXFP8 scales).
  Tensor row(int64_t r) const {
    const int64_t elems = shape[1] * shape[2];  // unused dimensions are 1
    Tensor t{
        static_cast<char*>(data) + r * elems * int64_t(dtype_size(dtype)), dtype, ndim - 1, {shape[1], shape[2], 1}};
    if (scale != nullptr) t.scale = static_cast<char*>(scale) + r * (elems / kMxfp8BlockSize);
    return t;
  }
};

}  // namespace tpmoe
