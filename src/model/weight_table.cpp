#include "model/weight_table.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tpmoe {

namespace {

constexpr float kMatrixStd = 0.02f, kNormStd = 0.1f, kBiasStd = 0.01f, kEmbedStd = 1.0f;

// Whole piece as one block.
Block whole(const ModelConfig& c, PieceRef ref) {
  const auto shape = piece_shape(c, ref);
  return {ref, 0, shape[0], 0, shape.size() > 1 ? shape[1] : 1};
}
// Rows [begin, begin + count) of a piece, every column.
Block rows_of(const ModelConfig& c, PieceRef ref, int64_t begin, int64_t count) {
  const auto shape = piece_shape(c, ref);
  return {ref, begin, count, 0, shape[1]};
}
// Columns [begin, begin + count) of a piece, every row (a row-parallel slice).
Block cols_of(const ModelConfig& c, PieceRef ref, int64_t begin, int64_t count) {
  const auto shape = piece_shape(c, ref);
  return {ref, 0, shape[0], begin, count};
}

}  // namespace

std::vector<int64_t> piece_shape(const ModelConfig& c, const PieceRef& r) {
  const int64_t H = c.hidden_size, hd = c.head_dim, ihd = c.index_head_dim;
  const int64_t I = c.moe_intermediate_size, Is = int64_t(c.num_shared_experts) * c.shared_intermediate_size;
  const int64_t Id = c.dense_intermediate_size;
  switch (r.piece) {
    case Piece::kEmbed:
    case Piece::kLmHead: return {c.vocab_size, H};
    case Piece::kFinalNorm:
    case Piece::kInputNorm:
    case Piece::kPostAttentionNorm: return {H};
    case Piece::kQProj: return {int64_t(c.num_heads) * hd, H};
    case Piece::kKProj:
    case Piece::kVProj: return {int64_t(c.num_kv_heads) * hd, H};
    case Piece::kOProj: return {H, int64_t(c.num_heads) * hd};
    case Piece::kQNorm:
    case Piece::kKNorm: return {hd};
    case Piece::kIndexQProj: return {int64_t(c.index_n_heads) * ihd, H};
    case Piece::kIndexKProj: return {ihd, H};
    case Piece::kIndexQNorm:
    case Piece::kIndexKNorm: return {ihd};
    case Piece::kDenseGate:
    case Piece::kDenseUp: return {Id, H};
    case Piece::kDenseDown: return {H, Id};
    case Piece::kRouter: return {c.num_experts, H};
    case Piece::kRouterBias: return {c.num_experts};
    case Piece::kExpertGate:
    case Piece::kExpertUp: return {I, H};
    case Piece::kExpertDown: return {H, I};
    case Piece::kSharedGate:
    case Piece::kSharedUp: return {Is, H};
    case Piece::kSharedDown: return {H, Is};
  }
  TPMOE_FAIL("internal: unknown weight piece {}", int(r.piece));
}

CanonicalLocation canonical_location(const ModelConfig& c, const PieceRef& r) {
  const auto shape = piece_shape(c, r);
  const int64_t K = shape.size() > 1 ? shape[1] : 1, H = c.hidden_size;
  const std::string p = fmt::format("model.layers.{}.", r.layer);
  const int64_t I = c.moe_intermediate_size, Is = int64_t(c.num_shared_experts) * c.shared_intermediate_size;
  auto at = [&](std::string name, int64_t offset = 0) { return CanonicalLocation{std::move(name), offset, K}; };
  switch (r.piece) {
    case Piece::kEmbed: return at("model.embed_tokens.weight");
    case Piece::kLmHead: return at(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    case Piece::kFinalNorm: return at("model.norm.weight");
    case Piece::kInputNorm: return at(p + "input_layernorm.weight");
    case Piece::kPostAttentionNorm: return at(p + "post_attention_layernorm.weight");
    case Piece::kQProj: return at(p + "self_attn.q_proj.weight");
    case Piece::kKProj: return at(p + "self_attn.k_proj.weight");
    case Piece::kVProj: return at(p + "self_attn.v_proj.weight");
    case Piece::kOProj: return at(p + "self_attn.o_proj.weight");
    case Piece::kQNorm: return at(p + "self_attn.q_norm.weight");
    case Piece::kKNorm: return at(p + "self_attn.k_norm.weight");
    case Piece::kIndexQProj: return at(p + "self_attn.indexer.q_proj.weight");
    case Piece::kIndexKProj: return at(p + "self_attn.indexer.k_proj.weight");
    case Piece::kIndexQNorm: return at(p + "self_attn.indexer.q_norm.weight");
    case Piece::kIndexKNorm: return at(p + "self_attn.indexer.k_norm.weight");
    case Piece::kDenseGate: return at(p + "mlp.gate_up_proj.weight");
    case Piece::kDenseUp: return at(p + "mlp.gate_up_proj.weight", int64_t(c.dense_intermediate_size) * H);
    case Piece::kDenseDown: return at(p + "mlp.down_proj.weight");
    case Piece::kRouter: return at(p + "mlp.gate.weight");
    case Piece::kRouterBias: return at(p + "mlp.gate.e_score_correction_bias");
    case Piece::kExpertGate: return at(p + "mlp.experts.gate_up_proj", r.expert * 2 * I * H);
    case Piece::kExpertUp: return at(p + "mlp.experts.gate_up_proj", r.expert * 2 * I * H + I * H);
    case Piece::kExpertDown: return at(p + "mlp.experts.down_proj", r.expert * H * I);
    case Piece::kSharedGate: return at(p + "mlp.shared_experts.gate_up_proj.weight");
    case Piece::kSharedUp: return at(p + "mlp.shared_experts.gate_up_proj.weight", Is * H);
    case Piece::kSharedDown: return at(p + "mlp.shared_experts.down_proj.weight");
  }
  TPMOE_FAIL("internal: unknown weight piece {}", int(r.piece));
}

float preset_stddev(const ModelConfig& c, const PieceRef& r) {
  switch (r.piece) {
    case Piece::kEmbed: return kEmbedStd;
    case Piece::kLmHead: return c.tie_word_embeddings ? kEmbedStd : kMatrixStd;  // a tied head is the embedding
    case Piece::kRouterBias: return kBiasStd;
    case Piece::kFinalNorm:
    case Piece::kInputNorm:
    case Piece::kPostAttentionNorm:
    case Piece::kQNorm:
    case Piece::kKNorm:
    case Piece::kIndexQNorm:
    case Piece::kIndexKNorm: return kNormStd;
    default: return kMatrixStd;
  }
}

bool preset_always_f32(const PieceRef& r) { return r.piece == Piece::kRouterBias; }

bool preset_mxfp8_quantized(const PieceRef& r) {
  switch (r.piece) {
    case Piece::kQProj:
    case Piece::kKProj:
    case Piece::kVProj:
    case Piece::kOProj:
    case Piece::kIndexQProj:
    case Piece::kIndexKProj:
    case Piece::kDenseGate:
    case Piece::kDenseUp:
    case Piece::kDenseDown:
    case Piece::kExpertGate:
    case Piece::kExpertUp:
    case Piece::kExpertDown:
    case Piece::kSharedGate:
    case Piece::kSharedUp:
    case Piece::kSharedDown: return true;
    default: return false;
  }
}

std::vector<CanonicalTensor> canonical_tensors(const ModelConfig& c) {
  std::vector<CanonicalTensor> out;
  auto add = [&](PieceRef ref, std::vector<int64_t> shape) {
    out.push_back({canonical_location(c, ref).name, std::move(shape), preset_stddev(c, ref), preset_always_f32(ref),
                   preset_mxfp8_quantized(ref)});
  };
  auto add_piece = [&](PieceRef ref) { add(ref, piece_shape(c, ref)); };
  const int64_t H = c.hidden_size;
  add_piece({Piece::kEmbed});
  add_piece({Piece::kFinalNorm});
  if (!c.tie_word_embeddings) add_piece({Piece::kLmHead});
  for (int l = 0; l < c.num_layers; ++l) {
    for (Piece p : {Piece::kInputNorm, Piece::kPostAttentionNorm, Piece::kQProj, Piece::kKProj, Piece::kVProj,
                    Piece::kOProj, Piece::kQNorm, Piece::kKNorm})
      add_piece({p, l});
    if (c.layer_types[l] == AttentionType::kSparse)
      for (Piece p : {Piece::kIndexQProj, Piece::kIndexKProj, Piece::kIndexQNorm, Piece::kIndexKNorm})
        add_piece({p, l});
    if (c.mlp_layer_types[l] == MlpType::kDense) {
      add({Piece::kDenseGate, l}, {2 * int64_t(c.dense_intermediate_size), H});  // gate_up: gate half, then up
      add_piece({Piece::kDenseDown, l});
      continue;
    }
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    add_piece({Piece::kRouter, l});
    add_piece({Piece::kRouterBias, l});
    add({Piece::kExpertGate, l, 0}, {E, 2 * I, H});
    add({Piece::kExpertDown, l, 0}, {E, H, I});
    if (c.num_shared_experts > 0) {
      const int64_t Is = int64_t(c.num_shared_experts) * c.shared_intermediate_size;
      add({Piece::kSharedGate, l}, {2 * Is, H});
      add_piece({Piece::kSharedDown, l});
    }
  }
  return out;
}

std::vector<WeightEntry> rank_weight_table(const ModelConfig& c, const RankShard& s, const FusionPlan& plan) {
  std::vector<WeightEntry> t;
  auto entry = [&](std::string name, std::function<Tensor&(ModelWeights&)> slot, std::vector<int64_t> shape,
                   std::vector<Block> blocks) -> WeightEntry& {
    WeightEntry e;
    e.name = std::move(name);
    e.slot = std::move(slot);
    e.vector = shape.size() == 1;
    e.shape = std::move(shape);
    e.blocks = std::move(blocks);
    t.push_back(std::move(e));
    return t.back();
  };
  const int64_t H = c.hidden_size, hd = c.head_dim, ihd = c.index_head_dim;
  entry("embed", [](ModelWeights& w) -> Tensor& { return w.embed; }, {c.vocab_size, H}, {whole(c, {Piece::kEmbed})})
      .read = StepRead::kTokenRows;
  entry("final_norm", [](ModelWeights& w) -> Tensor& { return w.final_norm; }, {H}, {whole(c, {Piece::kFinalNorm})});
  entry("lm_head", [](ModelWeights& w) -> Tensor& { return w.lm_head; }, {s.vocab_size, H},
        {rows_of(c, {Piece::kLmHead}, s.vocab_begin, s.vocab_size)});

  // The rank's slice of each shared expert (expert j owns rows [j*Is, (j+1)*Is) of the shared MLP).
  std::vector<std::pair<int64_t, int64_t>> shared_slices;
  for (int j = 0; j < c.num_shared_experts; ++j)
    shared_slices.push_back({int64_t(j) * c.shared_intermediate_size + s.shared_inter_begin, s.shared_inter});

  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l);
    auto L = [l](auto member) {
      return [l, member](ModelWeights& w) -> Tensor& { return member(w.layers[size_t(l)]); };
    };
    entry(p + "input_norm", L([](LayerWeights& x) -> Tensor& { return x.input_norm; }), {H},
          {whole(c, {Piece::kInputNorm, l})});
    entry(p + "post_attention_norm", L([](LayerWeights& x) -> Tensor& { return x.post_attention_norm; }), {H},
          {whole(c, {Piece::kPostAttentionNorm, l})});
    const int64_t q_rows = int64_t(s.num_q_heads) * hd, kv_rows = int64_t(s.num_kv_heads) * hd;
    entry(p + "attn.q_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.q_proj; }), {q_rows, H},
          {rows_of(c, {Piece::kQProj, l}, s.q_head_begin * hd, q_rows)});
    entry(p + "attn.k_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.k_proj; }), {kv_rows, H},
          {rows_of(c, {Piece::kKProj, l}, s.kv_head_begin * hd, kv_rows)});
    entry(p + "attn.v_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.v_proj; }), {kv_rows, H},
          {rows_of(c, {Piece::kVProj, l}, s.kv_head_begin * hd, kv_rows)});
    entry(p + "attn.o_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.o_proj; }), {H, q_rows},
          {cols_of(c, {Piece::kOProj, l}, s.q_head_begin * hd, q_rows)});
    entry(p + "attn.q_norm", L([](LayerWeights& x) -> Tensor& { return x.attn.q_norm; }), {hd},
          {whole(c, {Piece::kQNorm, l})});
    entry(p + "attn.k_norm", L([](LayerWeights& x) -> Tensor& { return x.attn.k_norm; }), {hd},
          {whole(c, {Piece::kKNorm, l})});
    if (c.layer_types[l] == AttentionType::kSparse) {
      const int64_t iq_rows = int64_t(s.num_index_heads) * ihd;
      entry(p + "attn.index_q_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.index_q_proj; }), {iq_rows, H},
            {rows_of(c, {Piece::kIndexQProj, l}, s.index_head_begin * ihd, iq_rows)});
      entry(p + "attn.index_k_proj", L([](LayerWeights& x) -> Tensor& { return x.attn.index_k_proj; }), {ihd, H},
            {whole(c, {Piece::kIndexKProj, l})});
      entry(p + "attn.index_q_norm", L([](LayerWeights& x) -> Tensor& { return x.attn.index_q_norm; }), {ihd},
            {whole(c, {Piece::kIndexQNorm, l})});
      entry(p + "attn.index_k_norm", L([](LayerWeights& x) -> Tensor& { return x.attn.index_k_norm; }), {ihd},
            {whole(c, {Piece::kIndexKNorm, l})});
    }
    if (c.mlp_layer_types[l] == MlpType::kDense) {
      const int64_t n = s.dense_inter, b = s.dense_inter_begin;
      entry(p + "dense.gate_up", L([](LayerWeights& x) -> Tensor& { return x.dense.gate_up; }), {2 * n, H},
            {rows_of(c, {Piece::kDenseGate, l}, b, n), rows_of(c, {Piece::kDenseUp, l}, b, n)});
      entry(p + "dense.down", L([](LayerWeights& x) -> Tensor& { return x.dense.down; }), {H, n},
            {cols_of(c, {Piece::kDenseDown, l}, b, n)});
      continue;
    }
    const int64_t E = c.num_experts, I = s.moe_inter, R = plan.shared_expert.physical_rows;
    entry(p + "moe.router", L([](LayerWeights& x) -> Tensor& { return x.moe.router; }), {E, H},
          {whole(c, {Piece::kRouter, l})});
    entry(p + "moe.bias", L([](LayerWeights& x) -> Tensor& { return x.moe.bias; }), {E},
          {whole(c, {Piece::kRouterBias, l})});
    // Routed expert e is physical row e; with fusion, shared expert j is row E + j (SPEC §4).
    std::vector<Block> gate_up, down;
    for (int e = 0; e < E; ++e) {
      gate_up.push_back(rows_of(c, {Piece::kExpertGate, l, e}, s.moe_inter_begin, I));
      gate_up.push_back(rows_of(c, {Piece::kExpertUp, l, e}, s.moe_inter_begin, I));
      down.push_back(cols_of(c, {Piece::kExpertDown, l, e}, s.moe_inter_begin, I));
    }
    if (plan.shared_expert.fused) {
      for (const auto& [begin, count] : shared_slices) {
        gate_up.push_back(rows_of(c, {Piece::kSharedGate, l}, begin, count));
        gate_up.push_back(rows_of(c, {Piece::kSharedUp, l}, begin, count));
        down.push_back(cols_of(c, {Piece::kSharedDown, l}, begin, count));
      }
    }
    WeightEntry& gu =
        entry(p + "moe.experts_gate_up", L([](LayerWeights& x) -> Tensor& { return x.moe.experts_gate_up; }),
              {R, 2 * I, H}, std::move(gate_up));
    gu.read = StepRead::kExpertRows;
    gu.routed_rows = int(E);
    WeightEntry& dn = entry(p + "moe.experts_down", L([](LayerWeights& x) -> Tensor& { return x.moe.experts_down; }),
                            {R, H, I}, std::move(down));
    dn.read = StepRead::kExpertRows;
    dn.routed_rows = int(E);
    if (c.num_shared_experts > 0 && !plan.shared_expert.fused) {
      const int64_t n = int64_t(c.num_shared_experts) * s.shared_inter;
      std::vector<Block> sgu, sdown;
      for (const auto& [begin, count] : shared_slices) sgu.push_back(rows_of(c, {Piece::kSharedGate, l}, begin, count));
      for (const auto& [begin, count] : shared_slices) sgu.push_back(rows_of(c, {Piece::kSharedUp, l}, begin, count));
      for (const auto& [begin, count] : shared_slices)
        sdown.push_back(cols_of(c, {Piece::kSharedDown, l}, begin, count));
      entry(p + "moe.shared.gate_up", L([](LayerWeights& x) -> Tensor& { return x.moe.shared.gate_up; }), {2 * n, H},
            std::move(sgu));
      entry(p + "moe.shared.down", L([](LayerWeights& x) -> Tensor& { return x.moe.shared.down; }), {H, n},
            std::move(sdown))
          .concat_columns = true;
    }
  }
  return t;
}

}  // namespace tpmoe
