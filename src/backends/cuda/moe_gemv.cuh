// The MoE layer for a single token (the batch-1 decode step), inside launch_moe: with one token every
// (token, slot) pair has its own expert row and nothing is shared between pairs, so the alignment,
// the token-blocked GEMMs and the combine of the general path reduce to two weight-streaming GEMVs:
//   1. gate_up + SwiGLU-OAI: act[s, j] = swiglu(x . Wgu[e_s][j], x . Wgu[e_s][I + j]), one warp per
//      (slot, j), both rows of the pair read by the same warp;
//   2. down + combine: out[n] = bf16(scale * sum_s w_s * (act[s] . Wdown[e_s][n])), one block per
//      two hidden rows, its warps splitting the slots, the sums added in slot order: no fp32 y
//      buffer, no combine launch.
// Three launches a MoE layer (route, these two) instead of five. Bytes as the general path: each
// slot's expert rows once. The down kernel starts loading its weights before the PDL wait (the slot
// ids come from the router, two launches back and therefore complete; see kernel_utils.cuh).
// Slot ids outside [0, num_rows) make the token's output NaN, as in the general path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/moe.cuh"

namespace tpmoe::cuda {

// Whether the single-token path takes p: one token, hidden and inter multiples of 8 (MXFP8: of 32,
// already required) and 16-byte aligned x and weights.
bool moe_gemv_fits(const MoeKernelParams& p);
// act: [slots, inter] bf16 scratch (the workspace's act region).
void launch_moe_gemv(const MoeKernelParams& p, uint16_t* act, bool pdl, cudaStream_t stream);

}  // namespace tpmoe::cuda
