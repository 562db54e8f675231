#include "model/model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tpmoe {

Model::Model(const ModelConfig& config, const FusionPlan& plan, const RankShard& shard, const ModelWeights& weights,
             Ops& ops, Communicator& comm)
    : c_(config), plan_(plan), shard_(shard), w_(weights), ops_(ops), comm_(comm) {
  TPMOE_CHECK(comm.size() == plan.tp, "communicator has {} ranks but the fusion plan was built for tp={}", comm.size(),
              plan.tp);
  check_plan_consistent(plan);
}

CacheShape Model::cache_shape(int max_seqs, int max_len, int page_size, int num_pages) const {
  CacheShape s;
  s.num_layers = c_.num_layers;
  for (auto t : c_.layer_types) s.sparse_layer.push_back(t == AttentionType::kSparse);
  s.num_kv_heads = shard_.num_kv_heads;
  s.head_dim = c_.head_dim;
  s.index_head_dim = c_.index_head_dim;
  s.max_seqs = max_seqs;
  s.max_len = max_len;
  s.page_size = page_size;
  s.num_pages = num_pages > 0 ? num_pages : max_seqs * s.pages_per_seq();
  s.validate();
  return s;
}

size_t Model::activation_bytes(const ModelConfig& c_, const RankShard& shard_, int max_tokens, int max_logit_rows,
                               size_t a) {
  // Mirrors the allocations of forward(); a backend rounds each allocation up to kAllocAlign.
  constexpr size_t kAllocSlack = 32 * 256;
  const size_t T = size_t(max_tokens), H = size_t(c_.hidden_size), hd = size_t(c_.head_dim);
  const size_t nq = size_t(shard_.num_q_heads), nkv = size_t(shard_.num_kv_heads);
  size_t worst_layer = 0;
  for (int l = 0; l < c_.num_layers; ++l) {
    size_t bytes = (2 * nq + 2 * nkv) * hd * a;  // q, k, v, attention output
    if (c_.layer_types[l] == AttentionType::kSparse)
      bytes += (size_t(shard_.num_index_heads) + 1) * size_t(c_.index_head_dim) * a;
    if (c_.mlp_layer_types[l] == MlpType::kDense) {
      bytes += 3 * size_t(shard_.dense_inter) * a;
    } else {
      const size_t slots = size_t(c_.num_experts_per_tok + c_.num_shared_experts);
      bytes += size_t(c_.num_experts) * 4 + slots * 8;
      bytes += (H + 3 * size_t(c_.num_shared_experts) * size_t(shard_.shared_inter)) * a;  // unfused shared MLP
    }
    worst_layer = std::max(worst_layer, bytes);
  }
  // Per logit row: the selected hidden row, this rank's logits, its id, and (vocab-parallel) the
  // gathered slices and the full row they are laid into, plus the distributed argmax's candidates.
  const size_t per_logit_row = H * a + 4 * size_t(shard_.vocab_size) + 8 +
                               (shard_.vocab_parallel() ? 8 * size_t(c_.vocab_size) + 16 * size_t(shard_.tp) + 8 : 0);
  return T * (8 * H + 3 * H * a + worst_layer) + size_t(max_logit_rows) * per_logit_row + 4 * kAllocSlack;
}

void Model::project(const SublayerInput& in, std::span<const Projection> items) {
  const float eps = c_.rms_norm_eps;
  auto linears = [&] {
    if (items.size() == 1)
      ops_.linear(in.h, items[0].weight, items[0].out);
    else
      ops_.linears(in.h, items);
  };
  if (in.residual == nullptr) {
    linears();
  } else if (in.partial.empty()) {
    ops_.rmsnorm(in.residual->now, in.norm_weight, eps, in.h);
    linears();
  } else if (in.reduce_in_norm) {
    comm_.allreduce_add_rmsnorm(in.partial, in.residual->now, in.norm_weight, eps, in.h);
    linears();
  } else {
    ResidualStream& r = *in.residual;
    const Tensor next = ops_.add_rmsnorm_linears(in.partial, r.now, r.spare, in.norm_weight, eps, in.h, items);
    if (next.data == r.spare.data) std::swap(r.now, r.spare);
  }
}

void Model::attention(int l, const SublayerInput& in, int T, Tensor out) {
  const AttentionWeights& a = w_.layers[l].attn;
  const int nq = shard_.num_q_heads, nkv = shard_.num_kv_heads, hd = c_.head_dim;
  const RopeParams rope{hd, c_.rotary_dim, float(c_.rope_theta), c_.rms_norm_eps};
  Tensor q = ops_.alloc(T, nq * hd), k = ops_.alloc(T, nkv * hd), v = ops_.alloc(T, nkv * hd);
  // The projections of h run as one call (one launch at decode on the GPU).
  std::vector<Projection> projections = {{a.q_proj, q}, {a.k_proj, k}, {a.v_proj, v}};
  // q, k and (sparse layers) the indexer's q and k are normed and rotated together, in one call.
  std::vector<HeadNormRope> rotate = {{q, nq, a.q_norm, rope}, {k, nkv, a.k_norm, rope}};

  AttentionParams p;
  p.layer = l;
  p.num_q_heads = nq;
  p.num_kv_heads = nkv;
  p.head_dim = hd;
  p.scale = 1.f / std::sqrt(float(hd));
  Tensor index_q, index_k;
  if (c_.layer_types[l] == AttentionType::kSparse) {
    // The lightning indexer: its own q (per KV group) and one key head, normed and rotated like q/k.
    const int nih = shard_.num_index_heads, ihd = c_.index_head_dim;
    const RopeParams index_rope{ihd, c_.rotary_dim, float(c_.rope_theta), c_.rms_norm_eps};
    index_q = ops_.alloc(T, nih * ihd);
    index_k = ops_.alloc(T, ihd);
    projections.push_back({a.index_q_proj, index_q});
    projections.push_back({a.index_k_proj, index_k});
    rotate.push_back({index_q, nih, a.index_q_norm, index_rope});
    rotate.push_back({index_k, 1, a.index_k_norm, index_rope});
    p.num_index_heads = nih;
    p.index_head_dim = ihd;
    p.block_size = c_.index_block_size;
    p.topk_blocks = c_.index_topk_blocks;
    p.local_blocks = c_.index_local_blocks;
  }
  project(in, projections);
  Tensor attn = ops_.alloc(T, nq * hd);
  // The norm + RoPE of `rotate`, then attention (one call: the GPU stores k, v and index_k into the
  // cache from its norm + RoPE kernel).
  ops_.rotate_and_attend(rotate, q, k, v, index_q, index_k, p, attn);
  ops_.linear(attn, a.o_proj, out);  // row-parallel: a partial sum under tp > 1
}

void Model::mlp(const SublayerInput& in, const MlpWeights& w, int T, Tensor out) {
  const int64_t n = w.down.dim(1);
  Tensor gate_up = ops_.alloc(T, 2 * n), act = ops_.alloc(T, n);
  const Projection first{w.gate_up, gate_up};
  project(in, {&first, 1});
  ops_.swiglu(gate_up, {c_.swiglu_alpha, c_.swiglu_limit}, act);
  ops_.linear(act, w.down, out);
}

void Model::moe(int l, const SublayerInput& in, int T, Tensor out) {
  const MoeWeights& m = w_.layers[l].moe;
  // Fused shared experts ride as extra slots, or (steps of many tokens: SharedExpertPlan) run their
  // rows of the routed weights as the shared MLP.
  const bool shared_slots = plan_.shared_expert.slots_at(T);
  RouterParams rp;
  rp.layer = l;
  rp.num_experts = c_.num_experts;
  rp.top_k = c_.num_experts_per_tok;
  rp.num_shared_slots = shared_slots ? c_.num_shared_experts : 0;
  // After the output is scaled by rsf, each shared slot contributes exactly 1.0 (SPEC §4).
  rp.shared_weight = 1.f / c_.routed_scaling_factor;
  const int slots = rp.top_k + rp.num_shared_slots;
  Tensor logits = ops_.alloc_typed(T, c_.num_experts, DType::kF32);
  Tensor slot_ids = ops_.alloc_typed(T, slots, DType::kI32), slot_weights = ops_.alloc_typed(T, slots, DType::kF32);
  const Projection router{m.router, logits};
  project(in, {&router, 1});
  const Tensor h = in.h;
  ops_.route_experts(h, {logits, m.bias, rp, slot_ids, slot_weights}, m.experts_gate_up, m.experts_down,
                     {c_.swiglu_alpha, c_.swiglu_limit}, c_.routed_scaling_factor, out);
  // Unfused (or fused, in a step without the shared slots): the shared expert runs as its own MLP,
  // from its own weights or from its rows E..E+n-1 of the routed weights, each one shared expert's
  // slice ([gate; up] and down): n MLPs with the shared MLP's function (its intermediate is the n
  // slices side by side). Its partial sum joins the routed one before the layer's single reduction
  // (never reduced twice, never once each).
  const bool own_weights = !m.shared.gate_up.empty();
  const int mlps = own_weights ? 1 : plan_.shared_expert.fused && !shared_slots ? c_.num_shared_experts : 0;
  if (mlps == 0) return;
  SublayerInput ready;
  ready.h = h;
  Tensor shared = ops_.alloc(T, c_.hidden_size);
  for (int j = 0; j < mlps; ++j) {
    const int64_t r = c_.num_experts + j;
    mlp(ready, own_weights ? m.shared : MlpWeights{m.experts_gate_up.row(r), m.experts_down.row(r)}, T, shared);
    ops_.add(shared, out);
  }
}

Tensor Model::forward(const StepTokens& step) {
  const int T = step.num_tokens(), H = c_.hidden_size;
  const float eps = c_.rms_norm_eps;
  // The residual stream stays fp32 on every backend: it accumulates 2 x num_layers updates, and
  // rounding it to bf16 after each would cost more accuracy than its bytes are worth.
  ResidualStream residual{ops_.alloc_typed(T, H, DType::kF32), ops_.alloc_typed(T, H, DType::kF32)};
  Tensor h = ops_.alloc(T, H);
  // The previous layer's MLP output: reduced, or a partial sum when deferred. Each layer reads it
  // in its input norm before its own MLP overwrites it.
  Tensor pending = ops_.alloc(T, H), attn_out = ops_.alloc(T, H);
  ops_.embed(w_.embed, residual.now);
  for (int l = 0; l < c_.num_layers; ++l) {
    const LayerPlan& lp = plan_.layers[l];
    const LayerWeights& lw = w_.layers[l];
    const size_t layer_scratch = ops_.mark();
    // The input norm (of the embedding alone in the first layer) runs with the q/k/v projections.
    attention(l, {h, &residual, l == 0 ? Tensor() : pending, lw.input_norm, lp.fuse_input_allreduce}, T, attn_out);
    if (lp.attention == Reduce::kImmediate) comm_.all_reduce(attn_out);
    // The post-attention norm runs with the MLP's first projection (the router's, in a MoE layer).
    const SublayerInput mlp_in{h, &residual, attn_out, lw.post_attention_norm, lp.attention == Reduce::kFusedIntoNorm};
    if (c_.mlp_layer_types[l] == MlpType::kDense)
      mlp(mlp_in, lw.dense, T, pending);
    else
      moe(l, mlp_in, T, pending);
    if (lp.mlp == Reduce::kImmediate) comm_.all_reduce(pending);
    ops_.release(layer_scratch);
  }
  if (plan_.final_norm_fused)
    comm_.allreduce_add_rmsnorm(pending, residual.now, w_.final_norm, eps, h);
  else
    ops_.add_rmsnorm(pending, residual.now, w_.final_norm, eps, h);

  const int rows = int(step.logit_rows.size());
  if (rows == 0) return Tensor();  // a prefill chunk that ends no prompt: no logits wanted
  // This rank's vocabulary slice of the logits (all of it unless lm_head is vocab-parallel).
  Tensor selected = ops_.alloc(rows, H), logits = ops_.alloc_typed(rows, shard_.vocab_size, DType::kF32);
  ops_.gather_logit_rows(h, selected);
  ops_.linear(selected, w_.lm_head, logits);
  return logits;
}

}  // namespace tpmoe
