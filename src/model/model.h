// The MiniMax-M3 forward (SPEC §1), written once against the Ops interface and a Communicator, so
// it runs unchanged on the CPU oracle and on GPUs. Every tensor-parallel partial sum is reduced where
// the fusion plan says: inside the next norm (fused), right away, or not at all (tp 1).
#pragma once

#include <span>
#include <vector>

#include "model/communicator.h"
#include "model/config.h"
#include "model/fusion_plan.h"
#include "model/ops.h"
#include "model/parallel.h"
#include "model/weights.h"

namespace tpmoe {

class Model {
 public:
  // `weights` must live in the memory `ops` computes on, and outlive the Model.
  Model(const ModelConfig& config, const FusionPlan& plan, const RankShard& shard, const ModelWeights& weights,
        Ops& ops, Communicator& comm);

  // The cache of `max_seqs` slots of `max_len` positions; num_pages 0: a page for every position
  // of every slot (the identity page table).
  CacheShape cache_shape(int max_seqs, int max_len, int page_size = kDefaultPageSize, int num_pages = 0) const;
  // Upper bound of the activation bytes one step of `max_tokens` tokens (and `max_logit_rows`
  // logit rows) allocates, for a backend that reserves its scratch up front. `act_bytes` is the
  // size of the backend's activation dtype.
  static size_t activation_bytes(const ModelConfig& config, const RankShard& shard, int max_tokens, int max_logit_rows,
                                 size_t act_bytes);
  // Runs one step (the caller has made it current with ops.begin_step) and returns this rank's
  // logits of step.logit_rows as [rows, shard().vocab_size] fp32 (vocabulary entries from
  // shard().vocab_begin), in backend memory (an empty tensor when the step wants no rows). Launches only: no host sync,
  // so a backend can capture it in a graph.
  Tensor forward(const StepTokens& step);
  const RankShard& shard() const { return shard_; }
  int num_layers() const { return c_.num_layers; }
  int num_experts() const { return c_.num_experts; }
  Communicator& comm() { return comm_; }

 private:
  // A sublayer's input h: ready, or made by the norm of the residual stream in front of the sublayer,
  // which the sublayer runs together with its first projections (project(): one call, so a backend
  // may fuse the norm into them).
  // The fp32 residual stream: `now` holds it; `spare`, of its shape, is where a norm may write the
  // next value instead of updating `now` in place (Ops::add_rmsnorm_linears), after which they swap.
  struct ResidualStream {
    Tensor now, spare;
  };
  struct SublayerInput {
    Tensor h;
    // Null: h is ready. Set: residual += partial, then h = norm(residual) with norm_weight; the
    // partial is all-reduced inside the norm when reduce_in_norm (the fusion plan), and there is none
    // for the first layer's input norm (the residual is the embedding).
    ResidualStream* residual = nullptr;
    Tensor partial, norm_weight;
    bool reduce_in_norm = false;
  };
  // The projections of the input's h, after its norm when it has one.
  void project(const SublayerInput& in, std::span<const Projection> items);
  // Each writes its (partial-sum) output into `out`; temporaries come from the layer's scratch.
  void attention(int layer, const SublayerInput& in, int T, Tensor out);
  void mlp(const SublayerInput& in, const MlpWeights& w, int T, Tensor out);
  void moe(int layer, const SublayerInput& in, int T, Tensor out);

  const ModelConfig& c_;
  const FusionPlan& plan_;
  RankShard shard_;
  const ModelWeights& w_;
  Ops& ops_;
  Communicator& comm_;
};

}  // namespace tpmoe
