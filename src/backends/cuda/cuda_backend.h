// The CUDA backend as the engine sees it: each rank this process drives owns a GPU, its weights
// there (uploaded from a checkpoint, or a preset generated on the device), a communicator (NCCL
// for a group of several ranks, a one-rank stand-in otherwise) and, per request, a CudaOps whose
// stream the communicator enqueues on. Thread per GPU and process per GPU (mpirun) are the same
// code: only RankLaunch differs.
#pragma once

#include <memory>
#include <string>

#include "backends/backend.h"
#include "backends/cuda/bandwidth.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/nccl_comm.h"

namespace tpmoe::cuda {

struct CudaBackendOptions {
  CudaOpsOptions ops;
  NcclOptions nccl;
  // tp 1 through the NCCL communicator (symmetric window, device communicator, the degenerate
  // reduction) instead of the one-rank stand-in: for tests that hold the two to the same bits.
  bool nccl_at_tp1 = false;
};

// Collective over every process of the group. Throws (naming the problem) when the GPUs, the NCCL
// library or the ranks' configs do not fit.
std::unique_ptr<RankGroup> make_rank_group(const ModelConfig& config, const ParallelLayout& layout,
                                           const FusionPlan& plan, const WeightSource& source, const RankLaunch& launch,
                                           const CudaBackendOptions& options);

// GPUs this process sees (0 when the driver is missing or broken).
int visible_gpus();

// `tpmoe bench-op allreduce`: fused all-reduce + RMSNorm vs NCCL per step size, on the ranks of
// `launch` (allreduce_bench.cpp).
void run_allreduce_bench(const RankLaunch& launch);

}  // namespace tpmoe::cuda
