#include "engine/report.h"

#include <fmt/format.h>

#include <cmath>

#include "model/weight_table.h"

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

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Bytes per element of a table entry as it is held.
double element_bytes(const ModelConfig& c, const WeightEntry& e, DType matrix_dtype, bool mxfp8_kept) {
  if (e.vector) return sizeof(float);
  if (mxfp8_kept && c.quantization.method == QuantMethod::kMxfp8 && preset_mxfp8_quantized(e.blocks.front().source))
    return 1.0 + 1.0 / kMxfp8BlockSize;  // e4m3 + one E8M0 scale per 32
  return double(dtype_size(matrix_dtype));
}

}  // namespace

size_t rank_weight_bytes(const ModelConfig& c, const RankShard& s, const FusionPlan& plan, DType matrix_dtype,
                         bool mxfp8_kept) {
  double bytes = 0;
  for (const WeightEntry& e : rank_weight_table(c, s, plan))
    bytes += double(numel(e.shape)) * element_bytes(c, e, matrix_dtype, mxfp8_kept);
  return size_t(bytes);
}

double expected_distinct_experts(const ModelConfig& c, int batch) {
  const double E = c.num_experts, k = c.num_experts_per_tok;
  return E * (1.0 - std::pow(1.0 - k / E, batch));
}

double decode_weight_bytes(const ModelConfig& c, const RankShard& s, const FusionPlan& plan, int batch,
                           DType matrix_dtype, const std::vector<double>* routed_experts_per_layer, bool mxfp8_kept) {
  double bytes = 0;
  for (const WeightEntry& e : rank_weight_table(c, s, plan)) {
    const double elem = element_bytes(c, e, matrix_dtype, mxfp8_kept);
    const double row = double(numel(e.shape)) / double(e.shape[0]) * elem;  // bytes of one dim-0 row
    switch (e.read) {
      case StepRead::kWhole: bytes += row * double(e.shape[0]); break;
      case StepRead::kTokenRows: bytes += row * double(batch); break;
      case StepRead::kExpertRows: {
        const int layer = e.blocks.front().source.layer;
        const double routed = routed_experts_per_layer ? routed_experts_per_layer->at(size_t(layer))
                                                       : expected_distinct_experts(c, batch);
        bytes += row * (routed + double(e.shape[0] - e.routed_rows));  // fused shared rows: always read
        break;
      }
    }
  }
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
