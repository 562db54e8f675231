#include "backends/cuda/cuda_ops.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/elementwise.cuh"
#include "backends/cuda/gemv.cuh"
#include "backends/cuda/moe.cuh"
#include "backends/cuda/norm.cuh"
#include "backends/cuda/sampling.cuh"
#include "backends/cuda/skinny_linear.cuh"
#include "core/error.h"
#include "model/model.h"
#include "model/sample_batch.h"

namespace tpmoe::cuda {

namespace {
constexpr size_t kAllocAlign = 256;    // every arena allocation starts 256-byte aligned (16-byte loads, cuBLASLt)
constexpr int kMinContextBound = 256;  // the attention grid's smallest context bound (one split of 256 keys)

const __nv_bfloat16* bf16(const Tensor& t) { return static_cast<const __nv_bfloat16*>(t.data); }
__nv_bfloat16* bf16_mut(const Tensor& t) { return static_cast<__nv_bfloat16*>(t.data); }

void expect(const Tensor& t, DType dtype, const char* what) {
  TPMOE_CHECK(t.dtype == dtype, "CUDA backend: {} must be {}, got {}", what, dtype_name(dtype), dtype_name(t.dtype));
}

// The kernel's view of head_norm_rope's items (no cache store), into out[0, items.size()).
void head_norm_rope_params(std::span<const HeadNormRope> items, const int32_t* positions, HeadNormRopeParams* out) {
  TPMOE_CHECK(items.size() <= size_t(kMaxHeadNormRopeItems), "CUDA head_norm_rope: {} tensors in one call, at most {}",
              items.size(), kMaxHeadNormRopeItems);
  for (size_t i = 0; i < items.size(); ++i) {
    const HeadNormRope& it = items[i];
    const RopeParams& p = it.rope;
    expect(it.x, DType::kBF16, "head_norm_rope input");
    out[i] = {bf16_mut(it.x), it.weight.as<float>(),
              positions,      int(it.x.dim(0)),
              it.num_heads,   p.head_dim,
              p.rotary_dim,   p.theta,
              p.eps};
  }
}
}  // namespace

CudaOps::OpTimer::OpTimer(CudaOps& ops, std::string name) {
  if (!ops.profile_ops_) return;
  ops_ = &ops;
  name_ = std::move(name);
  CUDA_CHECK(cudaEventCreate(&start_));
  CUDA_CHECK(cudaEventRecord(start_, ops.stream_));
}

CudaOps::OpTimer::~OpTimer() {
  if (!ops_) return;
  cudaEvent_t stop;
  if (cudaEventCreate(&stop) != cudaSuccess || cudaEventRecord(stop, ops_->stream_) != cudaSuccess) return;
  ops_->pending_times_.push_back({std::move(name_), start_, stop});
}

void CudaOps::collect_op_times() {
  // The first two steps (prefill, first decode) load kernels and plan cuBLASLt shapes: not counted.
  const bool warm = steps_begun_ > 2;
  for (auto& p : pending_times_) {
    if (!warm) {
      cudaEventDestroy(p.start);
      cudaEventDestroy(p.stop);
      continue;
    }
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
    auto& [total, calls] = op_times_[p.name];
    total += ms;
    ++calls;
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.stop);
  }
  pending_times_.clear();
}

CudaReserve CudaReserve::for_budget(const ModelConfig& config, const FusionPlan& plan, const RankShard& shard,
                                    const StepBudget& budget) {
  CudaReserve r;
  r.max_tokens = budget.max_tokens;
  const int max_logit_rows = budget.max_logit_rows;
  // The model's activations, plus the greedy argmax's per-block winners that follow them, plus the
  // output of linears()' joined matmul: a layer's projections of the attention input side by side
  // (bf16), beside the layer's own activations until the layer ends.
  const size_t joined_cols = size_t(shard.num_q_heads + 2 * shard.num_kv_heads) * size_t(config.head_dim) +
                             size_t(shard.num_index_heads + 1) * size_t(std::max(0, config.index_head_dim));
  r.arena_bytes = Model::activation_bytes(config, shard, r.max_tokens, max_logit_rows, sizeof(uint16_t)) +
                  argmax_workspace_bytes(max_logit_rows, config.vocab_size) + kAllocAlign +
                  size_t(r.max_tokens) * joined_cols * sizeof(uint16_t) + kAllocAlign;
  if (config.any_moe()) {
    const int slots = config.num_experts_per_tok + (plan.shared_expert.fused ? config.num_shared_experts : 0);
    r.moe_workspace_bytes = cuda::moe_workspace_bytes(r.max_tokens, slots, config.hidden_size, shard.moe_inter,
                                                      plan.shared_expert.physical_rows);
  }
  r.num_q_heads = shard.num_q_heads;
  r.num_index_heads = shard.num_index_heads;
  r.head_dim = config.head_dim;
  r.block_size = std::max(1, config.index_block_size);
  r.topk_blocks = std::max(1, config.index_topk_blocks);
  return r;
}

CudaOps::CudaOps(const CudaReserve& reserve, const CudaOpsOptions& options)
    : reserve_(reserve), profile_ops_(options.profile_ops), decode_gemv_(options.decode_gemv) {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  kernels_ = {stream_, options.pdl};
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&arena_), reserve.arena_bytes));
  if (reserve.moe_workspace_bytes) CUDA_CHECK(cudaMalloc(&moe_workspace_, reserve.moe_workspace_bytes));
  // Token ids, positions, slots and logit rows: 4 arrays of max_tokens.
  const size_t step_bytes = (4 * size_t(reserve.max_tokens) + 1) * sizeof(int32_t);
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&step_device_), step_bytes));
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&step_pinned_), step_bytes));
  CUDA_CHECK(cudaEventCreateWithFlags(&step_uploaded_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(step_uploaded_, stream_));
  token_ids_ = step_device_;
  positions_ = step_device_ + reserve.max_tokens;
  seq_slots_ = step_device_ + 2 * reserve.max_tokens;
  logit_rows_ = step_device_ + 3 * reserve.max_tokens;
  num_real_tokens_ = step_device_ + 4 * reserve.max_tokens;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&fed_ids_), sizeof(int32_t) * reserve.max_tokens));
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&kept_pinned_), 2 * sizeof(int32_t) * reserve.max_tokens));
  for (cudaEvent_t& e : kept_copied_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (options.kernel_timeline) {
    timeline_ = std::make_unique<KernelTimeline>();
    timeline_->start();  // before any graph is recorded, so that every replay's kernels are seen
  }
}

CudaOps::~CudaOps() {
  cudaStreamSynchronize(stream_);
  if (on_destroy_) on_destroy_();
  if (timeline_) {
    try {
      timeline_->stop();
      fmt::print(stderr, "Kernel timeline of the replayed steps (--kernel-timeline; CUPTI, times in us):\n{}",
                 kernel_timeline_report(summarize_timeline(timeline_->runs())));
    } catch (const std::exception& e) {
      fmt::print(stderr, "--kernel-timeline: {}\n", e.what());
    }
    timeline_.reset();
  }
  if (profile_ops_) {
    collect_op_times();
    double all = 0;
    for (const auto& [name, t] : op_times_) all += t.first;
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [name, t] : op_times_)
      rows.push_back({t.first, fmt::format("{:>10.3f} ms {:>5.1f}% {:>7} calls  {}", t.first, 100 * t.first / all,
                                           t.second, name)});
    std::sort(rows.rbegin(), rows.rend());
    fmt::print(stderr, "GPU time per op after the first two steps (--profile-ops, steps run eagerly):\n");
    for (const auto& r : rows) fmt::print(stderr, "{}\n", r.second);
  }
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
  for (void* p : cache_allocations_) cudaFree(p);
  cudaFreeHost(page_table_pinned_);
  cudaFree(sample_device_);
  cudaFree(sample_workspace_);
  cudaFreeHost(sample_pinned_);
  if (sample_uploaded_) cudaEventDestroy(sample_uploaded_);
  cudaFree(attention_workspace_);
  cudaFree(moe_workspace_);
  cudaFree(arena_);
  cudaFree(step_device_);
  cudaFree(routed_);
  cudaFreeHost(step_pinned_);
  cudaEventDestroy(step_uploaded_);
  cudaFree(fed_ids_);
  cudaFreeHost(kept_pinned_);
  for (cudaEvent_t e : kept_copied_) cudaEventDestroy(e);
  cudaStreamDestroy(stream_);
}

Tensor CudaOps::alloc_typed(int64_t rows, int64_t cols, DType dtype) {
  const size_t bytes = (size_t(rows * cols) * dtype_size(dtype) + kAllocAlign - 1) / kAllocAlign * kAllocAlign;
  TPMOE_CHECK(arena_used_ + bytes <= reserve_.arena_bytes,
              "CUDA backend: step scratch exhausted ({} of {} bytes reserved); the activation estimate is wrong",
              arena_used_ + bytes, reserve_.arena_bytes);
  Tensor t = Tensor::make(arena_ + arena_used_, dtype, rows, cols);
  arena_used_ += bytes;
  return t;
}

void CudaOps::init_cache(const CacheShape& shape) {
  shape.validate();
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // nothing in flight may still read the old cache
  for (void* p : cache_allocations_) CUDA_CHECK(cudaFree(p));
  cache_allocations_.clear();
  cache_.clear();
  cudaFreeHost(page_table_pinned_);
  page_table_pinned_ = nullptr;
  for (auto& [key, g] : graphs_) CUDA_CHECK(cudaGraphExecDestroy(g.exec));  // they point at the old cache
  graphs_.clear();
  cache_shape_ = shape;
  earlier_keys_ = EarlierKeysScratch(shape.num_pages);

  const size_t rows = size_t(shape.num_pages) * size_t(shape.page_size);
  const size_t kv_bytes = rows * shape.num_kv_heads * shape.head_dim * sizeof(__nv_bfloat16);
  const size_t index_bytes = rows * shape.index_head_dim * sizeof(__nv_bfloat16);
  const size_t table_entries = size_t(shape.max_seqs) * shape.pages_per_seq();
  size_t total = table_entries * sizeof(int32_t);
  for (int l = 0; l < shape.num_layers; ++l) total += 2 * kv_bytes + (shape.sparse_layer[l] ? index_bytes : 0);
  attention_workspace_bytes_ =
      attention_workspace_bytes(reserve_.max_tokens, reserve_.num_q_heads, reserve_.num_index_heads, reserve_.head_dim,
                                shape.max_len, reserve_.block_size, reserve_.topk_blocks);
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  TPMOE_CHECK(total + attention_workspace_bytes_ <= free_bytes,
              "KV cache of {} pages x {} positions ({} slots of up to {}) needs {:.2f} GiB but only {:.2f} GiB of GPU "
              "memory is free: ask for fewer pages or shorter sequences",
              shape.num_pages, shape.page_size, shape.max_seqs, shape.max_len,
              double(total + attention_workspace_bytes_) / (1ull << 30), double(free_bytes) / (1ull << 30));
  cudaFree(attention_workspace_);
  CUDA_CHECK(cudaMalloc(&attention_workspace_, std::max<size_t>(attention_workspace_bytes_, 1)));
  // Its head, the split kernel's arrival counters, starts at zero; every launch leaves it so.
  CUDA_CHECK(cudaMemsetAsync(attention_workspace_, 0, attention_workspace_zeroed_bytes(), stream_));

  // The page table starts as the identity (what a step without a table means, StepTokens).
  void* table = nullptr;
  CUDA_CHECK(cudaMalloc(&table, table_entries * sizeof(int32_t)));
  cache_allocations_.push_back(table);
  page_table_device_ = static_cast<int32_t*>(table);
  CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&page_table_pinned_), table_entries * sizeof(int32_t)));
  page_table_identity_.resize(table_entries);
  for (size_t i = 0; i < table_entries; ++i) page_table_identity_[i] = int64_t(i) < shape.num_pages ? int32_t(i) : -1;
  page_table_current_.clear();  // uploaded by the first begin_step

  int page_shift = 0;
  while ((1 << page_shift) < shape.page_size) ++page_shift;
  for (int l = 0; l < shape.num_layers; ++l) {
    KvCacheLayer c;
    c.page_table = page_table_device_;
    c.max_seqs = shape.max_seqs;
    c.max_len = shape.max_len;
    c.page_shift = page_shift;
    c.pages_per_seq = shape.pages_per_seq();
    c.num_kv_heads = shape.num_kv_heads;
    c.head_dim = shape.head_dim;
    c.index_head_dim = shape.index_head_dim;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, 2 * kv_bytes));
    cache_allocations_.push_back(p);
    c.k = static_cast<__nv_bfloat16*>(p);
    c.v = c.k + kv_bytes / sizeof(__nv_bfloat16);
    if (shape.sparse_layer[l]) {
      CUDA_CHECK(cudaMalloc(&p, index_bytes));
      cache_allocations_.push_back(p);
      c.index_k = static_cast<__nv_bfloat16*>(p);
    }
    cache_.push_back(c);
  }
}

void CudaOps::begin_step(const StepTokens& step) {
  const int T = step.num_tokens(), R = int(step.logit_rows.size());
  TPMOE_CHECK(T <= reserve_.max_tokens, "CUDA backend: a step of {} tokens exceeds the {} reserved", T,
              reserve_.max_tokens);
  check_step_fits_cache(step, cache_shape_);
  for (int t = 0; t < T; ++t)
    TPMOE_CHECK(step.token_ids[t] != StepTokens::kFedBackId || t < fed_count_,
                "token {} of the step feeds back the last step's id, but {} ids were kept", t, fed_count_);
  // The previous step's uploads have left the pinned buffers (a step without host reads, e.g. a
  // prefill chunk that wants no logits, has not synchronised the stream).
  CUDA_CHECK(cudaEventSynchronize(step_uploaded_));
  const int n = reserve_.max_tokens;
  std::memcpy(step_pinned_, step.token_ids.data(), sizeof(int32_t) * T);
  std::memcpy(step_pinned_ + n, step.positions.data(), sizeof(int32_t) * T);
  std::memcpy(step_pinned_ + 2 * n, step.seq_slots.data(), sizeof(int32_t) * T);
  std::memcpy(step_pinned_ + 3 * n, step.logit_rows.data(), sizeof(int32_t) * R);
  step_pinned_[4 * n] = T - step.num_padding;
  CUDA_CHECK(
      cudaMemcpyAsync(step_device_, step_pinned_, (4 * n + 1) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  const std::vector<int32_t>& table = step.page_table.empty() ? page_table_identity_ : step.page_table;
  if (table != page_table_current_) {
    std::memcpy(page_table_pinned_, table.data(), table.size() * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpyAsync(page_table_device_, page_table_pinned_, table.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    page_table_current_ = table;
  }
  CUDA_CHECK(cudaEventRecord(step_uploaded_, stream_));
  // The attention grid covers positions below a power of two (256 at least) above the step's
  // largest, not the whole cache: few splits for short contexts, few recordings per batch size.
  int max_position = 0;
  for (int32_t p : step.positions) max_position = std::max(max_position, p);
  context_bound_ = kMinContextBound;
  while (context_bound_ <= max_position) context_bound_ *= 2;
  context_bound_ = std::min(context_bound_, cache_shape_.max_len);
  decode_step_ = step_keeps_earlier_keys(step, cache_shape_, earlier_keys_);
  num_tokens_ = T;
  num_logit_rows_ = R;
  arena_used_ = 0;
  ++steps_begun_;
}

Tensor CudaOps::run_step(int key, const std::function<Tensor()>& body) {
  if (profile_ops_) return body();  // per-op events need eager launches
  const GraphKey graph_key{key, context_bound_, decode_step_};
  auto it = graphs_.find(graph_key);
  if (it == graphs_.end()) {
    // Record the step once; allocation inside it is a deterministic bump, so replays reuse the
    // same addresses, including the returned logits.
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    Graph g;
    try {
      g.output = body();
    } catch (...) {
      cudaGraph_t broken;
      cudaStreamEndCapture(stream_, &broken);
      if (broken) cudaGraphDestroy(broken);
      throw;
    }
    g.arena_used = arena_used_;
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    // Launches per step: the kernel nodes the recording holds (cuBLASLt's included).
    size_t nodes = 0;
    CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    std::vector<cudaGraphNode_t> all(nodes);
    if (nodes) CUDA_CHECK(cudaGraphGetNodes(graph, all.data(), &nodes));
    for (cudaGraphNode_t n : all) {
      cudaGraphNodeType type;
      CUDA_CHECK(cudaGraphNodeGetType(n, &type));
      g.kernels += type == cudaGraphNodeTypeKernel;
    }
    CUDA_CHECK(cudaGraphInstantiate(&g.exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    it = graphs_.emplace(graph_key, g).first;
  }
  CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
  last_step_launches_ = it->second.kernels;
  arena_used_ = it->second.arena_used;
  return it->second.output;
}

void CudaOps::embed(Tensor table, Tensor out) {
  const auto timer = timed("embed");
  expect(out, DType::kF32, "the residual stream");
  static_assert(StepTokens::kFedBackId == kEmbedFedBackId);
  launch_embed({bf16(table), token_ids_, out.as<float>(), num_tokens_, int(table.dim(1)), int(table.dim(0)), fed_ids_},
               kernels_);
}

void CudaOps::rmsnorm(Tensor x, Tensor weight, float eps, Tensor out) {
  const auto timer = timed("rmsnorm");
  expect(x, DType::kF32, "rmsnorm input (the residual stream)");
  launch_add_rmsnorm({nullptr, x.as<float>(), weight.as<float>(), bf16_mut(out), int(x.dim(0)), int(x.dim(1)), eps},
                     kernels_);
}

void CudaOps::add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor out) {
  const auto timer = timed("add_rmsnorm");
  expect(partial, DType::kBF16, "add_rmsnorm partial");
  expect(residual, DType::kF32, "the residual stream");
  launch_add_rmsnorm({bf16(partial), residual.as<float>(), weight.as<float>(), bf16_mut(out), int(residual.dim(0)),
                      int(residual.dim(1)), eps},
                     kernels_);
}

Tensor CudaOps::add_rmsnorm_linears(Tensor partial, Tensor residual, Tensor spare, Tensor weight, float eps, Tensor out,
                                    std::span<const Projection> items) {
  GemvParams p;
  if (partial.dtype == DType::kBF16 && residual.dtype == DType::kF32 && spare.dtype == DType::kF32 &&
      spare.ndim == residual.ndim && spare.shape == residual.shape && spare.data != residual.data &&
      residual.dim(0) == out.dim(0) && residual.dim(1) == out.dim(1) && gemv_params(out, items, p)) {
    p.x = nullptr;  // the launch computes x: the norm's out
    p.norm = {bf16(partial), residual.as<float>(), spare.as<float>(), weight.as<float>(), eps, bf16_mut(out)};
    if (gemv_norm_pays(p)) {
      const auto timer = timed(fmt::format("add_rmsnorm + linears x{}", items.size()));
      launch_gemv(p, kernels_);
      return spare;  // the sums went there (gemv.cuh)
    }
  }
  add_rmsnorm(partial, residual, weight, eps, out);
  if (items.size() == 1)
    linear(out, items[0].weight, items[0].out);
  else
    linears(out, items);
  return residual;
}

void CudaOps::add(Tensor x, Tensor y) {
  const auto timer = timed("add");
  launch_add_bf16(bf16(x), bf16_mut(y), y.numel(), kernels_);
}

bool CudaOps::gemv_params(Tensor x, std::span<const Projection> items, GemvParams& p) const {
  if (!decode_gemv_ || x.dim(0) > kGemvMaxM || items.size() > size_t(kMaxGemvOutputs)) return false;
  p = GemvParams{};
  p.x = bf16(x);
  p.M = int(x.dim(0));
  p.K = int(x.dim(1));
  for (const Projection& it : items) {
    const bool fp8 = it.weight.dtype == DType::kF8E4M3;
    // Anything else is for linear()'s own checks to name.
    if ((!fp8 && it.weight.dtype != DType::kBF16) || (it.out.dtype != DType::kF32 && it.out.dtype != DType::kBF16))
      return false;
    TPMOE_CHECK(it.weight.dim(1) == x.dim(1) && it.out.dim(0) == x.dim(0) && it.out.dim(1) == it.weight.dim(0),
                "linear: x [{}, {}], weight [{}, {}], out [{}, {}] do not fit", x.dim(0), x.dim(1), it.weight.dim(0),
                it.weight.dim(1), it.out.dim(0), it.out.dim(1));
    p.outputs[p.count++] = {it.weight.data, fp8 ? static_cast<const uint8_t*>(it.weight.scale) : nullptr, it.out.data,
                            it.out.dtype == DType::kF32, int(it.weight.dim(0))};
  }
  return gemv_fits(p);
}

namespace {

// The items' weights as one [sum of rows, K] matrix, where each starts right where the one before it
// ends (MXFP8: its scales too; DeviceWeights places a layer's projections of the attention input so)
// and their outputs share a dtype and fit. Anything else: false, and linear() names what does not fit.
bool joined_weights(Tensor x, std::span<const Projection> items, Tensor& joined) {
  if (items.size() < 2 || items.size() > size_t(kMaxSplitColumns)) return false;
  const DType dtype = items[0].weight.dtype;
  const bool fp8 = dtype == DType::kF8E4M3;
  if (dtype != DType::kBF16 && !fp8) return false;
  int64_t rows = 0;
  const auto* next = static_cast<const std::byte*>(items[0].weight.data);
  const auto* next_scale = static_cast<const std::byte*>(items[0].weight.scale);
  for (const Projection& it : items) {
    const Tensor& w = it.weight;
    if (w.dtype != dtype || w.ndim != 2 || w.dim(1) != x.dim(1) || w.data != next || w.scale != next_scale ||
        it.out.dtype != items[0].out.dtype || it.out.dim(0) != x.dim(0) || it.out.dim(1) != w.dim(0))
      return false;
    rows += w.dim(0);
    next += w.nbytes();
    if (fp8) next_scale += w.nbytes() / kMxfp8BlockSize;
  }
  joined = Tensor::make(items[0].weight.data, dtype, rows, x.dim(1));
  joined.scale = items[0].weight.scale;
  return true;
}

}  // namespace

void CudaOps::linears(Tensor x, std::span<const Projection> items) {
  expect(x, DType::kBF16, "linear input");
  GemvParams p;
  if (gemv_params(x, items, p)) {
    const auto timer = timed(fmt::format("linears x{}", items.size()));
    launch_gemv(p, kernels_);
    return;
  }
  // Weights back to back: one matmul over their rows, then its columns split into the outputs. Two
  // launches where one matmul each (with cuBLASLt's split-k reductions) took up to nine a layer, at
  // a few us each for the 128-row projections (docs/PERF.md).
  if (Tensor joined; joined_weights(x, items, joined)) {
    Tensor all = alloc_typed(x.dim(0), joined.dim(0), items[0].out.dtype);
    linear(x, joined, all);  // timed there
    const auto timer = timed(fmt::format("split columns x{}", items.size()));
    SplitColumnsParams split;
    split.in = all.data;
    split.rows = x.dim(0);
    split.elem_bytes = int(dtype_size(all.dtype));
    for (const Projection& it : items) {
      split.out[split.count] = it.out.data;
      split.cols[split.count++] = int(it.out.dim(1));
    }
    launch_split_columns(split, kernels_);
    return;
  }
  for (const Projection& it : items) linear(x, it.weight, it.out);  // one linear() each, timed there
}

void CudaOps::linear(Tensor x, Tensor weight, Tensor out) {
  const auto timer = timed(fmt::format("linear {}x{} -> {}", weight.dim(0), weight.dim(1), dtype_name(out.dtype)));
  expect(x, DType::kBF16, "linear input");
  const Projection one{weight, out};
  if (GemvParams p; gemv_params(x, {&one, 1}, p)) {
    launch_gemv(p, kernels_);
    return;
  }
  if (weight.dtype == DType::kF8E4M3) {  // MXFP8: weight-only FP8 (moe.cuh)
    launch_fp8_linear({bf16(x), weight.as<uint8_t>(), static_cast<const uint8_t*>(weight.scale), out.data,
                       out.dtype == DType::kF32, int(x.dim(0)), int(weight.dim(0)), int(x.dim(1))},
                      kernels_);
    return;
  }
  expect(weight, DType::kBF16, "linear weight");
  const int M = int(x.dim(0)), N = int(weight.dim(0)), K = int(x.dim(1));
  const bool f32 = out.dtype == DType::kF32;
  if (decode_gemv_ && M <= kBf16SkinnyLinearMaxM) {  // a few tokens: one pass over the weight
    const SkinnyLinearParams skinny{bf16(x), weight.data, nullptr, out.data, f32, M, N, K};
    if (skinny_linear_fits(skinny))
      launch_skinny_linear(skinny, kernels_);
    else  // rows off 16-byte alignment: the split-k grouped GEMM (moe.cuh)
      launch_bf16_linear({bf16(x), bf16(weight), out.data, f32, M, N, K}, kernels_);
    return;
  }
  gemm_.linear(bf16(x), bf16(weight), out.data, f32, M, N, K, stream_);
}

void CudaOps::head_norm_rope(std::span<const HeadNormRope> items) {
  const auto timer = timed("head_norm_rope");
  HeadNormRopeParams params[kMaxHeadNormRopeItems];
  head_norm_rope_params(items, positions_, params);
  launch_head_norm_rope_batch(params, int(items.size()), kernels_);
}

AttentionKernelParams CudaOps::attention_params(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k,
                                                const AttentionParams& p, Tensor out) const {
  AttentionKernelParams a;
  a.q = bf16(q);
  a.k = bf16(k);
  a.v = bf16(v);
  a.index_q = index_q.empty() ? nullptr : bf16(index_q);
  a.index_k = index_k.empty() ? nullptr : bf16(index_k);
  a.cache = cache_[p.layer];
  a.positions = positions_;
  a.seq_slots = seq_slots_;
  a.num_tokens = num_tokens_;
  a.context_bound = context_bound_;
  a.decode_step = decode_step_;
  a.num_q_heads = p.num_q_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.head_dim = p.head_dim;
  a.scale = p.scale;
  a.num_index_heads = p.num_index_heads;
  a.index_head_dim = p.index_head_dim;
  a.block_size = p.block_size;
  a.topk_blocks = p.topk_blocks;
  a.local_blocks = p.local_blocks;
  a.out = bf16_mut(out);
  a.workspace = attention_workspace_;
  a.workspace_bytes = attention_workspace_bytes_;
  return a;
}

void CudaOps::attention(Tensor q, Tensor k, Tensor v, Tensor index_q, Tensor index_k, const AttentionParams& p,
                        Tensor out) {
  const auto timer = timed(index_q.empty() ? "attention (full)" : "attention (sparse)");
  launch_attention(attention_params(q, k, v, index_q, index_k, p, out), kernels_);
}

void CudaOps::rotate_and_attend(std::span<const HeadNormRope> rotate, Tensor q, Tensor k, Tensor v, Tensor index_q,
                                Tensor index_k, const AttentionParams& p, Tensor out) {
  const bool sparse = !index_q.empty();
  // The items that rotate k and index_k store them into the cache; without them (a caller that
  // rotates its keys elsewhere) there is nothing to store from the kernel: the two ops, unfused.
  // So too for a step without tokens, whose empty tensors may share an address (and launch nothing).
  int k_item = -1, index_k_item = -1;
  for (size_t i = 0; i < rotate.size(); ++i) {
    if (rotate[i].x.data == k.data) k_item = int(i);
    if (sparse && rotate[i].x.data == index_k.data) index_k_item = int(i);
  }
  if (num_tokens_ == 0 || k_item < 0 || (sparse && index_k_item < 0)) {
    Ops::rotate_and_attend(rotate, q, k, v, index_q, index_k, p, out);
    return;
  }
  HeadNormRopeParams params[kMaxHeadNormRopeItems];
  head_norm_rope_params(rotate, positions_, params);
  const KvCacheLayer& c = cache_[p.layer];
  // The kernel writes head h of token t at h * head_dim of the token's cache row: the item's heads
  // must be the cache's, and every token of the step must be in k (the cache write stores them all).
  const HeadNormRope& kr = rotate[size_t(k_item)];
  TPMOE_CHECK(kr.num_heads == c.num_kv_heads && kr.rope.head_dim == c.head_dim && k.dim(0) == num_tokens_,
              "rotate_and_attend: k of {} tokens x {} heads x {} does not fit layer {}'s KV cache ({} heads x {}) for "
              "a step of {} tokens",
              k.dim(0), kr.num_heads, kr.rope.head_dim, p.layer, c.num_kv_heads, c.head_dim, num_tokens_);
  TPMOE_CHECK(v.dim(0) == k.dim(0) && v.dim(1) == k.dim(1), "rotate_and_attend: v [{}, {}] is not k's shape [{}, {}]",
              v.dim(0), v.dim(1), k.dim(0), k.dim(1));
  expect(v, DType::kBF16, "attention v");
  params[k_item].cache = c.k;
  params[k_item].copy = bf16(v);
  params[k_item].copy_cache = c.v;
  if (sparse) {
    const HeadNormRope& ir = rotate[size_t(index_k_item)];
    TPMOE_CHECK(c.index_k != nullptr && ir.num_heads == 1 && ir.rope.head_dim == c.index_head_dim,
                "rotate_and_attend: index_k of {} heads x {} does not fit layer {}'s index-key cache (1 head x {})",
                ir.num_heads, ir.rope.head_dim, p.layer, c.index_head_dim);
    params[index_k_item].cache = c.index_k;
  }
  {
    const auto timer = timed("head_norm_rope + cache store");
    launch_head_norm_rope_batch(params, int(rotate.size()), kernels_, {c.pages(), seq_slots_});
  }
  const auto timer = timed(sparse ? "attention (sparse, cache written)" : "attention (full, cache written)");
  AttentionKernelParams a = attention_params(q, k, v, index_q, index_k, p, out);
  a.cache_written = true;  // the norm + RoPE launch above stored k, v and index_k
  launch_attention(a, kernels_);
}

void CudaOps::swiglu(Tensor gate_up, const SwigluParams& p, Tensor out) {
  const auto timer = timed("swiglu");
  launch_swiglu({bf16(gate_up), bf16_mut(out), int(out.dim(0)), int(out.dim(1)), p.alpha, p.limit}, kernels_);
}

RouteKernelParams CudaOps::route_params(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids,
                                        Tensor slot_weights) const {
  expect(router_logits, DType::kF32, "router logits");
  RouteKernelParams r{router_logits.as<float>(),
                      bias.as<float>(),
                      slot_ids.as<int32_t>(),
                      slot_weights.as<float>(),
                      int(router_logits.dim(0)),
                      p.num_experts,
                      p.top_k,
                      p.num_shared_slots,
                      p.shared_weight};
  if (routed_) {  // routing statistics ride in the routing kernel: no launch of their own
    r.routed_flags = routed_ + size_t(p.layer) * size_t(routed_experts_);
    r.num_real_tokens = num_real_tokens_;
  }
  return r;
}

void CudaOps::route(Tensor router_logits, Tensor bias, const RouterParams& p, Tensor slot_ids, Tensor slot_weights) {
  const auto timer = timed("route");
  launch_route(route_params(router_logits, bias, p, slot_ids, slot_weights), kernels_);
}

void CudaOps::enable_routing_stats(int num_layers, int num_experts) {
  cudaFree(routed_);
  routed_layers_ = num_layers;
  routed_experts_ = num_experts;
  CUDA_CHECK(cudaMalloc(&routed_, size_t(num_layers) * size_t(num_experts)));
  CUDA_CHECK(cudaMemsetAsync(routed_, 0, size_t(num_layers) * size_t(num_experts), stream_));
}

std::vector<int> CudaOps::take_routed_experts() {
  if (!routed_) return {};
  std::vector<uint8_t> marks(size_t(routed_layers_) * size_t(routed_experts_));
  CUDA_CHECK(cudaMemcpyAsync(marks.data(), routed_, marks.size(), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemsetAsync(routed_, 0, marks.size(), stream_));
  std::vector<int> counts(static_cast<size_t>(routed_layers_));
  for (size_t i = 0; i < marks.size(); ++i) counts[i / size_t(routed_experts_)] += marks[i];
  return counts;
}

MoeKernelParams CudaOps::moe_params(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down,
                                    const SwigluParams& p, float scale, Tensor out) const {
  TPMOE_CHECK(out.data != x.data, "CUDA backend: the MoE output must not alias its input");
  MoeKernelParams m;
  m.x = bf16(x);
  m.slot_ids = slot_ids.as<int32_t>();
  m.slot_weights = slot_weights.as<float>();
  m.gate_up = gate_up.data;
  m.down = down.data;
  if (gate_up.dtype == DType::kF8E4M3) {  // MXFP8: weight-only FP8
    m.gate_up_scale = static_cast<const uint8_t*>(gate_up.scale);
    m.down_scale = static_cast<const uint8_t*>(down.scale);
  } else {
    expect(gate_up, DType::kBF16, "expert weights");
  }
  m.out = bf16_mut(out);
  m.num_tokens = int(x.dim(0));
  m.slots = int(slot_ids.dim(1));
  m.hidden = int(x.dim(1));
  m.inter = int(down.dim(2));
  m.num_rows = int(gate_up.dim(0));
  m.alpha = p.alpha;
  m.limit = p.limit;
  m.scale = scale;
  m.workspace = moe_workspace_;
  m.workspace_bytes = reserve_.moe_workspace_bytes;
  m.tuning.single_token_gemv = decode_gemv_;
  return m;
}

void CudaOps::moe_experts(Tensor x, Tensor slot_ids, Tensor slot_weights, Tensor gate_up, Tensor down,
                          const SwigluParams& p, float scale, Tensor out) {
  const auto timer = timed(fmt::format("moe_experts ({} rows)", gate_up.dim(0)));
  launch_moe(moe_params(x, slot_ids, slot_weights, gate_up, down, p, scale, out), kernels_);
}

void CudaOps::route_experts(Tensor x, const Routing& r, Tensor gate_up, Tensor down, const SwigluParams& p, float scale,
                            Tensor out) {
  const auto timer = timed(fmt::format("route + moe_experts ({} rows)", gate_up.dim(0)));
  MoeKernelParams m = moe_params(x, r.slot_ids, r.slot_weights, gate_up, down, p, scale, out);
  m.route = route_params(r.logits, r.bias, r.params, r.slot_ids, r.slot_weights);
  launch_moe(m, kernels_);
}

void CudaOps::gather_logit_rows(Tensor x, Tensor out) {
  const auto timer = timed("gather_logit_rows");
  launch_gather_rows(bf16(x), logit_rows_, num_logit_rows_, int(x.dim(1)), bf16_mut(out), kernels_);
}

void CudaOps::argmax(Tensor logits, Tensor ids, Tensor values) {
  const auto timer = timed("argmax");
  const int rows = int(logits.dim(0)), vocab = int(logits.dim(1));
  const size_t bytes = argmax_workspace_bytes(rows, vocab);
  Tensor scratch = alloc_typed(int64_t((bytes + 3) / 4), 1, DType::kI32);
  launch_argmax(logits.as<float>(), rows, vocab, ids.as<int32_t>(), values.empty() ? nullptr : values.as<float>(),
                scratch.data, bytes, kernels_);
}

void CudaOps::sample(Tensor logits, const SampleBatch& batch, Tensor ids) {
  const auto timer = timed("sample");
  expect(logits, DType::kF32, "sample's logits");
  expect(ids, DType::kI32, "sample's ids");
  const int rows = int(logits.dim(0)), vocab = int(logits.dim(1));
  TPMOE_CHECK(ids.numel() >= rows, "CUDA sample: ids hold {} values for {} rows", ids.numel(), rows);
  const std::vector<sampling::SampleRowArgs> args = check_sample_batch(batch, rows, vocab);
  if (rows == 0) return;
  const size_t entries = batch.penalty_token_ids.size();
  const size_t args_bytes = (sizeof(sampling::SampleRowArgs) * rows + kAllocAlign - 1) / kAllocAlign * kAllocAlign;
  const size_t ids_bytes = (sizeof(int32_t) * entries + kAllocAlign - 1) / kAllocAlign * kAllocAlign;
  const size_t upload_bytes = args_bytes + 2 * ids_bytes;
  const size_t workspace_bytes = sample_workspace_bytes(rows, vocab);
  // The previous upload must have left the pinned buffer before it is rewritten; buffers in use by
  // queued kernels must be idle before they are replaced.
  if (!sample_uploaded_) CUDA_CHECK(cudaEventCreateWithFlags(&sample_uploaded_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventSynchronize(sample_uploaded_));
  if (upload_bytes > sample_device_bytes_ || workspace_bytes > sample_workspace_bytes_) {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (upload_bytes > sample_device_bytes_) {
      CUDA_CHECK(cudaFree(sample_device_));
      CUDA_CHECK(cudaFreeHost(sample_pinned_));
      sample_device_bytes_ = sample_pinned_bytes_ = 2 * upload_bytes;
      CUDA_CHECK(cudaMalloc(&sample_device_, sample_device_bytes_));
      CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&sample_pinned_), sample_pinned_bytes_));
    }
    if (workspace_bytes > sample_workspace_bytes_) {
      CUDA_CHECK(cudaFree(sample_workspace_));
      sample_workspace_bytes_ = workspace_bytes;
      CUDA_CHECK(cudaMalloc(&sample_workspace_, sample_workspace_bytes_));
    }
  }
  std::memcpy(sample_pinned_, args.data(), sizeof(sampling::SampleRowArgs) * rows);
  if (entries) {
    std::memcpy(sample_pinned_ + args_bytes, batch.penalty_token_ids.data(), sizeof(int32_t) * entries);
    std::memcpy(sample_pinned_ + args_bytes + ids_bytes, batch.penalty_counts.data(), sizeof(int32_t) * entries);
  }
  CUDA_CHECK(cudaMemcpyAsync(sample_device_, sample_pinned_, upload_bytes, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaEventRecord(sample_uploaded_, stream_));
  std::byte* device = static_cast<std::byte*>(sample_device_);
  SampleKernelParams p;
  p.logits = logits.as<const float>();
  p.rows = rows;
  p.vocab = vocab;
  p.row_args = reinterpret_cast<const sampling::SampleRowArgs*>(device);
  p.penalty_ids = reinterpret_cast<const int32_t*>(device + args_bytes);
  p.penalty_counts = reinterpret_cast<const int32_t*>(device + args_bytes + ids_bytes);
  p.ids = ids.as<int32_t>();
  p.workspace = sample_workspace_;
  p.workspace_bytes = sample_workspace_bytes_;
  launch_sample(p, stream_);
}

void CudaOps::copy_columns(Tensor src, Tensor dst, int64_t col_offset) {
  expect(src, DType::kF32, "copy_columns source");
  expect(dst, DType::kF32, "copy_columns destination");
  const size_t width = size_t(src.dim(1)) * sizeof(float);
  CUDA_CHECK(cudaMemcpy2DAsync(dst.as<float>() + col_offset, size_t(dst.dim(1)) * sizeof(float), src.data, width, width,
                               size_t(src.dim(0)), cudaMemcpyDeviceToDevice, stream_));
}

void CudaOps::upload_ids(const std::vector<int32_t>& ids, Tensor dst) {
  CUDA_CHECK(cudaMemcpyAsync(dst.data, ids.data(), sizeof(int32_t) * ids.size(), cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // `ids` may go as soon as this returns
}

std::vector<float> CudaOps::to_host(Tensor t) {
  std::vector<float> out(size_t(t.numel()));
  if (t.dtype == DType::kF32) {
    CUDA_CHECK(cudaMemcpyAsync(out.data(), t.data, t.nbytes(), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (profile_ops_) collect_op_times();
    return out;
  }
  expect(t, DType::kBF16, "to_host");
  std::vector<uint16_t> raw(out.size());
  CUDA_CHECK(cudaMemcpyAsync(raw.data(), t.data, t.nbytes(), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < raw.size(); ++i) out[i] = bf16_to_f32(raw[i]);
  return out;
}

void CudaOps::combine_vocab_argmax(Tensor gathered, int64_t slice_size, Tensor ids) {
  const auto timer = timed("combine_vocab_argmax");
  expect(gathered, DType::kI32, "combine_vocab_argmax's gathered winners");
  expect(ids, DType::kI32, "combine_vocab_argmax's ids");
  const int64_t rows = ids.numel();
  TPMOE_CHECK(rows > 0 && gathered.numel() % (2 * rows) == 0,
              "combine_vocab_argmax: {} gathered values are not (ids, values) of {} rows a rank", gathered.numel(),
              rows);
  launch_combine_vocab_argmax(gathered.as<int32_t>(), int(gathered.numel() / (2 * rows)), int(rows), slice_size,
                              ids.as<int32_t>(), kernels_);
}

void CudaOps::keep_ids(Tensor ids) {
  expect(ids, DType::kI32, "keep_ids");
  const int n = int(ids.numel());
  TPMOE_CHECK(n <= reserve_.max_tokens, "keep_ids: {} ids, the step holds at most {}", n, reserve_.max_tokens);
  TPMOE_CHECK(kept_.size() < 2, "keep_ids: two steps' ids kept and not taken");
  // The slot the one kept id set still pending (if any) does not use.
  const int slot = kept_.empty() ? 0 : 1 - kept_.front().slot;
  CUDA_CHECK(cudaMemcpyAsync(fed_ids_, ids.data, sizeof(int32_t) * n, cudaMemcpyDeviceToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(kept_pinned_ + size_t(slot) * reserve_.max_tokens, ids.data, sizeof(int32_t) * n,
                             cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaEventRecord(kept_copied_[slot], stream_));
  kept_.push_back({slot, n});
  fed_count_ = n;
}

std::vector<int32_t> CudaOps::take_kept_ids() {
  TPMOE_CHECK(!kept_.empty(), "take_kept_ids: no ids kept");
  const KeptIds k = kept_.front();
  kept_.pop_front();
  CUDA_CHECK(cudaEventSynchronize(kept_copied_[k.slot]));
  if (profile_ops_) {  // the ops' timing events of a step queued behind this one must have fired too
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    collect_op_times();
  }
  const int32_t* p = kept_pinned_ + size_t(k.slot) * reserve_.max_tokens;
  return {p, p + k.count};
}

std::vector<int32_t> CudaOps::ids_to_host(Tensor ids) {
  std::vector<int32_t> out(size_t(ids.numel()));
  CUDA_CHECK(cudaMemcpyAsync(out.data(), ids.data, ids.nbytes(), cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (profile_ops_) collect_op_times();
  return out;
}

}  // namespace tpmoe::cuda
