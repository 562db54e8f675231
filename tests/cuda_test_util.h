// Helpers for the GPU tests (test_cuda_*.cpp): skip cleanly without a GPU, device buffers that are
// poisoned before a kernel runs, bf16 round trips. Every CUDA op is tested against its CPU op.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/cuda_check.h"
#include "core/dtype.h"

namespace tpmoe::test {

inline bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// With TPMOE_REQUIRE_GPU=1 in the environment a missing GPU fails the test instead of skipping it:
// on a GPU machine (scripts/gpu_validate.sh) a broken driver must not report green.
inline bool gpu_required() {
  const char* v = std::getenv("TPMOE_REQUIRE_GPU");
  return v && std::string(v) == "1";
}

// First statement of every GPU test.
#define TPMOE_REQUIRE_GPU()                                                                            \
  if (!::tpmoe::test::gpu_present()) {                                                                 \
    if (::tpmoe::test::gpu_required()) GTEST_FAIL() << "no CUDA GPU present, and TPMOE_REQUIRE_GPU=1"; \
    GTEST_SKIP() << "no CUDA GPU present";                                                             \
  }

// A device allocation filled with a NaN pattern (0xFF bytes) until written: an element a kernel
// forgot to write shows up as NaN, which never passes relative_l2.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)));
    poison();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // Both finish on the device before they return: cudaMemset is asynchronous, and a pageable
  // cudaMemcpy may return before its DMA lands, both on the legacy stream, which the ops' non-blocking
  // streams do not wait for: a late poison could overwrite an op's output (the likely cause of a rare
  // CudaSampling.MatchesTheCpuOpTokenForToken failure, seen twice in ~6 device runs).
  void poison() {
    CUDA_CHECK(cudaMemset(ptr_, 0xFF, std::max<size_t>(n_, 1) * sizeof(T)));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  void upload(const std::vector<T>& host) {
    CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// Random values; the fp32 oracle gets exactly the bf16 values the GPU gets.
inline std::vector<float> random_floats(size_t n, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}
inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    __nv_bfloat16_raw raw;
    raw.x = f32_to_bf16(v[i]);
    out[i] = raw;
  }
  return out;
}
inline std::vector<float> from_bf16(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const __nv_bfloat16_raw raw = v[i];
    out[i] = bf16_to_f32(raw.x);
  }
  return out;
}
// Rounds every value to bf16 and back: what the GPU will see.
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

}  // namespace tpmoe::test
