// Decode-sized linears: out_i[M, N_i] = x[M, K] W_i[N_i, K]^T for M <= kGemvMaxM tokens and up to
// kMaxGemvOutputs weight matrices that share x (a layer's q, k, v and indexer projections), in one
// launch. At decode a linear is a stream of its weights with next to no arithmetic, so the kernel is
// built for that stream: each warp reads whole weight rows with 16-byte loads that skip L1, the
// activations sit in shared memory, products and sums are fp32, one warp reduction per output.
// Weights are bf16, or MXFP8 (e4m3 with an E8M0 exponent per 32 consecutive k, widened to bf16 in
// registers exactly as the grouped GEMM does). Launched with PDL: the first weight loads are issued
// before the wait for the previous kernel (weights never depend on it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tpmoe::cuda {

constexpr int kGemvMaxM = 8;
constexpr int kMaxGemvOutputs = 6;

struct GemvOutput {
  const void* w = nullptr;           // [N, K]: bf16, or e4m3 bytes when w_scale is set
  const uint8_t* w_scale = nullptr;  // [N, K / 32] E8M0 exponents (MXFP8); nullptr for bf16
  void* out = nullptr;               // [M, N] bf16, or fp32 when out_f32; must not alias x
  bool out_f32 = false;
  int N = 0;
};

struct GemvParams {
  const __nv_bfloat16* x = nullptr;  // [M, K]
  int M = 0, K = 0;
  GemvOutput outputs[kMaxGemvOutputs];
  int count = 0;
};

// Whether launch_gemv takes these operands: 1 <= M <= kGemvMaxM, K % 16 == 0 (K % 32 for MXFP8),
// 16-byte aligned x and weights, every output of one weight format, x small enough for shared memory.
bool gemv_fits(const GemvParams& p);
void launch_gemv(const GemvParams& p, cudaStream_t stream);

}  // namespace tpmoe::cuda
