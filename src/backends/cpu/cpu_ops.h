// The CPU backend: the reference implementation of every op (the oracle every other backend is
// tested against). fp32 math over weights in their stored dtype (bf16 or fp32, widened exactly on
// the fly), OpenMP across output rows. Clarity first: each op is written the way SPEC §1 states it.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "backends/cpu/decision_margins.h"
#include "model/ops.h"

namespace tpmoe::cpu {

class CpuOps final : public Ops {
 public:
  Tensor alloc(int64_t rows, int64_t cols) override { return alloc_typed(rows, cols, DType::kF32); }
  Tensor alloc_typed(int64_t rows, int64_t cols, DType dtype) override;
  size_t mark() override { return workspace_.size(); }
  void release(size_t mark) override { workspace_.resize(mark); }
  void init_cache(const CacheShape& shape) override;
  void begin_step(const StepTokens& step) override;

  void embed(Tensor table, Tensor out) override;
  void rmsnorm(Tensor x, Tensor weight, float eps, Tensor out) override;
  void add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor out) override;
  void add(Tensor x, Tensor y) override;
  void linear(Tensor x, Tensor weight, Tensor out) override;
  void head_norm_rope(std::span<const HeadNormRope> items) override;
  void attention(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, const AttentionParams& p,
                 Tensor out) override;
  void swiglu(Tensor gate_up, const SwigluParams& p, Tensor out) override;
  void route(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids, Tensor slot_weights) override;
  void moe_experts(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down, const SwigluParams& p,
                   float scale, Tensor out) override;
  void gather_logit_rows(Tensor x, Tensor out) override;
  void argmax(Tensor logits, Tensor ids, Tensor values) override;
  void enable_routing_stats(int num_layers, int num_experts) override;
  std::vector<int> take_routed_experts() override;
  void sample(Tensor logits, const SampleBatch& batch, Tensor ids) override;  // in cpu_sampling.cpp
  void copy_columns(Tensor src, Tensor dst, int64_t col_offset) override;
  void upload_ids(const std::vector<int32_t>& ids, Tensor dst) override;
  void combine_vocab_argmax(Tensor gathered, int64_t slice_size, Tensor ids) override;
  void keep_ids(Tensor ids) override;
  std::vector<int32_t> take_kept_ids() override;
  std::vector<float> to_host(Tensor t) override;
  std::vector<int32_t> ids_to_host(Tensor ids) override;

  // Records every router and indexer decision margin of the steps that follow into `recorder`
  // (nullptr stops). Only reads what the ops compute anyway: the logits stay bitwise the same.
  void set_decision_recorder(DecisionRecorder* recorder) { recorder_ = recorder; }

 private:
  void head_norm_rope_one(Tensor x, int num_heads, Tensor weight, const RopeParams& p);
  struct LayerCache {
    std::vector<float> k, v;     // [max_seqs][max_len][num_kv_heads][head_dim]
    std::vector<float> index_k;  // [max_seqs][max_len][index_head_dim], sparse layers only
  };
  const StepTokens* step_ = nullptr;
  StepTokens fed_step_;                        // the current step with its kFedBackId tokens resolved, where it had any
  std::deque<std::vector<int32_t>> kept_ids_;  // keep_ids, oldest first; the last one feeds the next step
  CacheShape cache_shape_;
  std::vector<LayerCache> cache_;
  std::vector<std::unique_ptr<std::byte[]>> workspace_;
  std::vector<uint8_t> routed_;  // [layer][expert]: chosen since the last take (routing stats on)
  int routed_experts_ = 0;
  DecisionRecorder* recorder_ = nullptr;
};

// Free functions the ops are built from, exposed so tests can check them on their own.

// Gemma RMSNorm of one row: y = v / sqrt(mean(v^2) + eps) * (1 + w).
void gemma_rmsnorm_row(const float* v, const float* w, int n, float eps, float* y);
// SwiGLU-OAI of one value pair.
float swiglu_oai(float gate, float up, const SwigluParams& p);
// The blocks the lightning indexer keeps for a query at position `pos` given its scores against
// keys 0..pos (scores[t] for t <= pos). Returns block indices, best first.
std::vector<int> select_blocks(const float* scores, int pos, int block_size, int topk_blocks, int local_blocks);

}  // namespace tpmoe::cpu
