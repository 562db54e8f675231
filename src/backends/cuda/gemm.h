// Dense projections through cuBLASLt: out[M, N] = x[M, K] w[N, K]^T with bf16 operands, fp32
// accumulation, bf16 or fp32 output. Row-major on our side; cuBLASLt sees the column-major
// transpose (the "TN" problem out^T = w x^T), which needs no copy.
//
// Algorithms are chosen once per shape by cuBLASLt's heuristic and cached, and the workspace is
// allocated up front, so a matmul issues no allocation and can be captured in a CUDA graph.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <tuple>

namespace tpmoe::cuda {

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t(32) << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void linear(const __nv_bfloat16* x, const __nv_bfloat16* w, void* out, bool out_f32, int M, int N, int K,
              cudaStream_t stream);

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan_for(int M, int N, int K, bool out_f32);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int, int, bool>, Plan> plans_;
};

}  // namespace tpmoe::cuda
