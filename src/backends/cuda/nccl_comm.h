// The NCCL implementation of the Communicator interface: one rank of a tensor-parallel group, on
// the GPU current when it is built. The same class serves both launch modes (a thread per GPU, a
// process per GPU under mpirun); only where the ncclUniqueId comes from differs.
//
// all_reduce: ncclAllReduce (bf16 sum) in place on the stream.
// allreduce_add_rmsnorm: by step size T (the same T on every rank, so every rank takes the same
// path and launches the same grid):
//   T <= push_max_tokens      push kernel: rows stored into the peers' mailboxes, no barrier
//   T <= oneshot_max_tokens   one-shot fused kernel on the symmetric window (allreduce.cuh)
//   T <= twoshot_max_tokens   two-shot fused kernel (reduce-scatter by rows, norm, all-gather)
//   larger                    ncclAllReduce in place on the partial, then launch_add_rmsnorm
// All three only enqueue work on the stream: they are captured into the decode CUDA graph.
//
// The symmetric window (ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)) holds
// window_tokens x hidden partials (bf16) and residual rows (fp32); the device communicator
// (ncclDevCommCreate) reserves one LSA barrier per CTA. NVLink multicast is never requested. The
// fused kernels need every rank load/store-reachable (one NVLink domain); across hosts, or if the
// window cannot be made, every size takes the NCCL path (all ranks agree on that at construction).
//
// NcclOptions (filled by main from --allreduce-path and friends; for measuring thresholds on a
// multi-GPU host, and for tests) force one path for every size or override the thresholds.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include <string>
#include "backends/cuda/allreduce.cuh"
#include "backends/cuda/norm.cuh"

#include "model/communicator.h"
#include "model/rank_checks.h"

namespace tpmoe::cuda {

enum class AllreducePath { kAuto, kPush, kOneShot, kTwoShot, kNccl };
const char* allreduce_path_name(AllreducePath path);

constexpr int kDefaultWindowTokens = 512;  // the largest decode batch the fused kernels serve

struct AllreduceThresholds {
  int push_max_tokens = 0, oneshot_max_tokens = 0, twoshot_max_tokens = 0;
  // Modelled from the bytes each path moves over NVLink (allreduce.cuh), to be replaced by
  // measurements of `tpmoe bench-op allreduce --tp N` on a multi-GPU host; NcclOptions override.
  static AllreduceThresholds defaults(int nranks, int window_tokens);
};

// "auto", "push", "oneshot", "twoshot" or "nccl"; throws naming anything else.
AllreducePath parse_allreduce_path(const std::string& name);

struct NcclOptions {
  int window_tokens = kDefaultWindowTokens;   // caps the fused kernels' T
  AllreducePath path = AllreducePath::kAuto;  // one path for every size, or chosen by size
  // >= 0: override the modelled thresholds
  int push_max_tokens = -1, oneshot_max_tokens = -1, twoshot_max_tokens = -1;
};

class NcclCommunicator final : public Communicator {
 public:
  // Collective: every rank of the group calls it with the same id, nranks and sizes, each with its
  // own GPU current.
  NcclCommunicator(const ncclUniqueId& id, int nranks, int rank, int hidden, const NcclOptions& options = {});
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return nranks_; }
  // The stream collectives are enqueued on (the CudaOps stream of the current request, with its PDL
  // choice for the fused kernels).
  void set_stream(KernelStream on) { kernels_ = on; }
  cudaStream_t stream() const { return kernels_.stream; }

  void all_reduce(Tensor data) override;
  void all_gather(Tensor local, Tensor gathered) override;
  void allreduce_add_rmsnorm(Tensor partial, Tensor residual, Tensor weight, float eps, Tensor y) override;

  // Raw-pointer forms (bench, tests). p.partial is overwritten with the sum on the NCCL path.
  void all_reduce_bf16(__nv_bfloat16* data, size_t count);
  void allreduce_add_rmsnorm(const AddRmsNormParams& p, AllreducePath path = AllreducePath::kAuto);
  AllreducePath choose(int tokens, int hidden) const;

  // Every rank's fingerprint, via ncclAllGather (collective).
  std::vector<RankFingerprint> all_gather(const RankFingerprint& mine);

  bool fused_available() const { return fused_; }
  const AllreduceThresholds& thresholds() const { return thresholds_; }
  size_t window_bytes() const { return layout_.bytes; }
  int window_push_rows() const { return fused_ ? layout_.push_rows : 0; }

 private:
  int rank_, nranks_, device_ = 0;
  WindowLayout layout_;
  AllreduceThresholds thresholds_;
  AllreducePath forced_ = AllreducePath::kAuto;
  KernelStream kernels_;
  ncclComm_t comm_ = nullptr;
  void* window_memory_ = nullptr;
  ncclWindow_t window_ = nullptr;
  std::unique_ptr<ncclDevComm> dev_comm_;
  bool fused_ = false;
};

}  // namespace tpmoe::cuda
