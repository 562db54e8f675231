// Small memory-bound kernels around the layers: embedding lookup, vector add, SwiGLU-OAI, row
// gather and greedy argmax. Each moves its bytes once (stated per kernel); none is worth fusing
// further until a profile says so.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/kernel_stream.h"

namespace tpmoe::cuda {

// out[t, :] = table[token_ids[t], :] widened to fp32 (the residual stream). Bytes: T*H*(2+4).
// A token id of kEmbedFedBackId reads fed_ids[t] instead: the id the previous step drew for row t,
// which the host has not seen (a decode step queued behind the one before it).
// A token id outside [0, vocab) writes NaN into its row (a kernel cannot throw; the host
// validates ids before the step, this only keeps a bad id from reading out of bounds).
inline constexpr int32_t kEmbedFedBackId = -1;
struct EmbedParams {
  const __nv_bfloat16* table = nullptr;  // [vocab, hidden]
  const int32_t* token_ids = nullptr;    // [num_tokens]
  float* out = nullptr;                  // [num_tokens, hidden]
  int num_tokens = 0;
  int hidden = 0;
  int vocab = 0;
  const int32_t* fed_ids = nullptr;  // [num_tokens] where token_ids holds kEmbedFedBackId
};
void launch_embed(const EmbedParams& p, KernelStream on);

// y[i] += x[i] for n bf16 values (fp32 add, one rounding). Bytes: 3 * n * 2.
void launch_add_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n, KernelStream on);

// SwiGLU-OAI (SPEC §1.6): gate_up[rows, 2n] (gate half, then up half) -> out[rows, n].
struct SwigluKernelParams {
  const __nv_bfloat16* gate_up = nullptr;
  __nv_bfloat16* out = nullptr;
  int rows = 0;
  int n = 0;
  float alpha = 1.702f;
  float limit = 7.0f;
};
void launch_swiglu(const SwigluKernelParams& p, KernelStream on);

// out[r, :] = x[rows[r], :] for r < num_rows (bf16, width cols).
void launch_gather_rows(const __nv_bfloat16* x, const int32_t* rows, int num_rows, int cols, __nv_bfloat16* out,
                        KernelStream on);

// The columns of in[rows, sum cols_i] side by side into the outputs: out_i[r, :] = in[r, c_i .. c_i +
// cols_i), c_i = cols_0 + ... + cols_{i-1}. Elements of elem_bytes (2: bf16, 4: fp32), copied as they
// are. Bytes: 2 * rows * sum cols_i * elem_bytes. (CudaOps::linears: one GEMM over a layer's
// concatenated projection weights, its columns then split into the projections' outputs.)
constexpr int kMaxSplitColumns = 8;
struct SplitColumnsParams {
  const void* in = nullptr;
  int64_t rows = 0;
  int elem_bytes = 2;
  int count = 0;
  void* out[kMaxSplitColumns] = {};
  int cols[kMaxSplitColumns] = {};
};
void launch_split_columns(const SplitColumnsParams& p, KernelStream on);

// ids[r] = argmax_v logits[r, v] (fp32), first maximum on ties (as torch.argmax), and values[r] =
// that maximum when values is not null. Two passes (blocks of 4096 logits, then their winners per
// row) so a batch-1 row of 200k logits spreads over the GPU; the workspace holds the block winners.
size_t argmax_workspace_bytes(int rows, int vocab);
void launch_argmax(const float* logits, int rows, int vocab, int32_t* ids, float* values, void* workspace,
                   size_t workspace_bytes, KernelStream on);

// The greedy ids of a vocab-parallel step from its ranks' argmax winners, gathered as
// gathered[ranks][2][rows] (int32: the rank's local ids, then its values' fp32 bits): ids[r] =
// q * slice + the local id of the rank q whose value wins as in argmax (NaN first, then the larger,
// ties to the lower rank). One thread a row. Bytes: ranks*rows*8 + rows*4.
void launch_combine_vocab_argmax(const int32_t* gathered, int ranks, int rows, int64_t slice, int32_t* ids,
                                 KernelStream on);

// Fills a rows x cols block with the presets' counter-based random numbers: element (r, c), written
// at out[r * out_row_stride + c] as bf16 (fp32 when out_f32), is random_value(seed, key,
// index_offset + r * index_row_stride + c, stddev) (src/model/presets.h). So a device-generated
// shard holds bitwise the values of the same block of the model the CPU generates.
struct FillRandomParams {
  void* out = nullptr;
  bool out_f32 = false;
  int64_t rows = 1, cols = 0;
  int64_t out_row_stride = 0;    // elements between output rows (>= cols)
  uint64_t seed = 0, key = 0;    // key = tensor_key(canonical name)
  uint64_t index_offset = 0;     // canonical element index of (0, 0)
  int64_t index_row_stride = 0;  // canonical elements between rows (the source's K)
  float stddev = 0;
};
void launch_fill_random(const FillRandomParams& p, cudaStream_t stream);

}  // namespace tpmoe::cuda
