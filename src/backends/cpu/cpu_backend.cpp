#include "backends/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/local_comm.h"
#include "core/error.h"
#include "model/emulated_peers.h"
#include "model/presets.h"

namespace tpmoe::cpu {

namespace {

class CpuRank final : public RankBackend {
 public:
  CpuRank(int rank, ModelWeights weights, Communicator& comm, int omp_threads)
      : rank_(rank), weights_(std::move(weights)), comm_(comm), omp_threads_(omp_threads) {}
  int rank() const override { return rank_; }
  void activate() override { omp_set_num_threads(omp_threads_); }
  const ModelWeights& weights() const override { return weights_; }
  Communicator& comm() override { return comm_; }
  std::unique_ptr<Ops> make_ops(const StepBudget&) override { return std::make_unique<CpuOps>(); }
  size_t weight_bytes() const { return weights_.bytes; }

 private:
  int rank_;
  ModelWeights weights_;
  Communicator& comm_;
  int omp_threads_;
};

class CpuRankGroup final : public RankGroup {
 public:
  CpuRankGroup(const ModelConfig& config, const ParallelLayout& layout, const FusionPlan& plan,
               const WeightSource& source, const RankLaunch& launch, const CpuBackendOptions& options)
      : comm_group_(launch.emulated ? 1 : layout.tp) {
    if (launch.emulated)
      emulated_ = std::make_unique<EmulatedPeers>(
          comm_group_.rank(0), layout.tp, [](void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); });
    const int cores = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    const int per_rank = std::max(1, cores / layout.tp);
    // A preset is made in memory once and then sliced per rank like a checkpoint.
    std::optional<io::Checkpoint> preset;
    if (!source.checkpoint) {
      const bool mxfp8 = config.quantization.method == QuantMethod::kMxfp8;
      preset = io::Checkpoint::from_memory(
          config, random_weights(config, source.preset_seed, mxfp8 ? DType::kF8E4M3 : DType::kBF16));
    }
    const io::Checkpoint& ckpt = source.checkpoint ? *source.checkpoint : *preset;
    for (int r : launch.local_ranks)
      ranks_.push_back(std::make_unique<CpuRank>(r, load_rank_weights(ckpt, RankShard::make(config, layout, r), plan),
                                                 emulated_ ? *emulated_ : comm_group_.rank(r), per_rank));
  }
  std::vector<RankBackend*> local_ranks() override {
    std::vector<RankBackend*> out;
    for (auto& r : ranks_) out.push_back(r.get());
    return out;
  }
  bool wake_blocked_peers() override {
    comm_group_.abort();
    return true;
  }
  size_t weight_bytes_per_rank() const override { return ranks_.front()->weight_bytes(); }

 private:
  LocalCommGroup comm_group_;
  std::unique_ptr<EmulatedPeers> emulated_;
  std::vector<std::unique_ptr<CpuRank>> ranks_;
};

}  // namespace

std::unique_ptr<RankGroup> make_rank_group(const ModelConfig& config, const ParallelLayout& layout,
                                           const FusionPlan& plan, const WeightSource& source, const RankLaunch& launch,
                                           const CpuBackendOptions& options) {
  TPMOE_CHECK(!launch.multi_process,
              "--device cpu runs tensor-parallel ranks as threads of one process; start one process with --tp {} "
              "instead of mpirun",
              launch.tp);
  return std::make_unique<CpuRankGroup>(config, layout, plan, source, launch, options);
}

}  // namespace tpmoe::cpu
