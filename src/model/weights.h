// One rank's weights, as the forward reads them: every tensor already sliced to the rank's shard
// (the code that knows a tensor is column- or row-parallel is the code that slices it, here) and,
// with shared-expert fusion, the shared experts stacked as extra expert rows.
//
// Storage policy: matrices keep their checkpoint dtype (bf16 or fp32; f16 is widened to fp32),
// vectors (norms, router bias) are fp32. MXFP8 matrices (F8_E4M3 + E8M0 block scales) are dequantized
// to fp32 for the CPU oracle, or kept as FP8 with their scales (Tensor::scale) for the CUDA backend.
#pragma once

#include <memory>
#include <vector>

#include "io/checkpoint.h"
#include "model/fusion_plan.h"
#include "model/parallel.h"
#include "model/tensor.h"

namespace tpmoe {

struct AttentionWeights {
  Tensor q_proj;          // [nq_local*hd, H]
  Tensor k_proj, v_proj;  // [nkv_local*hd, H]
  Tensor o_proj;          // [H, nq_local*hd]  row-parallel: its output is a partial sum
  Tensor q_norm, k_norm;  // [hd]
  // Sparse layers only.
  Tensor index_q_proj;                // [nih_local*ihd, H]
  Tensor index_k_proj;                // [ihd, H] replicated
  Tensor index_q_norm, index_k_norm;  // [ihd]
};

struct MlpWeights {
  Tensor gate_up;  // [2n_local, H]: gate half then up half, each this rank's slice
  Tensor down;     // [H, n_local]
};

struct MoeWeights {
  Tensor router;           // [E, H] replicated
  Tensor bias;             // [E] fp32
  Tensor experts_gate_up;  // [R, 2I_local, H], R = physical rows (E, or E+n when fused)
  Tensor experts_down;     // [R, H, I_local]
  MlpWeights shared;       // the shared experts as one MLP when not fused (empty otherwise)
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;
  AttentionWeights attn;
  MlpWeights dense;  // dense-MLP layers
  MoeWeights moe;    // MoE layers
};

struct ModelWeights {
  Tensor embed;       // [V, H]
  Tensor final_norm;  // [H]
  Tensor lm_head;     // [V, H]
  std::vector<LayerWeights> layers;
  size_t bytes = 0;                                   // total bytes of this rank's weights
  std::vector<std::unique_ptr<std::byte[]>> storage;  // owns everything above (host memory)
};

// Calls f(Tensor&) on every tensor of `w` (empty ones included): for moving weights between memories.
template <class F>
void for_each_tensor(ModelWeights& w, F&& f) {
  f(w.embed);
  f(w.final_norm);
  f(w.lm_head);
  for (LayerWeights& l : w.layers) {
    for (Tensor* t : {&l.input_norm,          &l.post_attention_norm, &l.attn.q_proj,        &l.attn.k_proj,
                      &l.attn.v_proj,         &l.attn.o_proj,         &l.attn.q_norm,        &l.attn.k_norm,
                      &l.attn.index_q_proj,   &l.attn.index_k_proj,   &l.attn.index_q_norm,  &l.attn.index_k_norm,
                      &l.dense.gate_up,       &l.dense.down,          &l.moe.router,         &l.moe.bias,
                      &l.moe.experts_gate_up, &l.moe.experts_down,    &l.moe.shared.gate_up, &l.moe.shared.down})
      f(*t);
  }
}

// Storage dtype of a checkpoint matrix of dtype `d` as a format: BF16, F8_E4M3 (MXFP8) or F32.
DType weight_storage_dtype(DType d);

struct LoadOptions {
  // MXFP8 matrices stay F8_E4M3 with their scales (the CUDA backend's weight-only FP8); otherwise
  // they are dequantized to fp32 on load (the CPU oracle). Kept FP8 needs every tensor-parallel
  // slice along K on 32-element block boundaries (an error names the tensor otherwise).
  bool keep_mxfp8 = false;
};

// Loads rank `shard.rank`'s slice of every tensor from `ckpt` into host memory.
ModelWeights load_rank_weights(const io::Checkpoint& ckpt, const RankShard& shard, const FusionPlan& plan,
                               const LoadOptions& options = {});

// Whether routed and shared experts would be stored in the same dtype (fusion stacks them).
bool shared_expert_format_matches(const io::Checkpoint& ckpt);

}  // namespace tpmoe
