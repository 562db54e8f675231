#include "model/weights.h"

#include <cstring>

#include "core/error.h"
#include "model/weight_table.h"

namespace tpmoe {

DType weight_storage_dtype(DType d) { return d == DType::kBF16 ? DType::kBF16 : DType::kF32; }

namespace {

// Converts `count` elements of `src` (dtype `from`) into `dst` (dtype `to`, bf16 or fp32).
void convert(const std::byte* src, DType from, std::byte* dst, DType to, int64_t count) {
  if (from == to) {
    std::memcpy(dst, src, size_t(count) * dtype_size(from));
    return;
  }
  TPMOE_CHECK(to == DType::kF32, "internal: cannot convert {} to {}", dtype_name(from), dtype_name(to));
  float* out = reinterpret_cast<float*>(dst);
  for (int64_t i = 0; i < count; ++i) {
    uint16_t h;
    if (from == DType::kBF16) {
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    } else if (from == DType::kF16) {
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = f16_to_f32(h);
    } else {
      TPMOE_FAIL("internal: cannot convert {} to {}", dtype_name(from), dtype_name(to));
    }
  }
}

// The checkpoint tensor a piece is, through the accessors that know both layouts.
io::TensorView resolve(const io::Checkpoint& ck, const PieceRef& r) {
  const ModelConfig& c = ck.config();
  const auto shape = piece_shape(c, r);
  const std::string p = fmt::format("layers.{}.", r.layer);
  switch (r.piece) {
    case Piece::kEmbed: return ck.common("embed_tokens.weight", shape);
    case Piece::kLmHead: return ck.lm_head();
    case Piece::kFinalNorm: return ck.common("norm.weight", shape);
    case Piece::kInputNorm: return ck.common(p + "input_layernorm.weight", shape);
    case Piece::kPostAttentionNorm: return ck.common(p + "post_attention_layernorm.weight", shape);
    case Piece::kQProj: return ck.common(p + "self_attn.q_proj.weight", shape);
    case Piece::kKProj: return ck.common(p + "self_attn.k_proj.weight", shape);
    case Piece::kVProj: return ck.common(p + "self_attn.v_proj.weight", shape);
    case Piece::kOProj: return ck.common(p + "self_attn.o_proj.weight", shape);
    case Piece::kQNorm: return ck.common(p + "self_attn.q_norm.weight", shape);
    case Piece::kKNorm: return ck.common(p + "self_attn.k_norm.weight", shape);
    case Piece::kIndexQProj: return ck.indexer(r.layer, "q_proj");
    case Piece::kIndexKProj: return ck.indexer(r.layer, "k_proj");
    case Piece::kIndexQNorm: return ck.indexer(r.layer, "q_norm");
    case Piece::kIndexKNorm: return ck.indexer(r.layer, "k_norm");
    case Piece::kDenseGate: return ck.dense_mlp(r.layer).gate;
    case Piece::kDenseUp: return ck.dense_mlp(r.layer).up;
    case Piece::kDenseDown: return ck.dense_mlp(r.layer).down;
    case Piece::kRouter: return ck.router(r.layer);
    case Piece::kRouterBias: return ck.router_bias(r.layer);
    case Piece::kExpertGate: return ck.routed_expert(r.layer, r.expert).gate;
    case Piece::kExpertUp: return ck.routed_expert(r.layer, r.expert).up;
    case Piece::kExpertDown: return ck.routed_expert(r.layer, r.expert).down;
    case Piece::kSharedGate: return ck.shared_experts(r.layer).gate;
    case Piece::kSharedUp: return ck.shared_experts(r.layer).up;
    case Piece::kSharedDown: return ck.shared_experts(r.layer).down;
  }
  TPMOE_FAIL("internal: unknown weight piece {}", int(r.piece));
}

// Copies `rows` x `cols` elements of view `v` (a [N, K] matrix or an [N] vector) starting at
// (row_begin, col_begin) to `dst`, whose rows are `dst_stride` elements apart, converting to `to`.
void copy_block(const io::TensorView& v, const Block& b, std::byte* dst, int64_t dst_stride, DType to) {
  const int64_t K = v.shape.size() > 1 ? v.shape[1] : 1;
  const size_t es = dtype_size(v.dtype), ds = dtype_size(to);
  if (b.col_begin == 0 && b.cols == K && dst_stride == K) {  // contiguous rows: one conversion
    convert(v.data + b.row_begin * K * es, v.dtype, dst, to, b.rows * K);
    return;
  }
  for (int64_t r = 0; r < b.rows; ++r)
    convert(v.data + ((b.row_begin + r) * K + b.col_begin) * es, v.dtype, dst + r * dst_stride * ds, to, b.cols);
}

}  // namespace

bool shared_expert_format_matches(const io::Checkpoint& ck) {
  const ModelConfig& c = ck.config();
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.mlp_layer_types[l] != MlpType::kMoe || c.num_shared_experts == 0) continue;
    return weight_storage_dtype(ck.routed_expert(l, 0).gate.dtype) ==
           weight_storage_dtype(ck.shared_experts(l).gate.dtype);
  }
  return true;
}

ModelWeights load_rank_weights(const io::Checkpoint& ck, const RankShard& shard, const FusionPlan& plan) {
  ModelWeights w;
  w.layers.resize(size_t(ck.config().num_layers));
  for (const WeightEntry& e : rank_weight_table(ck.config(), shard, plan)) {
    std::vector<io::TensorView> views;
    for (const Block& b : e.blocks) views.push_back(resolve(ck, b.source));
    // Vectors are fp32; a matrix keeps its checkpoint dtype (bf16, or fp32 for anything wider),
    // the same for every block it is stacked from.
    const DType dtype = e.vector ? DType::kF32 : weight_storage_dtype(views[0].dtype);
    for (const auto& v : views)
      TPMOE_CHECK(e.vector || weight_storage_dtype(v.dtype) == dtype, "{}: tensor '{}' is {} but '{}' is {}", v.file,
                  v.name, dtype_name(v.dtype), views[0].name, dtype_name(views[0].dtype));
    int64_t n = 1;
    for (auto d : e.shape) n *= d;
    const size_t bytes = size_t(n) * dtype_size(dtype);
    w.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    w.bytes += bytes;
    std::byte* dst = w.storage.back().get();
    Tensor& t = e.slot(w);
    t = e.shape.size() == 1   ? Tensor::make(dst, dtype, e.shape[0])
        : e.shape.size() == 2 ? Tensor::make(dst, dtype, e.shape[0], e.shape[1])
                              : Tensor::make(dst, dtype, e.shape[0], e.shape[1], e.shape[2]);
    const int64_t row_length = e.shape.back();
    const size_t es = dtype_size(dtype);
    int64_t offset = 0;  // elements (concat_columns: columns) filled so far
    for (size_t i = 0; i < e.blocks.size(); ++i) {
      const Block& b = e.blocks[i];
      if (e.concat_columns) {
        copy_block(views[i], b, dst + offset * es, row_length, dtype);
        offset += b.cols;
      } else {
        copy_block(views[i], b, dst + offset * es, b.cols, dtype);
        offset += b.rows * b.cols;
      }
    }
    TPMOE_CHECK(e.concat_columns ? offset == row_length : offset == n,
                "internal: weight table entry {} fills {} of {} elements", e.name, offset, n);
  }
  return w;
}

}  // namespace tpmoe
