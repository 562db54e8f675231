// A SamplingParams from its filter values in vLLM's order, for the sampling tests (CPU and CUDA).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tpmoe/sampling.h"

namespace tpmoe::test {

inline SamplingParams sampling_params(float temperature, int top_k = 0, float top_p = 1, float min_p = 0,
                                      float repetition = 1, float presence = 0, float frequency = 0) {
  SamplingParams sp;
  sp.temperature = temperature;
  sp.top_k = top_k;
  sp.top_p = top_p;
  sp.min_p = min_p;
  sp.repetition_penalty = repetition;
  sp.presence_penalty = presence;
  sp.frequency_penalty = frequency;
  return sp;
}

// A vocab-parallel step's greedy winners as its ranks gather them: rows of logits[R][ranks * slice]
// cut into `ranks` slices, each rank's first maximum (NaN first, as torch.argmax) laid out as
// [rank][local ids R | value bits R], and the argmax of each whole row, which combining them must
// give. Some rows are made hard: a maximum tied across ranks, NaNs in two ranks, a row of -inf.
struct GatheredWinners {
  std::vector<int32_t> gathered, want;
};

inline GatheredWinners gathered_winners(std::vector<float> logits, int R, int ranks, int slice) {
  const int V = ranks * slice;
  const float inf = std::numeric_limits<float>::infinity();
  if (R > 3 && ranks > 3) {
    logits[size_t(1 * V + 3 * slice + 7)] = logits[size_t(1 * V + 1 * slice + 9)] = 100.f;      // rank 1 wins
    logits[size_t(2 * V + 3 * slice)] = logits[size_t(2 * V + 2 * slice + 5)] = std::nanf("");  // rank 2's NaN
    for (int v = 0; v < V; ++v) logits[size_t(3 * V + v)] = -inf;                               // id 0
  }
  auto first_max = [&](int r, int begin, int end) {
    int best = begin;
    for (int v = begin + 1; v < end; ++v) {
      const float x = logits[size_t(r * V + v)], b = logits[size_t(r * V + best)];
      if (!std::isnan(b) && (std::isnan(x) || x > b)) best = v;
    }
    return best;
  };
  GatheredWinners w;
  w.gathered.resize(size_t(2 * ranks * R));
  for (int q = 0; q < ranks; ++q)
    for (int r = 0; r < R; ++r) {
      const int best = first_max(r, q * slice, (q + 1) * slice);
      w.gathered[size_t(2 * q * R + r)] = best - q * slice;
      w.gathered[size_t((2 * q + 1) * R + r)] = std::bit_cast<int32_t>(logits[size_t(r * V + best)]);
    }
  for (int r = 0; r < R; ++r) w.want.push_back(first_max(r, 0, V));
  return w;
}

}  // namespace tpmoe::test
