// The paged KV cache as the kernels see it: one layer's pools and the page table that maps a
// sequence slot's positions to pool rows. Shared by the kernels that write rows (head_norm_rope's
// cache store, norm.cuh; attention's own cache write) and those that read them (attention.cuh), so
// neither family reaches into the other for the addressing.
//
// Cache layout: a pool of pages of 2^page_shift positions, shared by every sequence slot:
//   k, v     [num_pages * page_size][num_kv_heads][head_dim]  bf16
//   index_k  [num_pages * page_size][index_head_dim]          bf16 (sparse layers only)
// Position p of slot s is pool row page_table[s * pages_per_seq + (p >> page_shift)] * page_size +
// (p & (page_size - 1)) (PageMap::row). The page table lives in device memory and is read at run
// time, so a recorded step replays for any page assignment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// Host and device (the row arithmetic is the same on both); plain inline for the host compiler.
#ifdef __CUDACC__
#define TPMOE_KV_HD __host__ __device__ __forceinline__
#else
#define TPMOE_KV_HD inline
#endif

namespace tpmoe::cuda {

// Where a slot's positions live in the paged pool.
struct PageMap {
  const int32_t* table = nullptr;  // [max_seqs][pages_per_seq], device memory
  int shift = 0;                   // log2(page size)
  int pages_per_seq = 0;
  TPMOE_KV_HD const int32_t* slot_pages(int slot) const { return table + size_t(slot) * pages_per_seq; }
  // Pool row of `position` of the slot whose pages are `pages` (slot_pages: a loop over one slot's
  // keys looks its page row up once).
  TPMOE_KV_HD static size_t row(const int32_t* pages, int shift, int position) {
    return (size_t(pages[position >> shift]) << shift) | size_t(position & ((1 << shift) - 1));
  }
  TPMOE_KV_HD size_t row(int slot, int position) const { return row(slot_pages(slot), shift, position); }
};

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
  PageMap pages() const { return {page_table, page_shift, pages_per_seq}; }
};

}  // namespace tpmoe::cuda
