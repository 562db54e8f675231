// Host side of sampling: parameter validation, seeds, the per-step SampleBatch, stop checks and the
// StopMatcher (sampling.h says how a generation loop uses them).
#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "core/error.h"

namespace tpmoe {

void SamplingParams::validate(int vocab_size) const {
  TPMOE_CHECK(std::isfinite(temperature) && temperature >= 0,
              "sampling: temperature must be a finite number >= 0 (0: greedy), got {}", temperature);
  TPMOE_CHECK(top_k >= -1, "sampling: top_k must be -1 or 0 (off) or a positive count, got {}", top_k);
  TPMOE_CHECK(std::isfinite(top_p) && top_p > 0 && top_p <= 1, "sampling: top_p must be in (0, 1] (1: off), got {}",
              top_p);
  TPMOE_CHECK(std::isfinite(min_p) && min_p >= 0 && min_p <= 1, "sampling: min_p must be in [0, 1] (0: off), got {}",
              min_p);
  TPMOE_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0,
              "sampling: repetition_penalty must be a finite number > 0 (1: off), got {}", repetition_penalty);
  TPMOE_CHECK(std::isfinite(presence_penalty) && presence_penalty >= -2 && presence_penalty <= 2,
              "sampling: presence_penalty must be in [-2, 2] (0: off), got {}", presence_penalty);
  TPMOE_CHECK(std::isfinite(frequency_penalty) && frequency_penalty >= -2 && frequency_penalty <= 2,
              "sampling: frequency_penalty must be in [-2, 2] (0: off), got {}", frequency_penalty);
  TPMOE_CHECK(max_tokens >= 1, "sampling: max_tokens must be at least 1, got {}", max_tokens);
  TPMOE_CHECK(stop.size() <= kMaxStopStrings, "sampling: stop strings: {} given, at most {}", stop.size(),
              kMaxStopStrings);
  for (size_t i = 0; i < stop.size(); ++i) TPMOE_CHECK(!stop[i].empty(), "sampling: stop string {} is empty", i);
  TPMOE_CHECK(stop_token_ids.size() <= kMaxStopTokenIds, "sampling: stop token ids: {} given, at most {}",
              stop_token_ids.size(), kMaxStopTokenIds);
  for (int32_t id : stop_token_ids) {
    TPMOE_CHECK(id >= 0, "sampling: stop token id {} is negative", id);
    TPMOE_CHECK(vocab_size <= 0 || id < vocab_size, "sampling: stop token id {} outside the vocabulary (size {})", id,
                vocab_size);
  }
}

uint64_t resolve_seed(const SamplingParams& params) {
  if (params.seed) return *params.seed;
  std::random_device device;
  return (uint64_t(device()) << 32) ^ uint64_t(device());
}

uint64_t sequence_seed(uint64_t request_seed, uint32_t sequence_index) {
  // splitmix64's finaliser over (seed, index): distinct indices give unrelated seeds.
  uint64_t x = request_seed + 0x9e3779b97f4a7c15ull * (uint64_t(sequence_index) + 1);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool plain_greedy(const SamplingParams& params) {
  return params.greedy() && params.repetition_penalty == 1.f && params.presence_penalty == 0.f &&
         params.frequency_penalty == 0.f;
}

SampleRowParams make_sample_row(const SamplingParams& params, uint64_t seed, uint32_t step) {
  SampleRowParams row;
  row.repetition_penalty = params.repetition_penalty;
  row.presence_penalty = params.presence_penalty;
  row.frequency_penalty = params.frequency_penalty;
  row.seed = seed;
  row.step = step;
  if (params.greedy()) return row;  // temperature 0, filters off: the filters cannot change an argmax
  row.temperature = params.temperature;
  row.top_k = params.top_k > 0 ? params.top_k : 0;
  row.top_p = params.top_p;
  row.min_p = params.min_p;
  return row;
}

SequencePenalties::SequencePenalties(const SamplingParams& params, std::span<const int32_t> prompt) {
  const bool repetition = params.repetition_penalty != 1.0f;
  active_ = repetition || params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f;
  if (!repetition) return;  // presence and frequency count generated tokens only
  for (int32_t id : prompt) entries_.push_back({id, 0});
  std::sort(entries_.begin(), entries_.end());
  entries_.erase(std::unique(entries_.begin(), entries_.end()), entries_.end());
}

void SequencePenalties::add_generated(int32_t token) {
  if (!active_) return;
  auto it = std::lower_bound(entries_.begin(), entries_.end(), std::pair<int32_t, int32_t>{token, 0});
  if (it != entries_.end() && it->first == token)
    ++it->second;
  else
    entries_.insert(it, {token, 1});
}

void SampleBatchBuilder::add_row(const SamplingParams& params, uint64_t seed, uint32_t step,
                                 const SequencePenalties& penalties) {
  if (batch_.penalty_offsets.empty()) batch_.penalty_offsets.assign(batch_.rows.size() + 1, 0);
  batch_.rows.push_back(make_sample_row(params, seed, step));
  if (penalties.active()) {
    for (const auto& [id, count] : penalties.entries()) {
      batch_.penalty_token_ids.push_back(id);
      batch_.penalty_counts.push_back(count);
    }
  }
  batch_.penalty_offsets.push_back(int32_t(batch_.penalty_token_ids.size()));
}

void SampleBatchBuilder::add_greedy_row() {
  if (batch_.penalty_offsets.empty()) batch_.penalty_offsets.assign(batch_.rows.size() + 1, 0);
  batch_.rows.push_back(SampleRowParams{});
  batch_.penalty_offsets.push_back(int32_t(batch_.penalty_token_ids.size()));
}

// ---- stopping --------------------------------------------------------------------------------------

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStopToken:
    case FinishReason::kEos:
    case FinishReason::kStopString: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kNone: return "";
  }
  return "";
}

FinishReason check_token_stop(const SamplingParams& params, int32_t token, std::span<const int32_t> eos_ids,
                              int num_generated) {
  if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) != params.stop_token_ids.end())
    return FinishReason::kStopToken;
  if (!params.ignore_eos && std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end())
    return FinishReason::kEos;
  if (num_generated >= params.max_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)), matched_len_(stops_.size(), 0) {
  for (size_t i = 0; i < stops_.size(); ++i) TPMOE_CHECK(!stops_[i].empty(), "stop string {} is empty", i);
  // Each stop string's failure function (Knuth-Morris-Pratt): border_[offset_[i] + q] is the
  // length of the longest proper prefix of its first q + 1 bytes that is also their suffix.
  offset_.resize(stops_.size());
  for (size_t i = 0; i < stops_.size(); ++i) {
    const std::string& s = stops_[i];
    offset_[i] = border_.size();
    border_.resize(border_.size() + s.size(), 0);
    uint32_t* b = border_.data() + offset_[i];
    for (size_t q = 1, k = 0; q < s.size(); ++q) {
      while (k > 0 && s[q] != s[k]) k = b[k - 1];
      if (s[q] == s[k]) ++k;
      b[q] = uint32_t(k);
    }
  }
}

std::string StopMatcher::feed(std::string_view piece) {
  if (stopped_) return {};
  // Invariants: matched_len_[i] is the longest prefix of stop i that ends the text so far (never
  // the whole of it), no stop string starts in text already emitted, and held_ is the longest tail
  // of the text that some stop string may still complete. So every occurrence that completes in
  // this piece starts in held_ + piece; the earliest-starting one wins (the first listed on a tie).
  // Each byte advances each stop's match once (amortised), so a piece costs its length times the
  // number of stop strings, whatever their lengths.
  const size_t base = held_.size();
  held_.append(piece);
  size_t first = std::string::npos;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const std::string& s = stops_[i];
    const uint32_t* b = border_.data() + offset_[i];
    size_t q = matched_len_[i];
    for (size_t j = 0; j < piece.size(); ++j) {
      while (q > 0 && piece[j] != s[q]) q = b[q - 1];
      if (piece[j] == s[q]) ++q;
      if (q == s.size()) {  // the first occurrence of s: it starts at held_[base + j + 1 - q]
        const size_t at = base + j + 1 - q;
        if (at < first) {
          first = at;
          matched_ = int(i);
        }
        break;
      }
    }
    matched_len_[i] = q;
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string: it may still become
  // one. Everything before it can never be part of a match.
  const size_t keep = matched_len_.empty() ? 0 : *std::max_element(matched_len_.begin(), matched_len_.end());
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace tpmoe
