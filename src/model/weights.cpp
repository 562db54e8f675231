#include "model/weights.h"

#include <cmath>
#include <cstring>

#include "core/error.h"
#include "model/weight_table.h"

namespace tpmoe {

DType weight_storage_dtype(DType d) { return d == DType::kBF16 || d == DType::kF8E4M3 ? d : DType::kF32; }

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

// Where a loader writes one matrix: `data` in `dtype`; for F8 also the scale bytes.
struct Dest {
  std::byte* data = nullptr;
  uint8_t* scale = nullptr;
  DType dtype = DType::kF32;
};

// Elements [c0, c0 + n) of row r of the [N, K] matrix view `v`, written at `d` (advanced past them).
// An MXFP8 source is dequantized (fp32 destination) or copied with its scales (F8 destination: the
// span must lie on 32-element block boundaries, as a tensor-parallel slice of an FP8 weight must).
void copy_row_span(const io::TensorView& v, int64_t r, int64_t c0, int64_t n, Dest& d) {
  const int64_t K = v.shape.back();
  const size_t es = dtype_size(v.dtype);
  if (v.dtype != DType::kF8E4M3) {
    convert(v.data + size_t(r * K + c0) * es, v.dtype, d.data, d.dtype, n);
    d.data += size_t(n) * dtype_size(d.dtype);
    return;
  }
  const auto* q = reinterpret_cast<const uint8_t*>(v.data) + r * K;
  const auto* s = reinterpret_cast<const uint8_t*>(v.scale) + r * (K / kMxfp8BlockSize);
  for (int64_t b = c0 / kMxfp8BlockSize; b * kMxfp8BlockSize < c0 + n; ++b)
    TPMOE_CHECK(s[b] != kE8M0Nan, "{}: MXFP8 tensor '{}': scale [{}, {}] is 255 (NaN)", v.file, v.name, r, b);
  if (d.dtype == DType::kF8E4M3) {
    TPMOE_CHECK(c0 % kMxfp8BlockSize == 0 && n % kMxfp8BlockSize == 0,
                "{}: MXFP8 tensor '{}' {}: this rank's slice of columns [{}, {}) does not lie on 32-element "
                "scale-block boundaries (a tensor-parallel split of an FP8 weight must cut K into whole blocks; "
                "use a smaller --tp, or the CPU backend, which dequantizes before slicing)",
                v.file, v.name, v.shape_str(), c0, c0 + n);
    std::memcpy(d.data, q + c0, size_t(n));
    std::memcpy(d.scale, s + c0 / kMxfp8BlockSize, size_t(n / kMxfp8BlockSize));
    d.data += n;
    d.scale += n / kMxfp8BlockSize;
    return;
  }
  TPMOE_CHECK(d.dtype == DType::kF32, "internal: cannot convert F8_E4M3 to {}", dtype_name(d.dtype));
  float* out = reinterpret_cast<float*>(d.data);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = c0 + i;
    out[i] = fp8_e4m3_to_f32(q[k]) * e8m0_to_f32(s[k / kMxfp8BlockSize]);
    TPMOE_CHECK(std::isfinite(out[i]), "{}: MXFP8 tensor '{}': element [{}, {}] dequantizes to {} (fp8 byte 0x{:02x})",
                v.file, v.name, r, k, out[i], q[k]);
  }
  d.data += size_t(n) * sizeof(float);
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
    case Piece::kQProj: return ck.linear(p + "self_attn.q_proj.weight", shape);
    case Piece::kKProj: return ck.linear(p + "self_attn.k_proj.weight", shape);
    case Piece::kVProj: return ck.linear(p + "self_attn.v_proj.weight", shape);
    case Piece::kOProj: return ck.linear(p + "self_attn.o_proj.weight", shape);
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

ModelWeights load_rank_weights(const io::Checkpoint& ck, const RankShard& shard, const FusionPlan& plan,
                               const LoadOptions& options) {
  ModelWeights w;
  w.layers.resize(size_t(ck.config().num_layers));
  // The dtype a checkpoint matrix is stored in: bf16 stays bf16, MXFP8 stays MXFP8 when asked (the
  // CUDA backend) and is dequantized to fp32 otherwise (the CPU oracle), anything else is fp32.
  auto storage = [&](DType d) {
    if (d == DType::kF8E4M3) return options.keep_mxfp8 ? d : DType::kF32;
    return weight_storage_dtype(d);
  };
  for (const WeightEntry& e : rank_weight_table(ck.config(), shard, plan)) {
    std::vector<io::TensorView> views;
    for (const Block& b : e.blocks) views.push_back(resolve(ck, b.source));
    // Vectors are fp32; a matrix has one storage dtype for every block it is stacked from.
    const DType dtype = e.vector ? DType::kF32 : storage(views[0].dtype);
    for (const auto& v : views)
      TPMOE_CHECK(e.vector || storage(v.dtype) == dtype, "{}: tensor '{}' is {} but '{}' is {}", v.file, v.name,
                  dtype_name(v.dtype), views[0].name, dtype_name(views[0].dtype));
    int64_t n = 1;
    for (auto d : e.shape) n *= d;
    const size_t bytes = size_t(n) * dtype_size(dtype);
    w.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    w.bytes += bytes;
    Tensor& t = e.slot(w);
    void* data = w.storage.back().get();
    t = e.shape.size() == 1   ? Tensor::make(data, dtype, e.shape[0])
        : e.shape.size() == 2 ? Tensor::make(data, dtype, e.shape[0], e.shape[1])
                              : Tensor::make(data, dtype, e.shape[0], e.shape[1], e.shape[2]);
    if (dtype == DType::kF8E4M3) {  // one E8M0 scale per 32 elements along K
      w.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes / kMxfp8BlockSize, 1)));
      w.bytes += bytes / kMxfp8BlockSize;
      t.scale = w.storage.back().get();
    }
    Dest d{static_cast<std::byte*>(t.data), static_cast<uint8_t*>(t.scale), dtype};
    if (e.vector) {  // [N] pieces, widened to fp32
      for (size_t i = 0; i < e.blocks.size(); ++i) {
        const io::TensorView& v = views[i];
        convert(v.data + size_t(e.blocks[i].row_begin) * dtype_size(v.dtype), v.dtype, d.data, DType::kF32,
                e.blocks[i].rows);
        d.data += size_t(e.blocks[i].rows) * sizeof(float);
      }
    } else if (e.concat_columns) {  // every block contributes columns to each row
      for (int64_t r = 0; r < e.blocks.front().rows; ++r)
        for (size_t i = 0; i < e.blocks.size(); ++i)
          copy_row_span(views[i], e.blocks[i].row_begin + r, e.blocks[i].col_begin, e.blocks[i].cols, d);
    } else {  // blocks stacked, each row-major
      for (size_t i = 0; i < e.blocks.size(); ++i)
        for (int64_t r = 0; r < e.blocks[i].rows; ++r)
          copy_row_span(views[i], e.blocks[i].row_begin + r, e.blocks[i].col_begin, e.blocks[i].cols, d);
    }
    TPMOE_CHECK(d.data == static_cast<std::byte*>(t.data) + bytes,
                "internal: weight table entry {} fills {} of {} bytes", e.name,
                d.data - static_cast<std::byte*>(t.data), bytes);
  }
  return w;
}

}  // namespace tpmoe
