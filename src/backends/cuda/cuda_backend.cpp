#include "backends/cuda/cuda_backend.h"

#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/device_weights.h"
#include "core/error.h"
#include "model/emulated_peers.h"
#include "model/rank_checks.h"

namespace tpmoe::cuda {

namespace {

// The communicator of a group of one: the fusion plan of tp 1 never reduces, so it is never asked to.
class SingleRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(Tensor) override { TPMOE_FAIL("internal: all_reduce called at tp 1"); }
  void allreduce_add_rmsnorm(Tensor, Tensor, Tensor, float, Tensor) override {
    TPMOE_FAIL("internal: allreduce_add_rmsnorm called at tp 1");
  }
  void all_gather(Tensor, Tensor) override { TPMOE_FAIL("internal: all_gather called at tp 1"); }
};

class CudaRank final : public RankBackend {
 public:
  CudaRank(int rank, int device, const ModelConfig& config, const ParallelLayout& layout, const FusionPlan& plan,
           const CudaOpsOptions& ops_options)
      : rank_(rank),
        device_(device),
        config_(config),
        plan_(plan),
        shard_(RankShard::make(config, layout, rank)),
        ops_options_(ops_options) {}
  ~CudaRank() override {
    cudaSetDevice(device_);  // the members free their memory on this rank's GPU
    comm_.reset();
    inner_.reset();
    weights_.reset();
  }

  int rank() const override { return rank_; }
  void activate() override { CUDA_CHECK(cudaSetDevice(device_)); }
  const ModelWeights& weights() const override { return weights_->weights(); }
  Communicator& comm() override { return *comm_; }
  std::unique_ptr<Ops> make_ops(const StepBudget& budget) override {
    auto ops = std::make_unique<CudaOps>(CudaReserve::for_budget(config_, plan_, shard_, budget), ops_options_);
    if (nccl_) {
      // Collectives join the request's stream, and let go of it when the request's ops go.
      nccl_->set_stream(ops->kernel_stream());
      ops->set_on_destroy([nccl = nccl_] { nccl->set_stream(nullptr); });
    }
    return ops;
  }

  void load(const WeightSource& source) {
    if (source.checkpoint) {
      // MXFP8 linears stay FP8 (weight-only FP8: widened in registers).
      weights_ = DeviceWeights::upload(load_rank_weights(*source.checkpoint, shard_, plan_, {.keep_mxfp8 = true}));
    } else {
      // This rank's shard made on its GPU: bitwise what loading the preset checkpoint would give it,
      // without the whole model anywhere.
      weights_ = DeviceWeights::random_preset(config_, plan_, shard_, source.preset_seed);
    }
  }
  // `id`: join the NCCL group of `nranks`; null: a group of one without NCCL. `emulated_tp` > 0:
  // stand in for a tp-`emulated_tp` group (over an NCCL group of one, so the fused all-reduce +
  // norm kernel runs as it would, minus the peers' traffic).
  void connect(const ncclUniqueId* id, int nranks, const NcclOptions& options, int emulated_tp) {
    if (!id) {
      comm_ = std::make_unique<SingleRank>();
      return;
    }
    auto nccl = std::make_unique<NcclCommunicator>(*id, nranks, rank_, config_.hidden_size, options);
    nccl_ = nccl.get();
    comm_ = std::move(nccl);
    if (emulated_tp > 0) {
      inner_ = std::move(comm_);
      comm_ = std::make_unique<EmulatedPeers>(*inner_, emulated_tp, [this](void* dst, const void* src, size_t n) {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, nccl_->stream()));
      });
    }
  }
  size_t weight_bytes() const { return weights_->bytes(); }

 private:
  int rank_, device_;
  const ModelConfig& config_;
  const FusionPlan& plan_;
  RankShard shard_;
  CudaOpsOptions ops_options_;
  std::unique_ptr<DeviceWeights> weights_;
  std::unique_ptr<Communicator> inner_;  // the group of one under EmulatedPeers
  std::unique_ptr<Communicator> comm_;
  NcclCommunicator* nccl_ = nullptr;  // the NCCL communicator, when there is one
};

class CudaRankGroup final : public RankGroup {
 public:
  CudaRankGroup(const ModelConfig& config, const ParallelLayout& layout, const FusionPlan& plan,
                const WeightSource& source, const RankLaunch& launch, const CudaBackendOptions& options) {
    check_nccl_version();
    const int gpus = visible_gpus();
    if (launch.multi_process) {
      // Every process checks the table of all ranks' fingerprints before any collective, so they
      // all fail together with the same message instead of some waiting forever.
      const int rank = launch.local_ranks.at(0);
      const RankFingerprint mine =
          make_fingerprint(config, plan, rank, layout.tp, launch.tp, launch.local_devices.at(0), gpus);
      std::vector<RankFingerprint> all(size_t(launch.tp));
      launch.allgather(&mine, all.data(), sizeof mine);
      check_fingerprints(all);
    } else {
      check_gpus_for_tp(launch.emulated ? 1 : layout.tp, gpus);
    }
    for (size_t i = 0; i < launch.local_ranks.size(); ++i)
      ranks_.push_back(std::make_unique<CudaRank>(launch.local_ranks[i], launch.local_devices[i], config, layout, plan,
                                                  options.ops));
    const bool nccl = layout.tp > 1 || launch.multi_process || options.nccl_at_tp1;
    has_peers_ = layout.tp > 1 && !launch.emulated;
    const int nccl_ranks = launch.emulated ? 1 : layout.tp;
    ncclUniqueId id{};
    if (nccl) {
      if (launch.local_ranks.front() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      launch.broadcast_from_rank0(&id, sizeof id);
    }
    // ncclCommInitRank blocks until every rank has joined: every local rank at once.
    launch.on_local_ranks([&](size_t i) {
      ranks_[i]->activate();
      ranks_[i]->connect(nccl ? &id : nullptr, nccl_ranks, options.nccl, launch.emulated ? layout.tp : 0);
      ranks_[i]->load(source);
    });
  }
  ~CudaRankGroup() override = default;

  std::vector<RankBackend*> local_ranks() override {
    std::vector<RankBackend*> out;
    for (auto& r : ranks_) out.push_back(r.get());
    return out;
  }
  // A peer spinning in a fused kernel's barrier cannot be interrupted from the host.
  bool wake_blocked_peers() override { return !has_peers_; }
  size_t weight_bytes_per_rank() const override { return ranks_.front()->weight_bytes(); }

 private:
  std::vector<std::unique_ptr<CudaRank>> ranks_;
  bool has_peers_ = false;
};

}  // namespace

int visible_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::unique_ptr<RankGroup> make_rank_group(const ModelConfig& config, const ParallelLayout& layout,
                                           const FusionPlan& plan, const WeightSource& source, const RankLaunch& launch,
                                           const CudaBackendOptions& options) {
  return std::make_unique<CudaRankGroup>(config, layout, plan, source, launch, options);
}

}  // namespace tpmoe::cuda
