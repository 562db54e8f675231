#include "model/weights.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

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

class Loader {
 public:
  Loader(ModelWeights& w, const LoadOptions& options) : w_(w), options_(options) {}

  // The dtype a checkpoint matrix of dtype `d` is stored in: bf16 stays bf16, MXFP8 stays MXFP8 when
  // asked (the CUDA backend) and is dequantized to fp32 otherwise (the CPU oracle), the rest is fp32.
  DType storage(DType d) const {
    if (d == DType::kF8E4M3) return options_.keep_mxfp8 ? d : DType::kF32;
    return weight_storage_dtype(d);
  }

  Tensor alloc(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    const size_t bytes = size_t(n) * dtype_size(dtype);
    w_.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(bytes, 1)));
    w_.bytes += bytes;
    void* p = w_.storage.back().get();
    Tensor t = shape.size() == 1   ? Tensor::make(p, dtype, shape[0])
               : shape.size() == 2 ? Tensor::make(p, dtype, shape[0], shape[1])
                                   : Tensor::make(p, dtype, shape[0], shape[1], shape[2]);
    if (dtype == DType::kF8E4M3) {
      const size_t scale_bytes = bytes / kMxfp8BlockSize;
      w_.storage.push_back(std::make_unique<std::byte[]>(std::max<size_t>(scale_bytes, 1)));
      w_.bytes += scale_bytes;
      t.scale = w_.storage.back().get();
    }
    return t;
  }
  static Dest dest(const Tensor& t) {
    return {static_cast<std::byte*>(t.data), static_cast<uint8_t*>(t.scale), t.dtype};
  }
  // Dest of expert row `row` of a [R, rows, K] stack.
  static Dest dest_row(const Tensor& t, int64_t row) {
    const int64_t per = t.dim(1) * t.dim(2);
    Dest d = dest(t);
    d.data += size_t(row * per) * dtype_size(t.dtype);
    if (d.scale) d.scale += row * per / kMxfp8BlockSize;
    return d;
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
    const DType dtype = storage(blocks[0].view->dtype);
    const int64_t K = blocks[0].view->shape[1];
    int64_t rows = 0;
    for (const auto& b : blocks) rows += b.count;
    Tensor t = alloc(dtype, {rows, K});
    Dest d = dest(t);
    fill_row_blocks(blocks, d);
    return t;
  }
  void fill_row_blocks(const std::vector<RowBlock>& blocks, Dest& d) {
    for (const auto& b : blocks) {
      check_dtype(*b.view, d.dtype);
      const int64_t K = b.view->shape[1];
      for (int64_t r = b.begin; r < b.begin + b.count; ++r) copy_row_span(*b.view, r, 0, K, d);
    }
  }

  // Columns [begin, begin+count) of a [N, K] view (row-parallel slice), written at `d`.
  void fill_columns(const io::TensorView& v, int64_t begin, int64_t count, Dest& d) {
    check_dtype(v, d.dtype);
    for (int64_t n = 0; n < v.shape[0]; ++n) copy_row_span(v, n, begin, count, d);
  }
  Tensor columns(const io::TensorView& v, int64_t begin, int64_t count) {
    Tensor t = alloc(storage(v.dtype), {v.shape[0], count});
    Dest d = dest(t);
    fill_columns(v, begin, count, d);
    return t;
  }
  // Several column slices of several views side by side: [N, sum counts].
  Tensor column_blocks(const std::vector<RowBlock>& blocks) {
    const DType dtype = storage(blocks[0].view->dtype);
    const int64_t N = blocks[0].view->shape[0];
    int64_t cols = 0;
    for (const auto& b : blocks) cols += b.count;
    Tensor t = alloc(dtype, {N, cols});
    Dest d = dest(t);
    for (const auto& b : blocks) check_dtype(*b.view, dtype);
    for (int64_t n = 0; n < N; ++n)
      for (const auto& b : blocks) copy_row_span(*b.view, n, b.begin, b.count, d);
    return t;
  }

 private:
  void check_dtype(const io::TensorView& v, DType dtype) const {
    TPMOE_CHECK(storage(v.dtype) == dtype, "{}: tensor '{}' is {} but its neighbours are {}", v.file, v.name,
                dtype_name(v.dtype), dtype_name(dtype));
  }

  ModelWeights& w_;
  LoadOptions options_;
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
  const auto q = ck.linear(p + "q_proj.weight", {int64_t(c.num_heads) * hd, H});
  const auto k = ck.linear(p + "k_proj.weight", {int64_t(c.num_kv_heads) * hd, H});
  const auto v = ck.linear(p + "v_proj.weight", {int64_t(c.num_kv_heads) * hd, H});
  const auto o = ck.linear(p + "o_proj.weight", {H, int64_t(c.num_heads) * hd});
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
  const DType dtype = L.storage(ck.routed_expert(l, 0).gate.dtype);
  m.experts_gate_up = L.alloc(dtype, {R, 2 * I, H});
  m.experts_down = L.alloc(dtype, {R, H, I});
  for (int64_t e = 0; e < E; ++e) {
    const io::MlpViews ex = ck.routed_expert(l, int(e));
    Dest gu = Loader::dest_row(m.experts_gate_up, e), dn = Loader::dest_row(m.experts_down, e);
    L.fill_row_blocks({{&ex.gate, s.moe_inter_begin, I}, {&ex.up, s.moe_inter_begin, I}}, gu);
    L.fill_columns(ex.down, s.moe_inter_begin, I, dn);
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
    Dest gu = Loader::dest_row(m.experts_gate_up, row), dn = Loader::dest_row(m.experts_down, row);
    L.fill_row_blocks({{&sh.gate, sl.begin, sl.count}, {&sh.up, sl.begin, sl.count}}, gu);
    L.fill_columns(sh.down, sl.begin, sl.count, dn);
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

ModelWeights load_rank_weights(const io::Checkpoint& ck, const RankShard& s, const FusionPlan& plan,
                               const LoadOptions& options) {
  const ModelConfig& c = ck.config();
  ModelWeights w;
  Loader L(w, options);
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
