// The routed MoE layer on the GPU: the router (sigmoid scores, top-k of score + bias, renormalise,
// shared slots appended) and the expert computation (SwiGLU-OAI experts, weighted combine).
//
// Everything that bins by expert is sized by num_rows, the physical expert rows (routed + fused
// shared): sizing by the routed count would silently drop the shared slots (vLLM PR #51632).
//
// Bytes for decode: each distinct expert row touched reads its gate_up (2I x H) and down (H x I)
// bf16 weights once: 3 * I * H * 2 bytes per row; activations are small next to that.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/kernel_stream.h"

namespace tpmoe::cuda {

struct RouteKernelParams {
  const float* logits = nullptr;  // [T, num_experts]
  const float* bias = nullptr;    // [num_experts] e_score_correction_bias (chooses, never weighs)
  int32_t* slot_ids = nullptr;    // [T, top_k + num_shared]
  float* slot_weights = nullptr;  // [T, top_k + num_shared]
  int num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  int num_shared = 0;       // shared slots appended with ids E..E+n-1
  float shared_weight = 0;  // 1 / routed_scaling_factor
  // Routing statistics (optional): routed_flags[e] = 1 for every expert e a token t < *num_real_tokens
  // (a device scalar: recorded steps read each replay's count) chose among its top_k.
  uint8_t* routed_flags = nullptr;  // [num_experts]
  const int32_t* num_real_tokens = nullptr;
};
// Ties in score + bias go to the lower expert id (as the CPU oracle).
void launch_route(const RouteKernelParams& p, KernelStream on);

// Knobs of launch_moe, for benchmarks and tests (the defaults are the measured best).
// Every setting is deterministic and matches the CPU oracle; pdl and the prefetch do not change a
// bit, block_m changes the k order of the sums (each output is one CTA's fixed-order reduction).
struct MoeTuning {
  bool pdl = true;  // programmatic dependent launch between the kernels (where the KernelStream allows it)
  int block_m = 0;  // pairs per token block: 8, 16 or 32; 0 = from num_tokens (<= 64: 8, <= 128: 16, else 32)
  int down_prefetch_bytes = 65536;  // per down CTA, weights prefetched into L2 before its wait; 0 = off
  // Apply pdl only up to 64 tokens, the prefetch only at 1 token and the few-token GEMVs only to
  // MXFP8 weights at 2-4 tokens (where each measured faster; docs/PERF.md).
  bool auto_select = true;
  // A single token runs the two GEMV kernels of moe_gemv.cuh (gate_up + SwiGLU, down + combine)
  // when its operands fit; false: the general align / GEMM / combine path (block_m and the prefetch
  // apply only there).
  bool single_token_gemv = true;
  // 2-8 tokens run the few-token GEMVs of moe_gemv.cuh after the alignment (8-pair blocks) when
  // their operands fit (and auto_select allows); false: the grouped GEMMs and the combine.
  bool batch_gemv = true;
};

struct MoeKernelParams {
  const __nv_bfloat16* x = nullptr;     // [T, hidden]
  const int32_t* slot_ids = nullptr;    // [T, slots], each in [0, num_rows)
  const float* slot_weights = nullptr;  // [T, slots]
  const void* gate_up = nullptr;        // [num_rows, 2 * inter, hidden]: gate half, then up half (bf16 or e4m3)
  const void* down = nullptr;           // [num_rows, hidden, inter] (bf16 or e4m3)
  // MXFP8 weights (weight-only FP8): gate_up and down hold float8_e4m3fn bytes and these their E8M0
  // block exponents, [num_rows, 2 * inter, hidden / 32] and [num_rows, hidden, inter / 32]; both
  // nullptr for bf16 weights. hidden and inter must be multiples of 32.
  const uint8_t* gate_up_scale = nullptr;
  const uint8_t* down_scale = nullptr;
  __nv_bfloat16* out = nullptr;  // [T, hidden] = scale * sum_s w[t,s] * expert(x[t])
  int num_tokens = 0;
  int slots = 0;
  int hidden = 0;
  int inter = 0;
  int num_rows = 0;
  float alpha = 1.702f;
  float limit = 7.0f;
  float scale = 1.0f;
  void* workspace = nullptr;  // moe_workspace_bytes(...) bytes
  size_t workspace_bytes = 0;
  // Routing inside the layer (optional). When route.logits is set, launch_moe first routes the
  // tokens into slot_ids and slot_weights (route.slot_ids and route.slot_weights must be those, and
  // route's shape this layer's): launch_route for several tokens, while a single token is routed by
  // the two GEMV kernels themselves, from the logits, with no launch of its own. Same bits either way.
  RouteKernelParams route;
  MoeTuning tuning;  // the measured best unless a benchmark or test asks otherwise
};

size_t moe_workspace_bytes(int max_tokens, int slots, int hidden, int inter, int num_rows);
void launch_moe(const MoeKernelParams& p, KernelStream on);

// A linear with MXFP8 weights, out[M, N] = x[M, K] W[N, K]^T, W = e4m3(w) * 2^(w_scale - 127) per 32
// consecutive k. FP8 stays in memory and is widened to bf16 in registers; bf16 mma, fp32
// accumulation, bf16 or fp32 out. K % 32 == 0; any M, N.
struct Fp8LinearParams {
  const __nv_bfloat16* x = nullptr;  // [M, K]
  const uint8_t* w = nullptr;        // [N, K] e4m3
  const uint8_t* w_scale = nullptr;  // [N, K / 32] E8M0
  void* out = nullptr;               // [M, N] bf16, or fp32 when out_f32
  bool out_f32 = false;
  int M = 0, N = 0, K = 0;
};
// The kernel for the shape: decode-sized M (<= 8) the GEMV of gemv.cuh, up to kFp8SkinnyLinearMaxM
// tokens the skinny linear of skinny_linear.cuh (16-byte aligned operands), anything else
// launch_grouped_linear.
inline constexpr int kFp8SkinnyLinearMaxM = 64;
void launch_fp8_linear(const Fp8LinearParams& p, KernelStream on);
// The grouped-GEMM kernel of the MoE down projection, run as one expert that every token is routed to
// in order (no routing, no slot weights), in token blocks of 8-32 tokens, each of which reads the
// weight again (from L2 where it stays there). Where the token blocks times the 32-row tiles would
// leave most SMs idle (a few tokens against a narrow N: a tp-8 rank's k_proj is 4 tiles), the k range
// is split over a cluster of up to 8 CTAs a tile, which add their sums through distributed shared
// memory in a fixed order (deterministic). Weights need only 8-byte alignment.
void launch_grouped_linear(const Fp8LinearParams& p, KernelStream on);

// The same grouped GEMM (split k included) for a bf16 linear, out[M, N] = x[M, K] W[N, K]^T, fp32
// accumulation, bf16 or fp32 out, deterministic. Any M, N, K >= 1. CudaOps runs it for 9 to 16 tokens
// only where the skinny linear cannot read the operands (rows off 16-byte alignment).
struct Bf16LinearParams {
  const __nv_bfloat16* x = nullptr;  // [M, K]
  const __nv_bfloat16* w = nullptr;  // [N, K]
  void* out = nullptr;               // [M, N] bf16, or fp32 when out_f32
  bool out_f32 = false;
  int M = 0, N = 0, K = 0;
};
void launch_bf16_linear(const Bf16LinearParams& p, KernelStream on);

// Helpers for the per-expert cuBLAS baseline of bench/bench_moe (not used by the engine):
// acc[token[r], :] += w[r] * y[r, :] for r < n (fp32 atomics), and out = bf16(scale * in).
void launch_scatter_add_weighted(const float* y, const int32_t* token, const float* w, int n, int hidden, float* acc,
                                 cudaStream_t stream);
void launch_f32_to_bf16(const float* in, __nv_bfloat16* out, int64_t n, float scale, cudaStream_t stream);

}  // namespace tpmoe::cuda
