// Decode-sized linears: out_i[M, N_i] = x[M, K] W_i[N_i, K]^T for M <= kGemvMaxM tokens and up to
// kMaxGemvOutputs weight matrices that share x (a layer's q, k, v and indexer projections), in one
// launch. At decode a linear is a stream of its weights with next to no arithmetic, so the kernel is
// built for that stream: each warp reads whole weight rows with 16-byte loads that skip L1, the
// activations sit in shared memory, products and sums are fp32, one warp reduction per output.
// Weights are bf16, or MXFP8 (e4m3 with an E8M0 exponent per 32 consecutive k, widened exactly in
// registers: weight_loads.cuh's widen_e4m3x16 and dot16_scaled). Launched with PDL: the first weight loads are issued
// before the wait for the previous kernel (weights never depend on it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernel_stream.h"

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

// The input norm a GEMV may run itself (tp 1: nothing to reduce first): residual_out[M, K] =
// residual + partial; x = gemma_rmsnorm(residual_out) * (1 + weight), as add_rmsnorm computes them,
// bit for bit (norm_math.cuh). Every block normalises the M rows into its shared memory (they are
// small and L2-hot); block 0 also writes them to `out` (for the layer's other readers of x) and the
// sums to residual_out. The sums go to another buffer than the one every block reads: written in
// place, they would have to wait until the last block had read the rows (an arrival count, and that
// block's writes at the end of the kernel's chain). So one launch does the norm and the projections,
// at the price of every block reading the rows: gemv_norm_pays says when that is less than the launch
// it saves.
struct GemvInputNorm {
  const __nv_bfloat16* partial = nullptr;  // [M, K]
  const float* residual = nullptr;         // [M, K] fp32, read
  float* residual_out = nullptr;           // [M, K] fp32: residual + partial (not residual itself)
  const float* weight = nullptr;           // [K] fp32
  float eps = 0;
  __nv_bfloat16* out = nullptr;  // [M, K]: x, the normed rows, as add_rmsnorm's out
};

struct GemvParams {
  const __nv_bfloat16* x = nullptr;  // [M, K]; null when norm.residual is set (x is computed: norm.out)
  int M = 0, K = 0;
  GemvOutput outputs[kMaxGemvOutputs];
  int count = 0;
  GemvInputNorm norm;  // norm.residual set: x = the norm of the residual stream (above)
};

// Whether launch_gemv takes these operands: 1 <= M <= kGemvMaxM, K % 16 == 0 (K % 32 for MXFP8),
// 16-byte aligned x and weights, every output of one weight format, x small enough for shared memory;
// with an input norm, 16-byte aligned partial, residual, residual_out (another buffer), weight and
// out, and no x.
bool gemv_fits(const GemvParams& p);
// Whether running the input norm inside the GEMV (every block reading M rows of residual and partial
// and the norm weight) costs less than the norm's own launch: when those redundant reads, from L2,
// stay under a few megabytes. False for the wide projections of a full-width model (1000+ blocks),
// true for narrow ones (a router, a small model's layers).
bool gemv_norm_pays(const GemvParams& p);
void launch_gemv(const GemvParams& p, KernelStream on);

}  // namespace tpmoe::cuda
