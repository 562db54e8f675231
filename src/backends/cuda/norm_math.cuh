// The row arithmetic of the Gemma RMSNorm (SPEC §1.2) that more than one kernel runs: add_rmsnorm
// (norm.cu) and the decode GEMV that normalises its own input (gemv.cu). They must give the same
// bits for the same row, so they share the expressions here and the shape of the sum of squares:
// the row's 8-element chunks c are summed by "norm thread" c % norm_threads(H) in c order, each
// norm warp's 32 sums by warp_sum, the warps' totals by one more warp_sum (block_sum's shape with
// blockDim.x = norm_threads). A kernel with another block size runs those norm threads itself.
// Device code, plus norm_threads for the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "backends/cuda/kernel_utils.cuh"

namespace tpmoe::cuda {

// The norm threads of a row of `hidden` elements on the 16-byte path (hidden % 8 == 0): one per
// 8-element chunk, rounded up to whole warps, at most kMaxBlockThreads.
__host__ __device__ constexpr int norm_threads(int hidden) {
  const int threads = (hidden / 8 + kWarp - 1) / kWarp * kWarp;
  return threads < kMaxBlockThreads ? threads : kMaxBlockThreads;
}

// residual chunk (r0, r1) += the 8 bf16 of `partial` (when given); returns ss plus their squares.
__device__ __forceinline__ float add_chunk_sum_squares(float4& r0, float4& r1, const uint4* partial, float ss) {
  if (partial != nullptr) {
    float d[8];
    unpack_bf16x8(*partial, d);
    r0.x += d[0], r0.y += d[1], r0.z += d[2], r0.w += d[3];
    r1.x += d[4], r1.y += d[5], r1.z += d[6], r1.w += d[7];
  }
  ss += r0.x * r0.x + r0.y * r0.y + r0.z * r0.z + r0.w * r0.w;
  ss += r1.x * r1.x + r1.y * r1.y + r1.z * r1.z + r1.w * r1.w;
  return ss;
}

// 1 / rms of a row from its sum of squares.
__device__ __forceinline__ float inverse_rms(float ss, int hidden, float eps) {
  return 1.f / sqrtf(ss / float(hidden) + eps);
}

// The normed chunk as 8 bf16: v * inv * (1 + w).
__device__ __forceinline__ uint4 normed_chunk(const float4& r0, const float4& r1, const float4& w0, const float4& w1,
                                              float inv) {
  const float v[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  float y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = v[j] * inv * (1.f + w[j]);
  return pack_bf16x8(y);
}

}  // namespace tpmoe::cuda
