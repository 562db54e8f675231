#include "backends/cuda/nccl_comm.h"

// nccl_device.h needs size_t and the CUDA runtime types before it.
#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <nccl_device.h>

#include "backends/cuda/cuda_check.h"
#include "core/error.h"

namespace tpmoe::cuda {

const char* allreduce_path_name(AllreducePath path) {
  switch (path) {
    case AllreducePath::kAuto: return "auto";
    case AllreducePath::kPush: return "push";
    case AllreducePath::kOneShot: return "one-shot";
    case AllreducePath::kTwoShot: return "two-shot";
    case AllreducePath::kNccl: return "nccl+norm";
  }
  return "?";
}

namespace {

const __nv_bfloat16* bf16(const Tensor& t) { return static_cast<const __nv_bfloat16*>(t.data); }

}  // namespace

AllreduceThresholds AllreduceThresholds::defaults(int nranks, int window_tokens) {
  // Remote bytes per rank and element: one-shot 2(N-1), two-shot 6(N-1)/N (allreduce.cuh), and
  // two-shot pays one more barrier. So one-shot wins at N = 2 for every size, and two-shot takes
  // over at a few tens of rows for N >= 4.
  AllreduceThresholds t;
  // Push: no barrier round trip, which is what it saves at tp > 1; at tp 1 (the only size measured
  // so far, docs/PERF.md) it costs ~1.7 us more than the one-shot. Off by default until
  // `bench-op allreduce --tp N` on several GPUs shows where it wins (--allreduce-path push forces it).
  t.push_max_tokens = 0;
  t.oneshot_max_tokens = nranks <= 2 ? window_tokens : nranks <= 4 ? 64 : 16;
  t.twoshot_max_tokens = window_tokens;
  return t;
}

AllreducePath parse_allreduce_path(const std::string& name) {
  if (name == "auto") return AllreducePath::kAuto;
  if (name == "push") return AllreducePath::kPush;
  if (name == "oneshot") return AllreducePath::kOneShot;
  if (name == "twoshot") return AllreducePath::kTwoShot;
  if (name == "nccl") return AllreducePath::kNccl;
  TPMOE_FAIL("all-reduce path '{}': expected auto, oneshot, twoshot or nccl", name);
}

NcclCommunicator::NcclCommunicator(const ncclUniqueId& id, int nranks, int rank, int hidden, const NcclOptions& options)
    : rank_(rank), nranks_(nranks) {
  const int window_tokens = options.window_tokens;
  TPMOE_CHECK(nranks >= 1 && rank >= 0 && rank < nranks, "NCCL communicator: rank {} of {}", rank, nranks);
  check_nccl_version();
  CUDA_CHECK(cudaGetDevice(&device_));
  forced_ = options.path;
  thresholds_ = AllreduceThresholds::defaults(nranks, window_tokens);
  if (options.push_max_tokens >= 0)
    thresholds_.push_max_tokens = std::min({options.push_max_tokens, window_tokens, kPushMaxRows});
  if (options.oneshot_max_tokens >= 0) thresholds_.oneshot_max_tokens = options.oneshot_max_tokens;
  if (options.twoshot_max_tokens >= 0)
    thresholds_.twoshot_max_tokens = std::min(window_tokens, options.twoshot_max_tokens);
  NCCL_CHECK(ncclCommInitRank(&comm_, nranks, id, rank));

  // The symmetric window and the device communicator. Whether the fused kernels can run is agreed
  // by every rank (a min over ranks), so no two ranks ever pick different paths for one step.
  std::string why;  // why the fused kernels are off on this rank, for the note below
  int ok = hidden % 8 == 0 && hidden <= kMaxFusedHidden && nranks <= kMaxRanks && window_tokens > 0;
  if (!ok) why = fmt::format("hidden {} / {} ranks outside what the fused kernels take", hidden, nranks);
  if (ok) {
    const ncclTeam_t lsa = ncclTeamLsa(comm_);
    ok = lsa.nRanks == nranks && lsa.rank == rank;  // every peer load/store reachable, lsa rank = rank
    if (!ok) why = fmt::format("only {} of {} ranks are load/store reachable (several hosts?)", lsa.nRanks, nranks);
  }
  if (ok) {
    layout_ = WindowLayout::make(window_tokens, hidden);
    ncclResult_t r = ncclMemAlloc(&window_memory_, layout_.bytes);
    if (r == ncclSuccess)
      r = ncclCommWindowRegister(comm_, window_memory_, layout_.bytes, &window_, NCCL_WIN_COLL_SYMMETRIC);
    ok = r == ncclSuccess;
    if (!ok) why = fmt::format("symmetric window: {} ({})", ncclGetErrorString(r), ncclGetLastError(comm_));
  }
  if (ok) {
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof reqs);
    reqs.lsaBarrierCount = kMaxAllreduceBlocks;  // one per CTA of the fused kernels; no multimem
    dev_comm_ = std::make_unique<ncclDevComm>();
    const ncclResult_t r = ncclDevCommCreate(comm_, &reqs, dev_comm_.get());
    ok = r == ncclSuccess;
    if (!ok) {
      dev_comm_.reset();
      why = fmt::format("ncclDevCommCreate: {} ({})", ncclGetErrorString(r), ncclGetLastError(comm_));
    }
  }
  if (ok) {  // the push mailbox starts empty on every rank before the collective below lets any peer push
    launch_allreduce_window_init(window_memory_, layout_, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  int* flag = nullptr;
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
  CUDA_CHECK(cudaMemcpyAsync(flag, &ok, sizeof(int), cudaMemcpyHostToDevice, s));
  NCCL_CHECK(ncclAllReduce(flag, flag, 1, ncclInt32, ncclMin, comm_, s));
  CUDA_CHECK(cudaMemcpyAsync(&ok, flag, sizeof(int), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaFree(flag);
  cudaStreamDestroy(s);
  fused_ = ok != 0;
  if (!fused_ && (rank == 0 || !why.empty()))
    std::fprintf(stderr,
                 "note: rank %d: fused all-reduce + RMSNorm kernels unavailable (%s): every reduction uses "
                 "ncclAllReduce\n",
                 rank, why.empty() ? "a peer could not set them up" : why.c_str());
}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  if (kernels_.stream) cudaStreamSynchronize(kernels_.stream);
  if (dev_comm_) ncclDevCommDestroy(comm_, dev_comm_.get());
  if (window_) ncclCommWindowDeregister(comm_, window_);
  if (window_memory_) ncclMemFree(window_memory_);
  if (comm_) ncclCommDestroy(comm_);
}

void NcclCommunicator::all_reduce_bf16(__nv_bfloat16* data, size_t count) {
  NCCL_CHECK(ncclAllReduce(data, data, count, ncclBfloat16, ncclSum, comm_, kernels_.stream));
}

void NcclCommunicator::all_reduce(Tensor data) {
  TPMOE_CHECK(data.dtype == DType::kBF16, "NCCL all_reduce: bf16 activations only, got {}", dtype_name(data.dtype));
  all_reduce_bf16(static_cast<__nv_bfloat16*>(data.data), size_t(data.numel()));
}

void NcclCommunicator::all_gather(Tensor local, Tensor gathered) {
  TPMOE_CHECK(gathered.nbytes() == local.nbytes() * size_t(nranks_),
              "NCCL all_gather: {} bytes for {} ranks of {} bytes", gathered.nbytes(), nranks_, local.nbytes());
  NCCL_CHECK(ncclAllGather(local.data, gathered.data, local.nbytes(), ncclInt8, comm_, kernels_.stream));
}

AllreducePath NcclCommunicator::choose(int tokens, int hidden) const {
  const bool fits = fused_ && hidden == layout_.hidden && tokens <= layout_.max_rows;
  if (forced_ != AllreducePath::kAuto) return fits || forced_ == AllreducePath::kNccl ? forced_ : AllreducePath::kNccl;
  if (!fits) return AllreducePath::kNccl;
  if (tokens <= thresholds_.push_max_tokens) return AllreducePath::kPush;
  if (tokens <= thresholds_.oneshot_max_tokens) return AllreducePath::kOneShot;
  if (tokens <= thresholds_.twoshot_max_tokens) return AllreducePath::kTwoShot;
  return AllreducePath::kNccl;
}

void NcclCommunicator::allreduce_add_rmsnorm(const AddRmsNormParams& p, AllreducePath path) {
  if (path == AllreducePath::kAuto) path = choose(p.rows, p.hidden);
  AllreduceNormParams f;
  f.partial = p.partial;
  f.residual = p.residual;
  f.weight = p.weight;
  f.out = p.out;
  f.rows = p.rows;
  f.hidden = p.hidden;
  f.eps = p.eps;
  f.rank = rank_;
  f.nranks = nranks_;
  f.window = layout_;
  // Alignment is a property of the arena, the same on every rank: the fallback stays consistent.
  if (path != AllreducePath::kNccl && !(fused_ && allreduce_fused_supported(f))) path = AllreducePath::kNccl;
  if (path == AllreducePath::kPush && !allreduce_push_supported(f)) path = AllreducePath::kOneShot;
  if (path == AllreducePath::kNccl) {
    auto* partial = const_cast<__nv_bfloat16*>(p.partial);
    all_reduce_bf16(partial, size_t(p.rows) * size_t(p.hidden));
    launch_add_rmsnorm(p, kernels_);
    return;
  }
  const AllreduceAlgo algo = path == AllreducePath::kPush      ? AllreduceAlgo::kPush
                             : path == AllreducePath::kOneShot ? AllreduceAlgo::kOneShot
                                                               : AllreduceAlgo::kTwoShot;
  launch_allreduce_norm_nccl(f, algo, window_, *dev_comm_, kernels_);
}

void NcclCommunicator::allreduce_add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor y) {
  TPMOE_CHECK(partial.dtype == DType::kBF16 && residual.dtype == DType::kF32 && weight.dtype == DType::kF32 &&
                  y.dtype == DType::kBF16,
              "NCCL allreduce_add_rmsnorm: expects bf16 partial, fp32 residual and weight, bf16 y");
  AddRmsNormParams p;
  p.partial = bf16(partial);
  p.residual = residual.as<float>();
  p.weight = weight.as<float>();
  p.out = static_cast<__nv_bfloat16*>(y.data);
  p.rows = int(residual.dim(0));
  p.hidden = int(residual.dim(1));
  p.eps = eps;
  allreduce_add_rmsnorm(p, AllreducePath::kAuto);
}

std::vector<RankFingerprint> NcclCommunicator::all_gather(const RankFingerprint& mine) {
  const size_t bytes = sizeof(RankFingerprint);
  std::vector<RankFingerprint> all(static_cast<size_t>(nranks_));
  void* buffer = nullptr;
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc(&buffer, bytes * size_t(nranks_ + 1)));
  char* send = static_cast<char*>(buffer) + bytes * size_t(nranks_);
  CUDA_CHECK(cudaMemcpyAsync(send, &mine, bytes, cudaMemcpyHostToDevice, s));
  NCCL_CHECK(ncclAllGather(send, buffer, bytes, ncclUint8, comm_, s));
  CUDA_CHECK(cudaMemcpyAsync(all.data(), buffer, bytes * size_t(nranks_), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  cudaFree(buffer);
  cudaStreamDestroy(s);
  return all;
}

}  // namespace tpmoe::cuda
