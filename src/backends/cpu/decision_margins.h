// Decision margins of the CPU oracle: for every token row of every step, how close each discrete
// choice of the forward came to going the other way. Two kinds of choice exist (SPEC §1): the
// router's top-k in every MoE layer and the lightning indexer's kept blocks in every sparse layer
// and index head. A backend whose arithmetic differs from the oracle's (bf16 storage, another
// summation order) may take the other branch where the margin is smaller than its own error, and
// then that row's logits move by far more than rounding explains. Tests use the margins to tell such
// rows apart from real errors instead of listing them by hand.
//
// The recorder only reads what the ops already computed; it never changes a number (the fixture
// test checks the logits bitwise with and without it).
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/ops.h"

namespace tpmoe::cpu {

enum class DecisionKind {
  kRouterTopK,     // top-k of sigmoid(router logit) + e_score_correction_bias
  kIndexerBlocks,  // top blocks of the lightning indexer's block scores (one index head)
};
const char* decision_kind_name(DecisionKind kind);

// The boundary of a top-k choice: the smallest value kept and the largest value dropped.
struct TopKBoundary {
  float kept = 0;
  float dropped = 0;
  // (kept - dropped) / |kept|: the relative change of either value that would swap them. When
  // kept is exactly 0 the gap is taken relative to |dropped|; a gap of 0 is a tie (margin 0).
  double relative = 0;
};

// The boundary of keeping the k largest of `values`, or nullopt when nothing is dropped (k >= n)
// or nothing is chosen (k <= 0).
std::optional<TopKBoundary> top_k_boundary(std::span<const float> values, int k);

// The lightning indexer's block scores for a query at `pos` (scores[t] for keys t <= pos), exactly
// as select_blocks ranks them: max per block, +inf for the `local_blocks` blocks ending at pos.
std::vector<float> indexer_block_scores(const float* scores, int pos, int block_size, int local_blocks);

// The boundary of the indexer's kept-block choice: among the finite block scores, between the last
// kept and the first dropped. Blocks forced by +inf (local blocks) take kept slots but are not a
// choice; nullopt when every finite block is kept or the forced blocks fill every slot.
std::optional<TopKBoundary> indexer_block_boundary(std::span<const float> block_scores, int topk_blocks);

struct Decision {
  DecisionKind kind = DecisionKind::kRouterTopK;
  int layer = -1;
  int head = -1;  // index head (within the rank) for the indexer; -1 for the router
  TopKBoundary boundary;

  // "0.39% (layer 3 router top-k)"
  std::string describe() const;
};

// Every decision of one token row of one step.
struct TokenDecisions {
  int seq_slot = 0;
  int position = 0;
  std::vector<Decision> decisions;

  // The decision with the smallest relative margin; nullptr when the row made none (a dense,
  // full-attention model, or only short contexts).
  const Decision* smallest() const;
};

// Collects the decisions of every step it sees. CpuOps feeds it when one is attached
// (CpuOps::set_decision_recorder); tests read it afterwards.
class DecisionRecorder {
 public:
  // Starts a new step of step.num_tokens() rows.
  void begin_step(const StepTokens& step);
  // Safe to call concurrently for different token rows of the current step.
  void record(int token, const Decision& decision);

  // One entry per step seen, one TokenDecisions per token row of it.
  const std::vector<std::vector<TokenDecisions>>& steps() const { return steps_; }
  // The row that ran sequence slot `seq_slot` at `position` (the last one when several did), or
  // nullptr when none did.
  const TokenDecisions* find(int seq_slot, int position) const;

 private:
  std::vector<std::vector<TokenDecisions>> steps_;
};

}  // namespace tpmoe::cpu
