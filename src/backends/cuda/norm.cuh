// Gemma RMSNorm kernels (SPEC §1.2): y = v / sqrt(mean(v^2) + eps) * (1 + w), fp32 math.
//
// add_rmsnorm: residual[T,H] (fp32) += partial[T,H] (bf16, optional); out[T,H] (bf16) = norm(residual).
//   Bytes: T*H*(2 read partial + 4 read + 4 write residual + 2 write out) + H*4 weight.
// head_norm_rope: in place on x[T, heads*hd] (bf16): per-head Gemma norm (weight [hd], fp32) then
//   NeoX RoPE on the first rotary_dim channels at positions[t]. Bytes: 2 x T*heads*hd*2. Optionally
//   (a CacheRowStore) it also stores the result into the paged KV cache (k, index_k) and copies a
//   second tensor of x's shape there unchanged (v), so attention needs no cache-write launch.
// Layouts: row-major, rows contiguous. Kernels take raw pointers, sizes and a stream; shapes are
// validated by the caller (CudaOps) once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/kernel_stream.h"
#include "backends/cuda/kv_cache.cuh"

namespace tpmoe::cuda {

struct AddRmsNormParams {
  const __nv_bfloat16* partial = nullptr;  // nullptr: plain norm of the residual
  float* residual = nullptr;               // [rows, hidden], updated in place when partial is set
  const float* weight = nullptr;           // [hidden]
  __nv_bfloat16* out = nullptr;            // [rows, hidden]
  int rows = 0;
  int hidden = 0;
  float eps = 1e-6f;
};
void launch_add_rmsnorm(const AddRmsNormParams& p, KernelStream on);

struct HeadNormRopeParams {
  __nv_bfloat16* x = nullptr;          // [num_tokens, num_heads * head_dim], in place
  const float* weight = nullptr;       // [head_dim]
  const int32_t* positions = nullptr;  // [num_tokens]
  int num_tokens = 0;
  int num_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;
  float theta = 0;
  float eps = 1e-6f;
  // Optional cache store (needs the launch's CacheRowStore): token t's normed, rotated row also
  // goes to pool row store.pages.row(store.seq_slots[t], positions[t]) of `cache`
  // ([pool rows][num_heads * head_dim], kv_cache.cuh): a layer's k and index_k.
  __nv_bfloat16* cache = nullptr;
  // Optional, likewise: `copy` ([num_tokens, num_heads * head_dim], x's shape) copied unchanged into
  // the same rows of copy_cache, head by head by the warp that normalises x's head (v beside k).
  // 16-byte aligned, head_dim a multiple of 8.
  const __nv_bfloat16* copy = nullptr;
  __nv_bfloat16* copy_cache = nullptr;
};
void launch_head_norm_rope(const HeadNormRopeParams& p, KernelStream on);

// The page addressing of a launch whose items store into the paged KV cache (kv_cache.cuh).
struct CacheRowStore {
  PageMap pages;
  const int32_t* seq_slots = nullptr;  // [num_tokens]: the slot of token t
};

// Up to kMaxHeadNormRopeItems tensors (a layer's q, k, index q and index k) in one launch: the same
// per-head arithmetic as one launch each, so the results are bitwise those; the cache rows items
// store hold exactly the bf16 values written back to x (or copied from `copy`).
constexpr int kMaxHeadNormRopeItems = 4;
void launch_head_norm_rope_batch(const HeadNormRopeParams* items, int count, KernelStream on,
                                 const CacheRowStore& store = {});

}  // namespace tpmoe::cuda
