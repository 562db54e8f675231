// The host side of sampling: seeds, what the penalties need per step (SequencePenalties and the
// SampleBatchBuilder that fills the sampling op's SampleBatch), stop-token checks and the
// StopMatcher that cuts streamed text at a stop string. The draw itself is the Ops::sample op
// (CPU: backends/cpu/cpu_sampling.cpp, CUDA: backends/cuda/sampling.cu), whose arithmetic is
// shared in model/sampling_math.h.
//
// A generation loop, per request (one SamplingParams, possibly several sequences):
//   params.validate(vocab);  uint64_t seed = resolve_seed(params);   // once, before the ranks start
//   per sequence b: SequencePenalties pen_b(params, prompt_b);  StopMatcher stop_b(params.stop);
//   per step: SampleBatchBuilder builder;
//             for each logit row r (sequence b, n_b tokens generated so far):
//               builder.add_row(params, sequence_seed(seed, b), n_b, pen_b);
//             (padding rows: builder.add_greedy_row());
//             ops.sample(logits, builder.batch(), ids);  ids_to_host(ids)
//             per sequence: token t -> pen_b.add_generated(t);
//               finish = check_token_stop(params, t, eos_ids, n_b + 1);
//               text = stop_b.feed(detokenized piece of t)  (emit it; stop_b.stopped() ends it);
//               at the end (length, EOS): emit stop_b.flush().
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/ops.h"
#include "model/sample_batch.h"
#include "tpmoe/sampling.h"

namespace tpmoe {

// The request's seed, or (unset) one drawn from the host's random device: call once per request
// on the host and hand the result to every rank, so tensor-parallel ranks draw the same tokens.
uint64_t resolve_seed(const SamplingParams& params);

// The seed of the sequence_index-th sequence of a request: sequences sharing one SamplingParams
// (and one prompt) must not draw the same noise. sequence_seed(s, 0) != s on purpose: one mixing
// function for every sequence.
uint64_t sequence_seed(uint64_t request_seed, uint32_t sequence_index);

// Greedy with no penalty: the next token is the argmax of the raw logits, which a vocab-parallel
// lm_head finds without gathering whole rows (next_tokens.h).
bool plain_greedy(const SamplingParams& params);

// The op's row from validated params (greedy rows: temperature 1, filters off).
SampleRowParams make_sample_row(const SamplingParams& params, uint64_t seed, uint32_t step);

// What one sequence has seen, kept sorted by token id: prompt tokens (only when the repetition
// penalty needs them) and the times each token was generated.
class SequencePenalties {
 public:
  SequencePenalties(const SamplingParams& params, std::span<const int32_t> prompt);
  void add_generated(int32_t token);
  bool active() const { return active_; }
  // (token id, times generated) pairs, ids strictly increasing.
  const std::vector<std::pair<int32_t, int32_t>>& entries() const { return entries_; }

 private:
  bool active_ = false;
  std::vector<std::pair<int32_t, int32_t>> entries_;
};

// Builds the SampleBatch of one step, row by row in logit-row order.
class SampleBatchBuilder {
 public:
  void add_row(const SamplingParams& params, uint64_t seed, uint32_t step, const SequencePenalties& penalties);
  void add_greedy_row();  // padding rows of a recorded decode step
  const SampleBatch& batch() const { return batch_; }

 private:
  SampleBatch batch_;
};

// Why a sequence ends.
enum class FinishReason { kNone, kStopToken, kEos, kStopString, kLength };
const char* finish_reason_name(FinishReason reason);  // "stop" / "length" / "" as the OpenAI API

// After `token` was generated as the sequence's num_generated-th token: a stop token id (kStopToken),
// one of the model's EOS ids unless ignore_eos (kEos), max_tokens reached (kLength), or kNone. As in
// vLLM the stopping token itself is part of the generated ids; whether its text is shown is the
// detokenizer's choice (EOS is a special token and normally is not).
FinishReason check_token_stop(const SamplingParams& params, int32_t token, std::span<const int32_t> eos_ids,
                              int num_generated);

// Cuts streamed text at the first stop string. feed() takes each decoded piece and returns the
// text that is now safe to emit: everything before a stop string, minus a tail that could still be
// the start of one (held back until the next piece decides it). Once a stop string is complete,
// stopped() is true, the text before it has been returned, and the stop string and all later text
// are dropped. flush() returns the held-back tail when generation ends for another reason.
// Matching is on bytes (UTF-8 in, UTF-8 out: a stop string starts on a character boundary, so the
// cut is on one too); the earliest-starting stop string wins. Each stop string is matched as a
// Knuth-Morris-Pratt automaton, so a piece costs its length times the number of stop strings
// (SamplingParams::validate bounds that number), not their lengths: a long stop string against a
// stream that keeps almost matching it stays linear.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string feed(std::string_view piece);
  std::string flush();
  bool stopped() const { return stopped_; }
  // Index into the stop strings of the one that matched (-1 until stopped).
  int matched() const { return matched_; }
  size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::vector<size_t> matched_len_;  // per stop: its longest prefix that ends the text so far
  std::vector<size_t> offset_;       // per stop: where its failure function starts in border_
  std::vector<uint32_t> border_;     // the stops' failure functions, back to back
  std::string held_;
  bool stopped_ = false;
  int matched_ = -1;
};

}  // namespace tpmoe
