#include "model/sample_batch.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace tpmoe {

sampling::SampleRowArgs make_sample_row_args(const SampleRowParams& row, int32_t penalty_begin, int32_t penalty_end) {
  sampling::SampleRowArgs a{};
  a.greedy = row.temperature < kGreedyTemperature;
  a.temperature = a.greedy ? 1.0f : row.temperature;
  a.top_k = a.greedy || row.top_k <= 0 ? 0 : row.top_k;
  a.top_p = a.greedy ? 1.0f : row.top_p;
  // min-p keeps p_i >= min_p * p_max, i.e. score - max >= log(min_p): one host log, so every
  // backend compares against the same float.
  a.log_min_p =
      a.greedy || row.min_p <= 0 ? -std::numeric_limits<float>::infinity() : float(std::log(double(row.min_p)));
  a.repetition_penalty = row.repetition_penalty;
  a.presence_penalty = row.presence_penalty;
  a.frequency_penalty = row.frequency_penalty;
  a.step = row.step;
  a.seed_lo = uint32_t(row.seed);
  a.seed_hi = uint32_t(row.seed >> 32);
  a.penalty_begin = penalty_begin;
  a.penalty_end = penalty_end;
  return a;
}

std::vector<sampling::SampleRowArgs> check_sample_batch(const SampleBatch& batch, int64_t rows, int64_t vocab) {
  TPMOE_CHECK(int64_t(batch.rows.size()) == rows, "sample: {} rows of sampling parameters for {} logit rows",
              batch.rows.size(), rows);
  // Top-p sums at most vocab weights of up to 2^32 in 64-bit integers that must stay exact as doubles.
  TPMOE_CHECK(vocab >= 1 && vocab <= (int64_t(1) << 21), "sample: vocabulary size {} outside [1, 2^21]", vocab);
  const bool any_penalty_entries = !batch.penalty_offsets.empty();
  if (any_penalty_entries) {
    TPMOE_CHECK(int64_t(batch.penalty_offsets.size()) == rows + 1, "sample: {} penalty offsets for {} rows (need {})",
                batch.penalty_offsets.size(), rows, rows + 1);
    TPMOE_CHECK(
        batch.penalty_offsets.front() == 0 && size_t(batch.penalty_offsets.back()) == batch.penalty_token_ids.size(),
        "sample: penalty offsets must run from 0 to the {} entries", batch.penalty_token_ids.size());
    TPMOE_CHECK(batch.penalty_counts.size() == batch.penalty_token_ids.size(),
                "sample: {} penalty counts for {} penalty token ids", batch.penalty_counts.size(),
                batch.penalty_token_ids.size());
  } else {
    TPMOE_CHECK(batch.penalty_token_ids.empty() && batch.penalty_counts.empty(),
                "sample: penalty entries without penalty offsets");
  }
  std::vector<sampling::SampleRowArgs> args(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const SampleRowParams& p = batch.rows[r];
    TPMOE_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "sample: row {}: temperature {}", r, p.temperature);
    TPMOE_CHECK(std::isfinite(p.top_p) && p.top_p > 0 && p.top_p <= 1, "sample: row {}: top_p {} outside (0, 1]", r,
                p.top_p);
    TPMOE_CHECK(std::isfinite(p.min_p) && p.min_p >= 0 && p.min_p <= 1, "sample: row {}: min_p {} outside [0, 1]", r,
                p.min_p);
    TPMOE_CHECK(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0,
                "sample: row {}: repetition_penalty {} must be > 0", r, p.repetition_penalty);
    TPMOE_CHECK(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty),
                "sample: row {}: presence/frequency penalties must be finite", r);
    int32_t begin = 0, end = 0;
    if (any_penalty_entries) {
      begin = batch.penalty_offsets[r];
      end = batch.penalty_offsets[r + 1];
      TPMOE_CHECK(begin <= end, "sample: penalty offsets decrease at row {}", r);
      for (int32_t e = begin; e < end; ++e) {
        const int32_t id = batch.penalty_token_ids[e];
        TPMOE_CHECK(id >= 0 && id < vocab, "sample: row {}: penalty token id {} outside the vocabulary (size {})", r,
                    id, vocab);
        TPMOE_CHECK(e == begin || batch.penalty_token_ids[e - 1] < id,
                    "sample: row {}: penalty token ids must be strictly increasing ({} after {})", r, id,
                    batch.penalty_token_ids[e - 1]);
        TPMOE_CHECK(batch.penalty_counts[e] >= 0, "sample: row {}: penalty count {} of token {} is negative", r,
                    batch.penalty_counts[e], id);
      }
    }
    args[r] = make_sample_row_args(p, begin, end);
  }
  return args;
}

// ---- penalties -------------------------------------------------------------------------------------

}  // namespace tpmoe
