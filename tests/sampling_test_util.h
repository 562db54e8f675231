// A SamplingParams from its filter values in vLLM's order, for the sampling tests (CPU and CUDA).
#pragma once

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

}  // namespace tpmoe::test
