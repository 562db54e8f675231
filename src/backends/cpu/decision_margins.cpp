// Decision margins of the CPU oracle (see decision_margins.h).
#include "backends/cpu/decision_margins.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include <fmt/format.h>

#include "core/error.h"

namespace tpmoe::cpu {

const char* decision_kind_name(DecisionKind kind) {
  switch (kind) {
    case DecisionKind::kRouterTopK: return "router top-k";
    case DecisionKind::kIndexerBlocks: return "indexer blocks";
  }
  return "unknown decision";
}

std::optional<TopKBoundary> top_k_boundary(std::span<const float> values, int k) {
  if (k <= 0 || size_t(k) >= values.size()) return std::nullopt;
  std::vector<float> sorted(values.begin(), values.end());
  std::partial_sort(sorted.begin(), sorted.begin() + k + 1, sorted.end(), std::greater<float>());
  TopKBoundary b;
  b.kept = sorted[size_t(k) - 1];
  b.dropped = sorted[size_t(k)];
  const double gap = double(b.kept) - double(b.dropped);
  const double scale = b.kept != 0.f ? std::fabs(double(b.kept)) : std::fabs(double(b.dropped));
  b.relative = gap == 0 ? 0.0 : gap / scale;
  return b;
}

std::vector<float> indexer_block_scores(const float* scores, int pos, int block_size, int local_blocks) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int num_blocks = pos / block_size + 1;  // blocks holding a key <= pos
  std::vector<float> block_score(size_t(num_blocks), -kInf);
  for (int t = 0; t <= pos; ++t) block_score[t / block_size] = std::max(block_score[t / block_size], scores[t]);
  for (int j = 0; j < local_blocks; ++j) block_score[std::max(0, pos / block_size - j)] = kInf;
  return block_score;
}

std::optional<TopKBoundary> indexer_block_boundary(std::span<const float> block_scores, int topk_blocks) {
  std::vector<float> finite;
  int forced = 0;  // +inf local blocks: kept whatever the scores say
  for (float s : block_scores) {
    if (std::isfinite(s))
      finite.push_back(s);
    else if (s > 0)
      ++forced;
  }
  return top_k_boundary(finite, topk_blocks - forced);
}

std::string Decision::describe() const {
  std::string s = fmt::format("{:.3g}% (layer {} {}", boundary.relative * 100.0, layer, decision_kind_name(kind));
  if (kind == DecisionKind::kIndexerBlocks) s += fmt::format(", index head {}", head);
  return s + ")";
}

const Decision* TokenDecisions::smallest() const {
  const auto it = std::min_element(decisions.begin(), decisions.end(), [](const Decision& a, const Decision& b) {
    return a.boundary.relative < b.boundary.relative;
  });
  return it == decisions.end() ? nullptr : &*it;
}

void DecisionRecorder::begin_step(const StepTokens& step) {
  std::vector<TokenDecisions> rows(static_cast<size_t>(step.num_tokens()));
  for (int t = 0; t < step.num_tokens(); ++t) {
    rows[t].seq_slot = step.seq_slots[t];
    rows[t].position = step.positions[t];
  }
  steps_.push_back(std::move(rows));
}

void DecisionRecorder::record(int token, const Decision& decision) {
  TPMOE_CHECK(!steps_.empty(), "decision recorder: a decision was recorded before any step began");
  auto& rows = steps_.back();
  TPMOE_CHECK(token >= 0 && token < int(rows.size()), "decision recorder: token row {} outside the step's {} rows",
              token, rows.size());
  rows[token].decisions.push_back(decision);
}

const TokenDecisions* DecisionRecorder::find(int seq_slot, int position) const {
  for (auto step = steps_.rbegin(); step != steps_.rend(); ++step)
    for (const auto& row : *step)
      if (row.seq_slot == seq_slot && row.position == position) return &row;
  return nullptr;
}

}  // namespace tpmoe::cpu
