// Attention over the bf16 KV cache (SPEC §1.3-1.4): cache writes, the lightning indexer's block
// selection, and causal GQA softmax attention (decode: split-KV; prefill: causal), full or
// restricted to the kept key blocks.
//
// Cache layout and page addressing: kv_cache.cuh. Token t of the step belongs to slot seq_slots[t]
// at position positions[t] and attends to keys 0..positions[t] of its slot (the caller has mapped
// their pages). All keys of the step are in the cache before any query reads, so prefill tokens of
// one sequence see each other: launch_attention writes them first, or (cache_written) the caller
// has, in an earlier launch on the same stream (head_norm_rope's cache store, norm.cuh).
//
// Graph capture: the grid depends only on num_tokens and the context bound (never on positions),
// and the page table is read from device memory at run time, so a decode step captured once
// replays for any context below its bound and any page assignment. Splits past a query's length
// exit early.
//
// Bytes for decode (T tokens at context L): K and V reads T*L*nkv*hd*2*2 dominate; the indexer adds
// T*L*ihd*2 per sparse layer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backends/cuda/kernel_stream.h"
#include "backends/cuda/kv_cache.cuh"

namespace tpmoe::cuda {

struct AttentionKernelParams {
  const __nv_bfloat16* q = nullptr;        // [T, num_q_heads * head_dim]
  const __nv_bfloat16* k = nullptr;        // [T, num_kv_heads * head_dim]
  const __nv_bfloat16* v = nullptr;        // [T, num_kv_heads * head_dim]
  const __nv_bfloat16* index_q = nullptr;  // [T, num_index_heads * index_head_dim]; nullptr: full attention
  const __nv_bfloat16* index_k = nullptr;  // [T, index_head_dim]
  KvCacheLayer cache;
  // True: the step's k, v and index_k rows are already in the cache (written by an earlier launch
  // on this stream: CudaOps::rotate_and_attend stores them from its head norm + RoPE kernel), so
  // the cache-write launch is skipped and k, v, index_k are not read (they may be null). False (the
  // default): launch_attention writes them first.
  bool cache_written = false;
  // True: every key a token attends to below its own position was written by an earlier step
  // (step_keeps_earlier_keys, model/ops.h: a decode step), so the split kernel may start copying
  // them before its PDL wait, while the kernel that stores this step's keys still runs. False (the
  // default): every key is read after the wait.
  bool decode_step = false;
  // True (the default): where a row's splits are 2-16 (their states fitting split 0's shared memory
  // and, above 8, every cluster of the launch resident at once), they form a thread-block cluster,
  // the others push their states into split 0's shared memory and split 0 merges them. False: every
  // split's state goes through the workspace and the last to arrive merges them (the path of longer
  // contexts). The splits are the same either way, and so are the bits; tests compare the two.
  bool merge_splits_in_cluster = true;
  const int32_t* positions = nullptr;  // [T]
  const int32_t* seq_slots = nullptr;  // [T]
  int num_tokens = 0;
  // Every query of the step sits below this position (0: cache.max_len). The split-KV grid is sized
  // by it, not by max_len, so a short context in a long cache launches few splits.
  int context_bound = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float scale = 0;
  int num_index_heads = 0;
  int index_head_dim = 0;
  int block_size = 0;
  int topk_blocks = 0;
  int local_blocks = 0;
  __nv_bfloat16* out = nullptr;  // [T, num_q_heads * head_dim]
  void* workspace = nullptr;     // attention_workspace_bytes(...) bytes, its head zeroed (below)
  size_t workspace_bytes = 0;
};

// Scratch the launch needs (the splits' arrival counters, split-KV partials, per-(token, index
// head) kept-block lists), for at most `max_tokens` tokens of a step.
size_t attention_workspace_bytes(int max_tokens, int num_q_heads, int num_index_heads, int head_dim, int max_len,
                                 int block_size, int topk_blocks);
// The workspace's first attention_workspace_zeroed_bytes() bytes (the splits' arrival counters)
// must be zero before its first launch; every launch leaves them zero. The rest needs no init.
size_t attention_workspace_zeroed_bytes();

// Whether block selection would keep every key block any query of the step can see, so that a
// sparse layer equals full attention (SPEC §1.4: "with short contexts every block is kept"). A query
// below the context bound sees at most ceil(bound / block_size) blocks; when they are no more than
// topk_blocks, the top-k keeps them all, and drops none: a block's score is the max of its keys'
// finite scores (a -inf one needs an infinite or fp32-overflowing index dot product, |iq||ik| past
// 3.4e38, which the normalised index heads do not reach). launch_attention then skips the selection
// launch (MiniMax-M3: blocks of 64, 16 kept, so every graph of a context below 1024).
bool attention_keeps_every_block(int context_bound, int block_size, int topk_blocks);

// Writes the step's k, v (and index_k) into the cache (unless cache_written), selects blocks on
// sparse layers (unless attention_keeps_every_block: the index keys are still written, for later
// steps' longer contexts), attends.
void launch_attention(const AttentionKernelParams& p, KernelStream on);

}  // namespace tpmoe::cuda
