// The CUDA backend of the Ops interface: bf16 activations and weights, fp32 residual stream and
// accumulation, one stream, every buffer reserved up front. A step allocates from a bump arena
// (reset by begin_step, scoped per layer by mark/release) and launches only, so a decode step is
// recorded once per batch-size bucket as a CUDA graph and replayed (run_step).
#pragma once

#include <cuda_runtime.h>

#include <compare>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/attention.cuh"
#include "backends/cuda/gemm.h"
#include "backends/cuda/gemv.cuh"
#include "backends/cuda/kernel_timeline.h"
#include "backends/cuda/moe.cuh"
#include "model/fusion_plan.h"
#include "model/ops.h"
#include "model/parallel.h"

namespace tpmoe::cuda {

// What CudaOps reserves at construction. The engine derives it from the model (Model::activation_bytes,
// moe_workspace_bytes) so a step can never run out of scratch.
struct CudaReserve {
  int max_tokens = 0;      // tokens per step
  size_t arena_bytes = 0;  // activations of one step
  size_t moe_workspace_bytes = 0;
  // Attention workspace dimensions (the context length comes with init_cache).
  int num_q_heads = 0, num_index_heads = 0, head_dim = 0, block_size = 1, topk_blocks = 1;

  // What one rank needs for steps within `budget` (the engine's policy, not the backend's).
  static CudaReserve for_budget(const ModelConfig& config, const FusionPlan& plan, const RankShard& shard,
                                const StepBudget& budget);
};

struct CudaOpsOptions {
  // Per-op GPU time, for finding where a step goes (--profile-ops). Steps then run eagerly (no
  // graph) and the totals per op are printed to stderr when the ops are destroyed.
  bool profile_ops = false;
  // Every replay of a recorded step, kernel by kernel (kernel_timeline.h): the report goes to stderr
  // when the ops are destroyed.
  bool kernel_timeline = false;
  // Programmatic dependent launch between the kernels of a step (kernel_utils.cuh).
  bool pdl = true;
  // Linears of <= 8 tokens on the weight-streaming GEMV (gemv.cuh), which also runs several
  // projections of one input as one launch, bf16 linears of 9 to kBf16SkinnyLinearMaxM tokens on the
  // skinny linear (skinny_linear.cuh), and the MoE of a single token on its two GEMVs
  // (moe_gemv.cuh); false: one cuBLASLt matmul each and the grouped-GEMM MoE (for comparison).
  // MXFP8 linears take tpmoe's kernels either way (launch_fp8_linear: cuBLASLt has no MXFP8 on
  // Hopper).
  bool decode_gemv = true;
};

// The most tokens a bf16 linear runs on the skinny linear rather than cuBLASLt (decode_gemv): at 9-16
// tokens it measured faster than cuBLASLt and the split-k grouped GEMM at nearly every dense shape of
// a tp-8 and a tp-4 rank; from 17 tokens it ties cuBLASLt, and from 33 it is slower (docs/PERF.md).
inline constexpr int kBf16SkinnyLinearMaxM = 16;

class CudaOps final : public Ops {
 public:
  CudaOps(const CudaReserve& reserve, const CudaOpsOptions& options = {});
  ~CudaOps() override;

  cudaStream_t stream() const { return stream_; }
  // stream() with the PDL choice of the options: what this object's launches go to.
  KernelStream kernel_stream() const { return kernels_; }
  // A layer's KV cache on the device (init_cache): for tests that check what a step stored.
  const KvCacheLayer& cache_layer(int layer) const { return cache_.at(size_t(layer)); }
  // Called first when the ops are destroyed (after the stream is drained, before it goes): whoever
  // enqueues on stream() - a communicator - lets go of it there.
  void set_on_destroy(std::function<void()> f) { on_destroy_ = std::move(f); }

  Tensor alloc(int64_t rows, int64_t cols) override { return alloc_typed(rows, cols, DType::kBF16); }
  Tensor alloc_typed(int64_t rows, int64_t cols, DType dtype) override;
  size_t mark() override { return arena_used_; }
  void release(size_t mark) override { arena_used_ = mark; }
  Tensor run_step(int key, const std::function<Tensor()>& body) override;
  bool records_steps() const override { return true; }
  int last_step_launches() const override { return last_step_launches_; }
  void init_cache(const CacheShape& shape) override;
  void begin_step(const StepTokens& step) override;

  void embed(Tensor table, Tensor out) override;
  void rmsnorm(Tensor x, Tensor weight, float eps, Tensor out) override;
  void add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor out) override;
  Tensor add_rmsnorm_linears(Tensor partial, Tensor residual, Tensor spare, Tensor weight, float eps, Tensor out,
                             std::span<const Projection> items) override;
  void add(Tensor x, Tensor y) override;
  void linear(Tensor x, Tensor weight, Tensor out) override;
  void linears(Tensor x, std::span<const Projection> items) override;
  void head_norm_rope(std::span<const HeadNormRope> items) override;
  void attention(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, const AttentionParams& p,
                 Tensor out) override;
  // One launch for the norm + RoPE that also stores k, v and index_k into the layer's cache, then
  // attention without its cache-write launch (attention.cu's header).
  void rotate_and_attend(std::span<const HeadNormRope> rotate, Tensor q, Tensor k, Tensor v, Tensor index_q,
                         Tensor index_k, const AttentionParams& p, Tensor out) override;
  void swiglu(Tensor gate_up, const SwigluParams& p, Tensor out) override;
  void route(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids, Tensor slot_weights) override;
  void moe_experts(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down, const SwigluParams& p,
                   float scale, Tensor out) override;
  void route_experts(Tensor x, const Routing& r, Tensor gate_up, Tensor down, const SwigluParams& p, float scale,
                     Tensor out) override;
  void gather_logit_rows(Tensor x, Tensor out) override;
  void argmax(Tensor logits, Tensor ids, Tensor values) override;
  void enable_routing_stats(int num_layers, int num_experts) override;
  std::vector<int> take_routed_experts() override;
  // In sampling.cu's launcher; buffers grow on demand (not inside a recorded step).
  void sample(Tensor logits, const SampleBatch& batch, Tensor ids) override;
  void copy_columns(Tensor src, Tensor dst, int64_t col_offset) override;
  void upload_ids(const std::vector<int32_t>& ids, Tensor dst) override;
  void combine_vocab_argmax(Tensor gathered, int64_t slice_size, Tensor ids) override;
  void keep_ids(Tensor ids) override;
  std::vector<int32_t> take_kept_ids() override;
  std::vector<float> to_host(Tensor t) override;
  std::vector<int32_t> ids_to_host(Tensor ids) override;

 private:
  CudaReserve reserve_;
  std::function<void()> on_destroy_;
  cudaStream_t stream_ = nullptr;
  KernelStream kernels_;  // stream_ and CudaOpsOptions::pdl
  Gemm gemm_;
  std::byte* arena_ = nullptr;
  size_t arena_used_ = 0;
  void* moe_workspace_ = nullptr;
  void* attention_workspace_ = nullptr;
  size_t attention_workspace_bytes_ = 0;

  // The current step's metadata on the device: token ids, positions, slots, logit rows (one copy).
  int32_t* step_device_ = nullptr;
  int32_t* step_pinned_ = nullptr;
  cudaEvent_t step_uploaded_ = nullptr;  // recorded after the step's uploads from the pinned buffers
  int num_tokens_ = 0, num_logit_rows_ = 0;
  int64_t steps_begun_ = 0;
  int32_t *token_ids_ = nullptr, *positions_ = nullptr, *seq_slots_ = nullptr, *logit_rows_ = nullptr;
  int32_t* num_real_tokens_ = nullptr;  // on the device, so a recorded step reads the current count

  // keep_ids: the last kept ids on the device, where a recorded embed reads kFedBackId tokens' ids
  // ([max_tokens]; fed_count_ of them hold ids), and two pinned slots their host copies land in, each
  // with the event that says it has, taken oldest first.
  int32_t* fed_ids_ = nullptr;
  int fed_count_ = 0;
  int32_t* kept_pinned_ = nullptr;  // [2][max_tokens]
  cudaEvent_t kept_copied_[2] = {};
  struct KeptIds {
    int slot = 0, count = 0;
  };
  std::deque<KeptIds> kept_;

  uint8_t* routed_ = nullptr;  // [layer][expert] marks of the routing stats (null: off)
  int routed_layers_ = 0, routed_experts_ = 0;

  CacheShape cache_shape_;
  std::vector<KvCacheLayer> cache_;
  std::vector<void*> cache_allocations_;
  // The page table on the device ([max_seqs][pages_per_seq]), its pinned staging copy, and the
  // table it holds now (uploaded again only when a step's table differs).
  int32_t* page_table_device_ = nullptr;
  int32_t* page_table_pinned_ = nullptr;
  std::vector<int32_t> page_table_current_, page_table_identity_;

  // Per-op GPU time (CudaOpsOptions::profile_ops).
  class OpTimer {
   public:
    OpTimer(CudaOps& ops, std::string name);
    ~OpTimer();
    OpTimer(const OpTimer&) = delete;
    OpTimer& operator=(const OpTimer&) = delete;

   private:
    CudaOps* ops_ = nullptr;
    std::string name_;
    cudaEvent_t start_ = nullptr;
  };
  OpTimer timed(std::string name) { return OpTimer(*this, std::move(name)); }
  void collect_op_times();  // after a sync: fold finished event pairs into the totals
  bool profile_ops_ = false;
  std::unique_ptr<KernelTimeline> timeline_;  // CudaOpsOptions::kernel_timeline
  bool decode_gemv_ = true;
  // The decode GEMV's launch for these projections of x; false: it does not take them.
  bool gemv_params(Tensor x, std::span<const Projection> items, GemvParams& p) const;
  // The kernel's view of attention() (rotate_and_attend() launches it with cache_written).
  AttentionKernelParams attention_params(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k,
                                         const AttentionParams& p, Tensor out) const;
  // The kernels' views of route() and moe_experts() (route_experts() launches both in one).
  RouteKernelParams route_params(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids,
                                 Tensor slot_weights) const;
  MoeKernelParams moe_params(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down,
                             const SwigluParams& p, float scale, Tensor out) const;
  struct PendingTime {
    std::string name;
    cudaEvent_t start, stop;
  };
  std::vector<PendingTime> pending_times_;
  std::map<std::string, std::pair<double, int>> op_times_;  // name -> (ms, calls)

  // sample(): the rows' args and penalty entries, uploaded per call through pinned memory, and the
  // kernels' workspace. Grown on demand (sample() never runs inside a recorded step).
  void* sample_device_ = nullptr;
  size_t sample_device_bytes_ = 0;
  std::byte* sample_pinned_ = nullptr;
  size_t sample_pinned_bytes_ = 0;
  void* sample_workspace_ = nullptr;
  size_t sample_workspace_bytes_ = 0;
  cudaEvent_t sample_uploaded_ = nullptr;  // the last upload has left the pinned buffer

  struct Graph {
    cudaGraphExec_t exec = nullptr;
    Tensor output;
    size_t arena_used = 0;  // scratch the recorded step holds; later allocations go after it
    int kernels = 0;        // kernel launches the recording replays
  };
  int last_step_launches_ = 0;
  // Recorded steps by the caller's key, the context bound (the attention grid depends on it) and
  // whether the step keeps earlier keys (the attention kernel's decode_step).
  struct GraphKey {
    int key = 0;
    int context_bound = 0;
    bool decode_step = false;
    auto operator<=>(const GraphKey&) const = default;
  };
  std::map<GraphKey, Graph> graphs_;
  int context_bound_ = 0;  // the current step's (begin_step): positions below it, a power of two
  // The current step's step_keeps_earlier_keys (begin_step): its attention may read the keys of
  // earlier steps before the kernel that stores its own keys is done.
  bool decode_step_ = false;
  EarlierKeysScratch earlier_keys_;  // step_keeps_earlier_keys' scratch (sized by init_cache)
};

}  // namespace tpmoe::cuda
