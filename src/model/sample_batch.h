// The sampling op's arguments (Ops::sample, model/ops.h) checked once and turned into the per-row
// arguments both backends' kernels read: the CPU oracle (backends/cpu/cpu_sampling.cpp) and the
// CUDA kernels (backends/cuda/sampling.cu) share this, and the arithmetic in sampling_math.h.
#pragma once

#include <cstdint>
#include <vector>

#include "model/ops.h"
#include "model/sampling_math.h"
#include "tpmoe/sampling.h"

namespace tpmoe {

sampling::SampleRowArgs make_sample_row_args(const SampleRowParams& row, int32_t penalty_begin, int32_t penalty_end);

// Checks a SampleBatch against the logits it goes with (rows, vocabulary, sorted distinct penalty
// ids inside the vocabulary, counts >= 0, sane parameters); throws naming the row and field. Both
// backends call it before any work, and build their row args with it.
std::vector<sampling::SampleRowArgs> check_sample_batch(const SampleBatch& batch, int64_t rows, int64_t vocab);

}  // namespace tpmoe
