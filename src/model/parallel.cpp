#include "model/parallel.h"

#include <algorithm>

#include "core/error.h"

namespace tpmoe {

bool ParallelLayout::is_stage_end(int layer, int num_layers) const {
  if (layer == num_layers - 1) return true;
  return std::find(pp_stage_ends.begin(), pp_stage_ends.end(), layer) != pp_stage_ends.end();
}

void ParallelLayout::validate(const ModelConfig& c) const {
  TPMOE_CHECK(tp >= 1, "--tp must be at least 1, got {}", tp);
  TPMOE_CHECK(c.num_heads % tp == 0, "--tp {} does not divide num_attention_heads {}", tp, c.num_heads);
  TPMOE_CHECK(c.num_kv_heads % tp == 0 || tp % c.num_kv_heads == 0,
              "--tp {} and num_key_value_heads {}: one must divide the other (KV heads are split when "
              "tp <= nkv and replicated when tp > nkv)",
              tp, c.num_kv_heads);
  if (c.any_moe()) {
    TPMOE_CHECK(c.moe_intermediate_size % tp == 0, "--tp {} does not divide intermediate_size {}", tp,
                c.moe_intermediate_size);
    if (c.num_shared_experts > 0)
      TPMOE_CHECK(c.shared_intermediate_size % tp == 0, "--tp {} does not divide shared_intermediate_size {}", tp,
                  c.shared_intermediate_size);
  }
  if (std::any_of(c.mlp_layer_types.begin(), c.mlp_layer_types.end(), [](MlpType t) { return t == MlpType::kDense; }))
    TPMOE_CHECK(c.dense_intermediate_size % tp == 0, "--tp {} does not divide dense_intermediate_size {}", tp,
                c.dense_intermediate_size);
  for (size_t i = 0; i < pp_stage_ends.size(); ++i) {
    TPMOE_CHECK(pp_stage_ends[i] >= 0 && pp_stage_ends[i] < c.num_layers,
                "--pp-stages: stage end {} is not a layer index (the model has {} layers)", pp_stage_ends[i],
                c.num_layers);
    TPMOE_CHECK(i == 0 || pp_stage_ends[i] > pp_stage_ends[i - 1],
                "--pp-stages: stage ends must be ascending, got {} after {}", pp_stage_ends[i], pp_stage_ends[i - 1]);
  }
}

RankShard RankShard::make(const ModelConfig& c, const ParallelLayout& layout, int rank) {
  const int tp = layout.tp;
  RankShard s;
  s.rank = rank;
  s.tp = tp;
  s.num_q_heads = c.num_heads / tp;
  s.q_head_begin = rank * s.num_q_heads;
  if (tp <= c.num_kv_heads) {
    s.num_kv_heads = c.num_kv_heads / tp;
    s.kv_head_begin = rank * s.num_kv_heads;
  } else {
    // Replicated: tp / nkv consecutive ranks share one KV head, the one their q heads read.
    s.num_kv_heads = 1;
    s.kv_head_begin = rank / (tp / c.num_kv_heads);
  }
  // nih == nkv (validated by the config): index heads follow their KV group.
  s.num_index_heads = c.any_sparse_attention() ? s.num_kv_heads : 0;
  s.index_head_begin = c.any_sparse_attention() ? s.kv_head_begin : 0;
  s.moe_inter = c.moe_intermediate_size / tp;
  s.moe_inter_begin = rank * s.moe_inter;
  s.shared_inter = c.shared_intermediate_size / tp;
  s.shared_inter_begin = rank * s.shared_inter;
  s.dense_inter = c.dense_intermediate_size / tp;
  s.dense_inter_begin = rank * s.dense_inter;
  s.vocab_total = c.vocab_size;
  const bool split_vocab = tp > 1 && c.vocab_size % tp == 0;
  s.vocab_size = split_vocab ? c.vocab_size / tp : c.vocab_size;
  s.vocab_begin = split_vocab ? rank * s.vocab_size : 0;
  return s;
}

}  // namespace tpmoe
