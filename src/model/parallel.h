// How the model is split across ranks (SPEC §4) and which slice of each tensor a rank owns.
//
// This is the one place that knows the TP layout: q heads split; K/V heads split, or replicated
// when tp > num_kv_heads; indexer query heads follow their KV group; every intermediate dimension
// (dense MLP, shared expert, routed experts) split with the gate and up halves split alike; o_proj
// and every down projection row-parallel (so their outputs are partial sums); lm_head split by
// vocabulary rows when tp divides the vocabulary (each rank's logits are a slice, joined by a
// distributed argmax or a gather); the rest, embedding included, replicated.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"

namespace tpmoe {

struct ParallelLayout {
  int tp = 1;
  // Last layer of each pipeline stage (ascending). The final layer always ends a stage; an empty
  // list means one stage. Pipeline execution does not exist yet, but the fusion plan honours it.
  std::vector<int> pp_stage_ends;
  // Layouts the engine does not execute but the plan must treat correctly (SPEC §4).
  bool expert_parallel = false;
  bool sequence_parallel = false;

  bool is_stage_end(int layer, int num_layers) const;
  // Throws, naming the field, when tp does not divide the heads or an intermediate size, or when
  // the stage list is not ascending layer indices.
  void validate(const ModelConfig& config) const;
};

// The slice of each split dimension that one rank owns.
struct RankShard {
  int rank = 0;
  int tp = 1;
  int q_head_begin = 0, num_q_heads = 0;    // global q heads [begin, begin+num)
  int kv_head_begin = 0, num_kv_heads = 0;  // global KV heads (num < nkv/tp only when replicated)
  int index_head_begin = 0, num_index_heads = 0;
  // Intermediate slices [begin, begin + size) of each MLP kind.
  int moe_inter_begin = 0, moe_inter = 0;
  int shared_inter_begin = 0, shared_inter = 0;  // per shared expert
  int dense_inter_begin = 0, dense_inter = 0;
  // lm_head rows (vocabulary entries) [begin, begin + size): vocab-parallel when tp divides the
  // vocabulary, so each rank reads 1/tp of the head per step; the whole vocabulary otherwise.
  int vocab_begin = 0, vocab_size = 0;
  bool vocab_parallel() const { return tp > 1 && vocab_size > 0 && vocab_size * tp == vocab_total; }
  int vocab_total = 0;

  static RankShard make(const ModelConfig& config, const ParallelLayout& layout, int rank);
};

}  // namespace tpmoe
