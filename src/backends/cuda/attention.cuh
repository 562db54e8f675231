// Attention over the bf16 KV cache (SPEC §1.3-1.4): cache writes, the lightning indexer's block
// selection, and causal GQA softmax attention (decode: split-KV; prefill: causal), full or
// restricted to the kept key blocks.
//
// Cache layout: a pool of pages of 2^page_shift positions, shared by every sequence slot:
//   k, v     [num_pages * page_size][num_kv_heads][head_dim]  bf16
//   index_k  [num_pages * page_size][index_head_dim]          bf16 (sparse layers only)
// Position p of slot s is pool row page_table[s * pages_per_seq + (p >> page_shift)] * page_size +
// (p & (page_size - 1)). Token t of the step belongs to slot seq_slots[t] at position positions[t]
// and attends to keys 0..positions[t] of its slot (the caller has mapped their pages). All keys of
// the step are written before any query reads, so prefill tokens of one sequence see each other.
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

namespace tpmoe::cuda {

struct KvCacheLayer {
  __nv_bfloat16* k = nullptr;
  __nv_bfloat16* v = nullptr;
  __nv_bfloat16* index_k = nullptr;     // nullptr on full-attention layers
  const int32_t* page_table = nullptr;  // [max_seqs][pages_per_seq], device memory
  int max_seqs = 0;
  int max_len = 0;
  int page_shift = 0;  // log2(page size)
  int pages_per_seq = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int index_head_dim = 0;
};

struct AttentionKernelParams {
  const __nv_bfloat16* q = nullptr;        // [T, num_q_heads * head_dim]
  const __nv_bfloat16* k = nullptr;        // [T, num_kv_heads * head_dim]
  const __nv_bfloat16* v = nullptr;        // [T, num_kv_heads * head_dim]
  const __nv_bfloat16* index_q = nullptr;  // [T, num_index_heads * index_head_dim]; nullptr: full attention
  const __nv_bfloat16* index_k = nullptr;  // [T, index_head_dim]
  KvCacheLayer cache;
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
  void* workspace = nullptr;     // attention_workspace_bytes(...) bytes
  size_t workspace_bytes = 0;
};

// Scratch the launch needs (split-KV partials, per-(token, index head) kept-block lists), for at
// most `max_tokens` tokens of a step.
size_t attention_workspace_bytes(int max_tokens, int num_q_heads, int num_index_heads, int head_dim, int max_len,
                                 int block_size, int topk_blocks);

// Writes the step's k, v (and index_k) into the cache, selects blocks on sparse layers, attends.
void launch_attention(const AttentionKernelParams& p, cudaStream_t stream);

}  // namespace tpmoe::cuda
