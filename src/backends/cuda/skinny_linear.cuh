// Linears of a few dozen tokens: out[M, N] = x[M, K] W[N, K]^T for M up to kSkinnyLinearMaxM, with
// bf16 or MXFP8 weights, the weight read from memory exactly once.
//
// Between the GEMV's range (<= 8 tokens, gemv.cuh) and a prefill, a decode step's linears are skinny:
// a few MB of weight against 9-128 rows of activations. cuBLASLt ran them at 1.35-3x the time their
// weight bytes take to read (bench_cuda_gemm, docs/PERF.md), and the grouped GEMM (moe.cuh), built
// for 8-token blocks of routed pairs, reads a linear's weight once per block of 8 tokens. This kernel
// streams each weight element once for all the tokens: a warp owns 16 weight rows and multiplies them,
// as they arrive, into the whole batch (tensor-core mma, weights as the A operand, tokens as the 8-wide
// n-tiles of B), with the activations staged in shared memory a stage (128 k) ahead.
//
// Work decomposition: a CTA of row_warps warps (1, 2, 4 or 8) takes 16 * row_warps weight rows and one
// of k_splits slices of K; the k_splits CTAs of a row tile form a cluster and add their partial sums
// through distributed shared memory, in rank order. Every sum is in a fixed order, so the bits do not
// depend on the schedule. The first weight loads go out before the PDL wait (weights never depend on
// the previous kernel). Products are bf16 x bf16 (MXFP8: e4m3 widened to bf16 exactly, scale applied
// per 32 k), sums fp32; out bf16 or fp32.
//
// Where it runs (measured on an H100, docs/PERF.md): bf16 linears of 9-16 tokens (CudaOps::linear;
// from 17 tokens cuBLASLt is as fast or faster) and MXFP8 linears of 9-64 (launch_fp8_linear; up to 2x
// faster than the grouped GEMM there). At 16 tokens it takes 1.3-2.6x the floor of a tp-8 or tp-4
// rank's bf16 weights (the router's 1.5 MB: 11x); from 33 tokens its time grows with the tokens faster
// than the bytes do (Nsight Compute: few warps an SM, each shared-memory read waited for by its own mma).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backends/cuda/kernel_stream.h"

namespace tpmoe::cuda {

inline constexpr int kSkinnyLinearMaxM = 128;

struct SkinnyLinearParams {
  const __nv_bfloat16* x = nullptr;  // [M, K]
  const void* w = nullptr;           // [N, K]: bf16, or e4m3 bytes when w_scale is set
  const uint8_t* w_scale = nullptr;  // [N, K / 32] E8M0 exponents (MXFP8); nullptr for bf16
  void* out = nullptr;               // [M, N] bf16, or fp32 when out_f32; must not alias x
  bool out_f32 = false;
  int M = 0, N = 0, K = 0;
};

// A CTA's tile: 16 * row_warps weight rows, and the number of CTAs (a cluster) its k range is split
// over. {0, 0} asks the launcher to choose (skinny_linear_choose).
struct SkinnyLinearTiling {
  int row_warps = 0;  // 1, 2, 4 or 8
  int k_splits = 0;   // 1 to 8
};

// Whether launch_skinny_linear takes these operands: 1 <= M <= kSkinnyLinearMaxM; K % 8 == 0 for
// bf16, K % 32 == 0 for MXFP8; x and the weights 16-byte aligned; every pointer set.
bool skinny_linear_fits(const SkinnyLinearParams& p);
// The tiling the launcher uses for these operands on the current device.
SkinnyLinearTiling skinny_linear_choose(const SkinnyLinearParams& p);
// Throws (naming the problem) where skinny_linear_fits does not hold or `tiling` is not one of the
// above; a tiling whose k split leaves a CTA no k is cut down to one that does.
void launch_skinny_linear(const SkinnyLinearParams& p, KernelStream on, SkinnyLinearTiling tiling = {});

}  // namespace tpmoe::cuda
