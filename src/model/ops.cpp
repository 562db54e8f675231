#include "model/ops.h"

#include <algorithm>
#include <utility>

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

bool step_keeps_earlier_keys(const StepTokens& step, const CacheShape& cache, EarlierKeysScratch& scratch) {
  // The step's sequences: (slot, position), one position a slot.
  std::vector<std::pair<int32_t, int32_t>>& seqs = scratch.seqs;
  seqs.resize(size_t(step.num_tokens()));
  for (size_t t = 0; t < seqs.size(); ++t) seqs[t] = {step.seq_slots[t], step.positions[t]};
  std::sort(seqs.begin(), seqs.end());
  seqs.erase(std::unique(seqs.begin(), seqs.end()), seqs.end());
  for (size_t i = 1; i < seqs.size(); ++i)
    if (seqs[i].first == seqs[i - 1].first) return false;
  if (step.page_table.empty()) return true;  // slot s holds pages of its own
  std::vector<int32_t>& page_writer = scratch.page_writer;
  TPMOE_CHECK(page_writer.size() == size_t(cache.num_pages),
              "internal: step_keeps_earlier_keys needs one scratch entry a page ({}), got {}", cache.num_pages,
              page_writer.size());
  const int64_t pps = cache.pages_per_seq();
  auto page = [&](int32_t slot, int32_t index) -> int32_t {  // -1: none (or outside the table or the pool)
    const int64_t entry = int64_t(slot) * pps + index;
    if (slot < 0 || index < 0 || entry >= int64_t(step.page_table.size())) return -1;
    const int32_t p = step.page_table[size_t(entry)];
    return p < cache.num_pages ? p : -1;
  };
  // Each written page gets its writer's slot; a page two slots write is shared.
  bool keeps = true;
  size_t marked = 0;
  for (; marked < seqs.size(); ++marked) {
    const auto [slot, pos] = seqs[marked];
    const int32_t w = page(slot, pos / cache.page_size);
    if (w < 0 || (page_writer[size_t(w)] != -1 && page_writer[size_t(w)] != slot)) {
      keeps = false;
      break;
    }
    page_writer[size_t(w)] = slot;
  }
  // Below its position a sequence may hold a written page only as its own current one.
  for (size_t i = 0; keeps && i < marked; ++i) {
    const auto [slot, pos] = seqs[i];
    const int32_t current = pos / cache.page_size;
    for (int32_t index = 0; keeps && index <= current; ++index) {
      const int32_t p = page(slot, index);
      if (p >= 0 && page_writer[size_t(p)] != -1 && (page_writer[size_t(p)] != slot || index != current)) keeps = false;
    }
  }
  for (size_t i = 0; i < marked; ++i) page_writer[size_t(page(seqs[i].first, seqs[i].second / cache.page_size))] = -1;
  return keeps;
}

}  // namespace tpmoe
