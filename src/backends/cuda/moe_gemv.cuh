// The MoE layer for a single token (the batch-1 decode step), inside launch_moe: with one token every
// (token, slot) pair has its own expert row and nothing is shared between pairs, so the alignment,
// the token-blocked GEMMs and the combine of the general path reduce to two weight-streaming GEMVs:
//   1. gate_up + SwiGLU-OAI: act[s, j] = swiglu(x . Wgu[e_s][j], x . Wgu[e_s][I + j]), one warp (or,
//      where (slot, j) pairs are few, 2-4 warps splitting k) per (slot, j), both rows of the pair
//      read together;
//   2. down + combine: out[n] = bf16(scale * sum_s w_s * (act[s] . Wdown[e_s][n])), a warp per four
//      hidden rows walking every slot's rows, the sums added in slot order in registers: no fp32 y
//      buffer, no combine launch. Where those row groups are few (a narrow hidden), a block per
//      group instead, its warps splitting the slots and warp 0 adding their sums in slot order
//      (the same bits).
// Both run a grid of the blocks resident at once and loop over their work (the slot-split down
// kernel: a block per group, all resident).
// When the layer routes inside (MoeKernelParams::route), both kernels run the router's top-k
// themselves from its logits (route_top_k.cuh, the router kernel's own code): a MoE layer is then
// three launches (the router's GEMV and these two), where the general path takes six (the GEMV,
// route, align, two GEMMs, combine). Bytes as the general
// path: each slot's expert rows once. The down kernel routes and starts loading its weights before
// the PDL wait (the router's logits or slot ids are two launches back and therefore complete; see
// kernel_utils.cuh). Slot ids outside [0, num_rows) make the token's output NaN, as in the general
// path.
//
// A few tokens (2-8): the same two GEMVs after the general path's routing and alignment (8-pair
// token blocks, so each expert row the tokens chose is one block): gate_up streams each chosen row
// once and multiplies it with the x of every pair in its block; down walks the blocks' rows of its
// hidden rows and adds each pair's sum, times its slot weight, into that token's accumulators. Four
// launches (route, align, these two) where the grouped GEMMs take five, and every expert row read
// with the GEMVs' 16-byte loads instead of the tensor-core tiles' (built for more tokens than this).
// A token's sum runs over its rows in row order, not slot order: within tolerance of the oracle,
// not its bits. launch_moe takes this path by default only for MXFP8 weights at 2-4 tokens, where
// it measured faster than the grouped GEMMs (docs/PERF.md); elsewhere its down GEMV, at ~55% of the
// DRAM bandwidth, holds it back.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/moe.cuh"

namespace tpmoe::cuda {

// Whether the single-token path takes p: one token, hidden and inter multiples of 8 (MXFP8: of 32,
// already required) and 16-byte aligned x and weights.
bool moe_gemv_fits(const MoeKernelParams& p);
// act: [slots, inter] bf16 scratch (the workspace's act region).
void launch_moe_gemv(const MoeKernelParams& p, uint16_t* act, KernelStream on);

// The token block of the alignment the few-token GEMVs read: 8 pairs, so each expert row that at most
// 8 tokens chose is one block.
constexpr int kMoeGemvBlockPairs = 8;

// The alignment's tables (moe.cu, launch_moe), read on the device.
struct MoeBins {
  const int32_t* offsets = nullptr;       // [num_rows + 1]
  const int32_t* num_blocks = nullptr;    // [1]
  const int32_t* block_expert = nullptr;  // [blocks]
  const int32_t* block_start = nullptr;   // [blocks]
  const int32_t* perm = nullptr;          // [pairs]: sorted position -> t * slots + s
};

// Whether the few-token path takes p: 2-8 tokens, at most 16 slots, and the operands of
// moe_gemv_fits.
bool moe_gemv_batch_fits(const MoeKernelParams& p);
// After routing and an alignment into blocks of block_m pairs on the same stream (block_m must be
// kMoeGemvBlockPairs: the kernels read at most that many pairs a block). act: [pairs, inter] bf16
// scratch in the alignment's sorted order (the workspace's act region).
void launch_moe_gemv_batch(const MoeKernelParams& p, const MoeBins& bins, int block_m, uint16_t* act, KernelStream on);

}  // namespace tpmoe::cuda
