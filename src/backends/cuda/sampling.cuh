// The sampling op on the GPU: penalties, temperature, top-k, top-p, min-p and the Gumbel-max draw
// of each row of fp32 logits, with no copy of the logits to the host. Token for token the CPU op's
// result (backends/cpu/cpu_sampling.cpp): both run model/sampling_math.h's exact arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "model/sampling_math.h"

namespace tpmoe::cuda {

struct SampleKernelParams {
  const float* logits = nullptr;  // [rows, vocab]
  int rows = 0;
  int vocab = 0;                                      // <= 2^21
  const sampling::SampleRowArgs* row_args = nullptr;  // [rows], device memory
  // The rows' penalty entries (device memory): row r's are [row_args[r].penalty_begin, _end),
  // token ids strictly increasing (check_sample_batch has checked them).
  const int32_t* penalty_ids = nullptr;
  const int32_t* penalty_counts = nullptr;
  int32_t* ids = nullptr;  // [rows] out
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Per-chunk winners, candidate counts and the candidate lists (8 bytes per logit in the worst case).
size_t sample_workspace_bytes(int rows, int vocab);
void launch_sample(const SampleKernelParams& p, cudaStream_t stream);

}  // namespace tpmoe::cuda
