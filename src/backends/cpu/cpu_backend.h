// The CPU backend as the engine sees it: every rank of the group as a thread of this process, each
// with its host weights, a CpuOps per request and the in-process communicator.
#pragma once

#include <memory>

#include "backends/backend.h"

namespace tpmoe::cpu {

struct CpuBackendOptions {
  int threads = 0;  // OpenMP threads in all, shared by the ranks (0: every core)
};

// Loads (or generates, for a preset) every rank's shard. The CPU backend runs ranks as threads of
// one process: a launch spread over processes is refused.
std::unique_ptr<RankGroup> make_rank_group(const ModelConfig& config, const ParallelLayout& layout,
                                           const FusionPlan& plan, const WeightSource& source, const RankLaunch& launch,
                                           const CpuBackendOptions& options);

}  // namespace tpmoe::cpu
