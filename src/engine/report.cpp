#include "engine/report.h"

#include <fmt/format.h>

#include <cmath>

namespace tpmoe {

std::string describe_config(const ModelConfig& c) {
  int sparse = 0, moe = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    sparse += c.layer_types[l] == AttentionType::kSparse;
    moe += c.mlp_layer_types[l] == MlpType::kMoe;
  }
  std::string s = fmt::format(
      "model: {} layers ({} sparse attention, {} MoE), hidden {}, vocab {}\n"
      "  attention: {} q heads, {} kv heads, head_dim {}, rotary_dim {}, rope_theta {}\n",
      c.num_layers, sparse, moe, c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim,
      c.rope_theta);
  if (moe)
    s += fmt::format("  moe: {} experts, top-{}, intermediate {}, {} shared of {}, routed_scaling_factor {}\n",
                     c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.num_shared_experts,
                     c.shared_intermediate_size, c.routed_scaling_factor);
  if (moe < c.num_layers) s += fmt::format("  dense mlp: intermediate {}\n", c.dense_intermediate_size);
  if (sparse)
    s += fmt::format("  indexer: {} heads x {}, blocks of {}, top {} blocks, {} local\n", c.index_n_heads,
                     c.index_head_dim, c.index_block_size, c.index_topk_blocks, c.index_local_blocks);
  return s;
}

size_t rank_weight_bytes(const ModelConfig& c, const RankShard& s, const FusionPlan& plan, DType matrix_dtype) {
  const size_t m = dtype_size(matrix_dtype), f = sizeof(float);
  const size_t H = size_t(c.hidden_size), hd = size_t(c.head_dim), ihd = size_t(c.index_head_dim);
  // embed_tokens and lm_head (a tied head is stored twice: each is laid out for its own op), final norm
  size_t bytes = 2 * size_t(c.vocab_size) * H * m + H * f;
  for (int l = 0; l < c.num_layers; ++l) {
    bytes += 2 * H * f;                                                                           // layer norms
    bytes += (2 * size_t(s.num_q_heads) + 2 * size_t(s.num_kv_heads)) * hd * H * m + 2 * hd * f;  // q, k, v, o
    if (c.layer_types[l] == AttentionType::kSparse)
      bytes += (size_t(s.num_index_heads) + 1) * ihd * H * m + 2 * ihd * f;
    if (c.mlp_layer_types[l] == MlpType::kDense) {
      bytes += 3 * size_t(s.dense_inter) * H * m;
      continue;
    }
    bytes += size_t(c.num_experts) * H * m + size_t(c.num_experts) * f;  // router, bias
    bytes += size_t(plan.shared_expert.physical_rows) * 3 * size_t(s.moe_inter) * H * m;
    if (!plan.shared_expert.fused) bytes += size_t(c.num_shared_experts) * 3 * size_t(s.shared_inter) * H * m;
  }
  return bytes;
}

double expected_distinct_experts(const ModelConfig& c, int batch) {
  const double E = c.num_experts, k = c.num_experts_per_tok;
  return E * (1.0 - std::pow(1.0 - k / E, batch));
}

double decode_weight_bytes(const ModelConfig& c, const RankShard& s, const FusionPlan& plan, int batch,
                           DType matrix_dtype) {
  const double m = double(dtype_size(matrix_dtype)), H = c.hidden_size;
  // Everything the rank holds, minus what a step does not read: the embedding table but for the
  // batch's rows, and the routed experts it does not route to.
  double bytes = double(rank_weight_bytes(c, s, plan, matrix_dtype));
  bytes -= double(c.vocab_size) * H * m - batch * H * m;
  const double expert_bytes = 3.0 * s.moe_inter * H * m;
  for (int l = 0; l < c.num_layers; ++l)
    if (c.mlp_layer_types[l] == MlpType::kMoe)
      bytes -= (c.num_experts - expected_distinct_experts(c, batch)) * expert_bytes;
  return bytes;
}

size_t rank_kv_bytes_per_token(const ModelConfig& c, const RankShard& s, DType cache_dtype) {
  size_t elems = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    elems += 2 * size_t(s.num_kv_heads) * size_t(c.head_dim);
    if (c.layer_types[l] == AttentionType::kSparse) elems += size_t(c.index_head_dim);
  }
  return elems * dtype_size(cache_dtype);
}

}  // namespace tpmoe
