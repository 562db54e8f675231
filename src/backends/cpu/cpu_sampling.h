// The CPU sampling op (the reference every other backend's sampler must match token for token):
// one row at a time, written plainly with sorts where the CUDA kernel uses radix selection. The
// definitions it implements are in include/tpmoe/sampling.h, the shared arithmetic in
// model/sampling_math.h.
#pragma once

#include <cstdint>

#include "model/sampling_math.h"

namespace tpmoe::cpu {

// What a draw looked like inside, for tests: the row's maximum score, the candidate count, the
// filters' thresholds (order keys; 0 when a filter is off) and the winner's perturbed score.
struct SampleTrace {
  int32_t token = -1;
  bool fell_back_to_argmax = false;  // greedy row, or no finite maximum
  float max_score = 0;
  int32_t num_candidates = 0;
  uint32_t top_k_key = 0, top_p_key = 0;
  uint64_t top_p_total = 0, top_p_target = 0;
  float winner_score = 0;  // score + Gumbel noise of the token drawn
};

// Draws the token of one row logits[vocab] (fp32). penalty ids/counts: the row's entries (sorted,
// distinct, checked by check_sample_batch). scores: scratch of vocab floats.
int32_t sample_row(const float* logits, int64_t vocab, const sampling::SampleRowArgs& args, const int32_t* penalty_ids,
                   const int32_t* penalty_counts, float* scores, SampleTrace* trace = nullptr);

}  // namespace tpmoe::cpu
