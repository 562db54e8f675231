#include "model/weights.h"

#include <cstring>

#include "core/error.h"

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

class Loader {
 public:
  explicit Loader(ModelWeights& w) : w_(w) {}

  Tensor alloc(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    const size_t bytes = size_t(n) * dtype_size(dtype);
    w_.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    w_.bytes += bytes;
    void* p = w_.storage.back().get();
    if (shape.size() == 1) return Tensor::make(p, dtype, shape[0]);
    if (shape.size() == 2) return Tensor::make(p, dtype, shape[0], shape[1]);
    return Tensor::make(p, dtype, shape[0], shape[1], shape[2]);
  }

  // A vector (norm weight, bias) as fp32.
  Tensor vector(const io::TensorView& v) {
    Tensor t = alloc(DType::kF32, {v.shape[0]});
    convert(v.data, v.dtype, static_cast<std::byte*>(t.data), DType::kF32, v.shape[0]);
    return t;
  }

  // A whole matrix in its storage dtype.
  Tensor matrix(const io::TensorView& v) { return row_blocks({{&v, 0, v.shape[0]}}); }

  struct RowBlock {
    const io::TensorView* view;
    int64_t begin, count;
  };
  // Rows of several [*, K] views stacked into one [sum counts, K] matrix (column-parallel slices,
  // gate and up halves side by side).
  Tensor row_blocks(const std::vector<RowBlock>& blocks) {
    const DType dtype = weight_storage_dtype(blocks[0].view->dtype);
    const int64_t K = blocks[0].view->shape[1];
    int64_t rows = 0;
    for (const auto& b : blocks) rows += b.count;
    Tensor t = alloc(dtype, {rows, K});
    fill_row_blocks(blocks, static_cast<std::byte*>(t.data), dtype);
    return t;
  }
  void fill_row_blocks(const std::vector<RowBlock>& blocks, std::byte* dst, DType dtype) {
    for (const auto& b : blocks) {
      const int64_t K = b.view->shape[1];
      TPMOE_CHECK(weight_storage_dtype(b.view->dtype) == dtype, "{}: tensor '{}' is {} but its neighbours are {}",
                  b.view->file, b.view->name, dtype_name(b.view->dtype), dtype_name(dtype));
      convert(b.view->data + b.begin * K * dtype_size(b.view->dtype), b.view->dtype, dst, dtype, b.count * K);
      dst += b.count * K * dtype_size(dtype);
    }
  }

  // Columns [begin, begin+count) of a [N, K] view (row-parallel slice), written at `dst`.
  void fill_columns(const io::TensorView& v, int64_t begin, int64_t count, std::byte* dst, DType dtype) {
    const int64_t N = v.shape[0], K = v.shape[1];
    const size_t es = dtype_size(v.dtype);
    for (int64_t n = 0; n < N; ++n)
      convert(v.data + (n * K + begin) * es, v.dtype, dst + n * count * dtype_size(dtype), dtype, count);
  }
  Tensor columns(const io::TensorView& v, int64_t begin, int64_t count) {
    const DType dtype = weight_storage_dtype(v.dtype);
    Tensor t = alloc(dtype, {v.shape[0], count});
    fill_columns(v, begin, count, static_cast<std::byte*>(t.data), dtype);
    return t;
  }
  // Several column slices of several views side by side: [N, sum counts].
  Tensor column_blocks(const std::vector<RowBlock>& blocks) {
    const DType dtype = weight_storage_dtype(blocks[0].view->dtype);
    const int64_t N = blocks[0].view->shape[0];
    int64_t cols = 0;
    for (const auto& b : blocks) cols += b.count;
    Tensor t = alloc(dtype, {N, cols});
    std::byte* dst = static_cast<std::byte*>(t.data);
    const size_t es = dtype_size(dtype);
    for (int64_t n = 0; n < N; ++n) {
      int64_t c = 0;
      for (const auto& b : blocks) {
        convert(b.view->data + (n * b.view->shape[1] + b.begin) * dtype_size(b.view->dtype), b.view->dtype,
                dst + (n * cols + c) * es, dtype, b.count);
        c += b.count;
      }
    }
    return t;
  }

 private:
  ModelWeights& w_;
};

// The rank's slice of shared expert c (of width Is, stored at rows [c*Is, (c+1)*Is) of the shared MLP).
struct SharedSlice {
  int64_t begin, count;
};
std::vector<SharedSlice> shared_slices(const ModelConfig& c, const RankShard& s) {
  std::vector<SharedSlice> out;
  for (int e = 0; e < c.num_shared_experts; ++e)
    out.push_back({int64_t(e) * c.shared_intermediate_size + s.shared_inter_begin, s.shared_inter});
  return out;
}

void load_attention(Loader& L, const io::Checkpoint& ck, const RankShard& s, int l, AttentionWeights& a) {
  const ModelConfig& c = ck.config();
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const std::string p = fmt::format("layers.{}.self_attn.", l);
  const auto q = ck.common(p + "q_proj.weight", {int64_t(c.num_heads) * hd, H});
  const auto k = ck.common(p + "k_proj.weight", {int64_t(c.num_kv_heads) * hd, H});
  const auto v = ck.common(p + "v_proj.weight", {int64_t(c.num_kv_heads) * hd, H});
  const auto o = ck.common(p + "o_proj.weight", {H, int64_t(c.num_heads) * hd});
  a.q_proj = L.row_blocks({{&q, s.q_head_begin * hd, s.num_q_heads * hd}});
  a.k_proj = L.row_blocks({{&k, s.kv_head_begin * hd, s.num_kv_heads * hd}});
  a.v_proj = L.row_blocks({{&v, s.kv_head_begin * hd, s.num_kv_heads * hd}});
  a.o_proj = L.columns(o, s.q_head_begin * hd, s.num_q_heads * hd);
  a.q_norm = L.vector(ck.common(p + "q_norm.weight", {hd}));
  a.k_norm = L.vector(ck.common(p + "k_norm.weight", {hd}));
  if (c.layer_types[l] == AttentionType::kSparse) {
    const int64_t ihd = c.index_head_dim;
    const auto iq = ck.indexer(l, "q_proj");
    a.index_q_proj = L.row_blocks({{&iq, s.index_head_begin * ihd, s.num_index_heads * ihd}});
    a.index_k_proj = L.matrix(ck.indexer(l, "k_proj"));
    a.index_q_norm = L.vector(ck.indexer(l, "q_norm"));
    a.index_k_norm = L.vector(ck.indexer(l, "k_norm"));
  }
}

MlpWeights load_mlp(Loader& L, const io::MlpViews& m, const std::vector<SharedSlice>& slices) {
  std::vector<Loader::RowBlock> gate_up, down;
  for (const auto& sl : slices) gate_up.push_back({&m.gate, sl.begin, sl.count});
  for (const auto& sl : slices) gate_up.push_back({&m.up, sl.begin, sl.count});
  for (const auto& sl : slices) down.push_back({&m.down, sl.begin, sl.count});
  return {L.row_blocks(gate_up), L.column_blocks(down)};
}

void load_moe(Loader& L, const io::Checkpoint& ck, const RankShard& s, const FusionPlan& plan, int l, MoeWeights& m) {
  const ModelConfig& c = ck.config();
  const int64_t H = c.hidden_size, E = c.num_experts, I = s.moe_inter, R = plan.shared_expert.physical_rows;
  m.router = L.matrix(ck.router(l));
  m.bias = L.vector(ck.router_bias(l));
  const DType dtype = weight_storage_dtype(ck.routed_expert(l, 0).gate.dtype);
  m.experts_gate_up = L.alloc(dtype, {R, 2 * I, H});
  m.experts_down = L.alloc(dtype, {R, H, I});
  auto* gu = static_cast<std::byte*>(m.experts_gate_up.data);
  auto* dn = static_cast<std::byte*>(m.experts_down.data);
  const size_t es = dtype_size(dtype);
  for (int64_t e = 0; e < E; ++e) {
    const io::MlpViews ex = ck.routed_expert(l, int(e));
    L.fill_row_blocks({{&ex.gate, s.moe_inter_begin, I}, {&ex.up, s.moe_inter_begin, I}}, gu + e * 2 * I * H * es,
                      dtype);
    L.fill_columns(ex.down, s.moe_inter_begin, I, dn + e * H * I * es, dtype);
  }
  if (c.num_shared_experts == 0) return;
  const io::MlpViews sh = ck.shared_experts(l);
  if (!plan.shared_expert.fused) {
    m.shared = load_mlp(L, sh, shared_slices(c, s));
    return;
  }
  // Shared expert c becomes physical row E + c: same [2I, H] / [H, I] shape as a routed expert.
  int64_t row = E;
  for (const auto& sl : shared_slices(c, s)) {
    L.fill_row_blocks({{&sh.gate, sl.begin, sl.count}, {&sh.up, sl.begin, sl.count}}, gu + row * 2 * I * H * es, dtype);
    L.fill_columns(sh.down, sl.begin, sl.count, dn + row * H * I * es, dtype);
    ++row;
  }
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

ModelWeights load_rank_weights(const io::Checkpoint& ck, const RankShard& s, const FusionPlan& plan) {
  const ModelConfig& c = ck.config();
  ModelWeights w;
  Loader L(w);
  const int64_t H = c.hidden_size;
  w.embed = L.matrix(ck.common("embed_tokens.weight", {c.vocab_size, H}));
  w.final_norm = L.vector(ck.common("norm.weight", {H}));
  w.lm_head = L.matrix(ck.lm_head());
  w.layers.resize(size_t(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = w.layers[l];
    lw.input_norm = L.vector(ck.common(fmt::format("layers.{}.input_layernorm.weight", l), {H}));
    lw.post_attention_norm = L.vector(ck.common(fmt::format("layers.{}.post_attention_layernorm.weight", l), {H}));
    load_attention(L, ck, s, l, lw.attn);
    if (c.mlp_layer_types[l] == MlpType::kDense)
      lw.dense = load_mlp(L, ck.dense_mlp(l), {{s.dense_inter_begin, s.dense_inter}});
    else
      load_moe(L, ck, s, plan, l, lw.moe);
  }
  return w;
}

}  // namespace tpmoe
