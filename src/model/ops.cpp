#include "model/ops.h"

#include <unordered_map>

#include "core/error.h"

namespace tpmoe {

void CacheShape::validate() const {
  TPMOE_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0, "KV cache: page size {} is not a power of two",
              page_size);
  TPMOE_CHECK(max_seqs > 0 && max_len > 0 && num_pages > 0,
              "KV cache: {} slots of {} positions in {} pages: none may be zero", max_seqs, max_len, num_pages);
  TPMOE_CHECK(int(sparse_layer.size()) == num_layers, "KV cache: {} sparse-layer flags for {} layers",
              sparse_layer.size(), num_layers);
}

void check_step_fits_cache(const StepTokens& step, const CacheShape& cache) {
  const int pps = cache.pages_per_seq();
  TPMOE_CHECK(step.page_table.empty() ||
                  (step.page_table.size() % pps == 0 && step.page_table.size() <= size_t(cache.max_seqs) * pps),
              "page table of {} entries: not whole rows of {} pages for at most {} slots", step.page_table.size(), pps,
              cache.max_seqs);
  const int table_rows = step.page_table.empty() ? cache.max_seqs : int(step.page_table.size() / pps);
  TPMOE_CHECK(!step.page_table.empty() || int64_t(cache.max_seqs) * pps <= cache.num_pages,
              "no page table, but the pool's {} pages cannot hold {} slots x {} pages", cache.num_pages, cache.max_seqs,
              pps);
  for (int32_t page : step.page_table)
    TPMOE_CHECK(page >= -1 && page < cache.num_pages, "page table entry {} outside the pool of {} pages", page,
                cache.num_pages);
  for (int t = 0; t < step.num_tokens(); ++t) {
    const int slot = step.seq_slots[t], pos = step.positions[t];
    TPMOE_CHECK(slot >= 0 && slot < table_rows, "sequence slot {} outside the page table's {} slots", slot, table_rows);
    TPMOE_CHECK(pos >= 0 && pos < cache.max_len, "position {} does not fit the KV cache ({} positions per sequence)",
                pos, cache.max_len);
    TPMOE_CHECK(cache.row(step.page_table, slot, pos) >= 0, "slot {} has no KV-cache page for position {}", slot, pos);
  }
}

bool step_keeps_earlier_keys(const StepTokens& step, const CacheShape& cache) {
  std::unordered_map<int32_t, int32_t> position_of;  // slot -> the one position its tokens have
  for (int t = 0; t < step.num_tokens(); ++t) {
    const auto [at, fresh] = position_of.emplace(step.seq_slots[t], step.positions[t]);
    if (!fresh && at->second != step.positions[t]) return false;
  }
  if (step.page_table.empty()) return true;  // slot s holds pages of its own
  // Each written page must appear once in the table: its own slot's entry for that position.
  const int pps = cache.pages_per_seq();
  std::unordered_map<int32_t, int> references;  // written page -> entries of the table naming it
  for (const auto& [slot, pos] : position_of) {
    const size_t entry = size_t(slot) * size_t(pps) + size_t(pos / cache.page_size);
    if (entry >= step.page_table.size()) return false;
    references.emplace(step.page_table[entry], 0);
  }
  for (int32_t page : step.page_table)
    if (auto it = references.find(page); it != references.end()) ++it->second;
  for (const auto& [page, count] : references)
    if (count != 1) return false;
  return true;
}

}  // namespace tpmoe
