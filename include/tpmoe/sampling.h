// Sampling parameters of one generation request: how each next token is chosen from the logits
// and when the sequence stops. The defaults give greedy decoding (the argmax, first maximum on ties,
// as torch.argmax), which is what tpmoe did before sampling existed.
//
// Semantics follow vLLM (and, for the penalties, HF transformers / the OpenAI API):
//   1. penalties on the raw logits, in this order: repetition (over prompt + generated tokens: a
//      positive logit is divided by it, a negative one multiplied), frequency (minus
//      frequency_penalty * times generated), presence (minus presence_penalty once generated);
//   2. temperature: logits / temperature (below kGreedyTemperature: greedy argmax of step 1);
//   3. top-k: keep the tokens whose value is at least the k-th largest (ties at the threshold kept);
//   4. top-p: on the softmax of what top-k kept, keep a token when the probability mass of the
//      tokens strictly more likely than it is below top_p (so ties at the threshold are kept and the
//      most likely token always is);
//   5. min-p: keep a token when its probability is at least min_p times the largest probability;
//   6. draw from the softmax over the kept tokens (Gumbel-max with a counter-based RNG keyed by
//      (seed, the sequence's step, token id): the same seed gives the same tokens on every backend
//      and whatever else shares the batch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tpmoe {

// Temperatures below this are greedy (vLLM's _SAMPLING_EPS): logits / 1e-6 overflows and the draw
// would be the argmax anyway.
inline constexpr float kGreedyTemperature = 1e-5f;

// Bounds on a request's stop conditions, each checked every generated token (OpenAI's API takes up
// to 4 stop strings; these leave room for clients that send more without letting one request make
// every token cost a scan of millions).
inline constexpr size_t kMaxStopStrings = 64;
inline constexpr size_t kMaxStopTokenIds = 1024;

struct SamplingParams {
  float temperature = 0;         // 0: greedy
  int top_k = 0;                 // 0 or -1: off
  float top_p = 1;               // (0, 1]; 1: off
  float min_p = 0;               // [0, 1]; 0: off
  float repetition_penalty = 1;  // > 0; 1: off
  float presence_penalty = 0;    // [-2, 2]; 0: off
  float frequency_penalty = 0;   // [-2, 2]; 0: off
  // Same request + same seed -> same tokens. Unset: a seed is drawn from the host once per request
  // (resolve_seed, src/engine/sampling.h), so the tensor-parallel ranks still agree.
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;        // stop strings: the output ends right before the first one
  std::vector<int32_t> stop_token_ids;  // generating one of these ends the sequence
  bool ignore_eos = false;              // keep going past the model's EOS token
  int max_tokens = 16;                  // new tokens at most

  bool greedy() const { return temperature < kGreedyTemperature; }
  // Throws tpmoe::Error naming the first bad parameter. vocab_size > 0 also checks stop_token_ids.
  void validate(int vocab_size = 0) const;
};

}  // namespace tpmoe
