// The CPU sampling op: penalties and temperature over the full row, the candidates within
// kCandidateCut of the maximum, top-k and top-p thresholds by sorting their order keys, min-p by a
// comparison, then the Gumbel-max draw over what is kept. CpuOps::sample runs it per row (OpenMP).
#include "backends/cpu/cpu_sampling.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/error.h"
#include "model/sample_batch.h"

namespace tpmoe::cpu {

using namespace sampling;

int32_t sample_row(const float* logits, int64_t vocab, const SampleRowArgs& a, const int32_t* penalty_ids,
                   const int32_t* penalty_counts, float* scores, SampleTrace* trace) {
  SampleTrace local;
  SampleTrace& t = trace ? *trace : local;
  t = SampleTrace{};
  for (int64_t i = 0; i < vocab; ++i) scores[i] = row_score(logits[i], -1, a);
  for (int32_t e = 0; e < a.penalty_end - a.penalty_begin; ++e)
    scores[penalty_ids[e]] = row_score(logits[penalty_ids[e]], penalty_counts[e], a);

  float best = scores[0];
  int32_t best_i = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (better(scores[i], int32_t(i), best, best_i)) best = scores[i], best_i = int32_t(i);
  t.max_score = best;
  // Greedy rows, and rows with no finite maximum (all -inf, or a +inf score), take the argmax.
  if (a.greedy || !(best > neg_inf() && best < -neg_inf())) {
    t.fell_back_to_argmax = true;
    return t.token = best_i;
  }

  struct Candidate {
    uint32_t key;
    int32_t index;
    float d;  // score - max
  };
  std::vector<Candidate> cand;
  for (int64_t i = 0; i < vocab; ++i) {
    const float d = sub_rn(scores[i], best);
    if (d >= kCandidateCut) cand.push_back({order_key(scores[i]), int32_t(i), d});
  }
  const int64_t n = int64_t(cand.size());
  t.num_candidates = int32_t(n);
  // Largest first; ties in any order (every threshold is a key, so tie order never matters).
  std::sort(cand.begin(), cand.end(), [](const Candidate& x, const Candidate& y) { return x.key > y.key; });

  // top-k: the k-th largest key (every candidate is above every other token, so k < n suffices).
  if (a.top_k > 0 && a.top_k < n) t.top_k_key = cand[size_t(a.top_k) - 1].key;
  // top-p over what top-k kept: the largest key t whose weight at or above t reaches the target.
  if (a.top_p < 1.0f) {
    uint64_t total = 0;
    for (const auto& c : cand)
      if (c.key >= t.top_k_key) total += top_p_weight(c.d);
    t.top_p_total = total;
    t.top_p_target = top_p_target(a.top_p, total);
    uint64_t cum = 0;
    for (size_t i = 0; i < cand.size() && cand[i].key >= t.top_k_key;) {
      size_t j = i;
      for (; j < cand.size() && cand[j].key == cand[i].key; ++j) cum += top_p_weight(cand[j].d);
      if (cum >= t.top_p_target) {
        t.top_p_key = cand[i].key;
        break;
      }
      i = j;
    }
  }
  const uint32_t threshold = std::max(t.top_k_key, t.top_p_key);
  float win = 0;
  int32_t win_i = -1;
  for (const auto& c : cand) {
    if (c.key < threshold || !(c.d >= a.log_min_p)) continue;
    const float v = add_rn(scores[c.index], gumbel_noise(a, uint32_t(c.index)));
    if (win_i < 0 || v > win || (v == win && c.index < win_i)) win = v, win_i = c.index;
  }
  t.winner_score = win;
  return t.token = win_i;
}

void CpuOps::sample(Tensor logits, const SampleBatch& batch, Tensor ids) {
  TPMOE_CHECK(logits.dtype == DType::kF32 && logits.ndim == 2, "CPU sample: logits must be a 2-d fp32 tensor");
  const int64_t R = logits.dim(0), V = logits.dim(1);
  TPMOE_CHECK(ids.dtype == DType::kI32 && ids.numel() >= R, "CPU sample: ids must be int32 with {} elements", R);
  const std::vector<SampleRowArgs> args = check_sample_batch(batch, R, V);
  const int32_t* pen_ids = batch.penalty_token_ids.data();
  const int32_t* pen_counts = batch.penalty_counts.data();
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(V));
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < R; ++r) {
      const SampleRowArgs& a = args[size_t(r)];
      ids.as<int32_t>()[r] = sample_row(logits.as<const float>() + r * V, V, a, pen_ids + a.penalty_begin,
                                        pen_counts + a.penalty_begin, scores.data());
    }
  }
}

}  // namespace tpmoe::cpu
