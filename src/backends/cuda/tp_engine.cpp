// The NCCL tensor-parallel CUDA engine (tp_engine.h). Each rank owns a GPU, its weights, its
// NcclCommunicator (created once, collectively) and, per request, a CudaOps whose stream the
// communicator enqueues on; every rank runs the same generation loop (SPMD), so the collectives,
// their sizes and the recorded decode graphs are the same on every rank.
#include "backends/cuda/tp_engine.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/device_weights.h"
#include "backends/cuda/mpi_launch.h"
#include "backends/cuda/nccl_comm.h"
#include "core/error.h"
#include "engine/generation.h"
#include "engine/rank_checks.h"
#include "engine/report.h"
#include "model/model.h"
#include "model/presets.h"

namespace tpmoe::cuda {

namespace {

int visible_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

struct Rank {
  int rank = 0, device = 0;
  RankShard shard;
  std::unique_ptr<DeviceWeights> weights;
  std::unique_ptr<NcclCommunicator> comm;
  ~Rank() {
    if (weights || comm) cudaSetDevice(device);  // members free their memory on this rank's GPU
  }
  Rank() = default;
  Rank(Rank&&) = default;
};

class TpEngine final : public Engine {
 public:
  TpEngine(const ModelConfig& config, const EngineOptions& options, bool shared_format_matches)
      : options_(options), config_(config) {
    mpi_ = launched_by_mpi();
    const int gpus = visible_gpus();
    const FusionOptions fusion{options.allreduce_fusion, options.shared_expert_fusion};
    layout_.pp_stage_ends = options.pp_stage_ends;
    ncclUniqueId id{};
    if (mpi_) {
      const MpiWorld& world = mpi_world();
      // --tp defaults to the number of processes; the ranks check they agree before anything else.
      layout_.tp = options.tp == 1 ? world.size : options.tp;
      plan_ = build_fusion_plan(config_, layout_, fusion, shared_format_matches);
      const RankFingerprint mine =
          make_fingerprint(config_, plan_, world.rank, layout_.tp, world.size, world.local_rank, gpus);
      std::vector<RankFingerprint> all(size_t(world.size));
      mpi_allgather(&mine, all.data(), sizeof mine);
      check_fingerprints(all);
      layout_.validate(config_);
      ranks_.resize(1);
      ranks_[0].rank = world.rank;
      ranks_[0].device = world.local_rank;
      if (world.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      mpi_broadcast(&id, sizeof id, 0);
    } else {
      layout_.tp = options.tp;
      layout_.validate(config_);
      check_gpus_for_tp(layout_.tp, gpus);
      plan_ = build_fusion_plan(config_, layout_, fusion, shared_format_matches);
      ranks_.resize(size_t(layout_.tp));
      for (int r = 0; r < layout_.tp; ++r) ranks_[r].rank = ranks_[r].device = r;
      NCCL_CHECK(ncclGetUniqueId(&id));
    }
    for (auto& r : ranks_) r.shard = RankShard::make(config_, layout_, r.rank);
    // ncclCommInitRank blocks until every rank has joined: one thread per local rank.
    on_ranks([&](Rank& r) {
      r.comm = std::make_unique<NcclCommunicator>(id, layout_.tp, r.rank, config_.hidden_size);
      if (!mpi_)
        check_fingerprints(
            r.comm->all_gather(make_fingerprint(config_, plan_, r.rank, layout_.tp, layout_.tp, r.device, gpus)));
    });
  }

  void load(const io::Checkpoint& ckpt) {
    for (auto& r : ranks_) {
      CUDA_CHECK(cudaSetDevice(r.device));
      r.weights = DeviceWeights::upload(load_rank_weights(ckpt, r.shard, plan_, {.keep_mxfp8 = true}));
    }
    unused_ = ckpt.unused_tensors();
  }

  void generate_preset(uint64_t seed) {
    if (layout_.tp == 1) {
      // Made on the device, bitwise the weights the single-GPU engine makes.
      CUDA_CHECK(cudaSetDevice(ranks_[0].device));
      ranks_[0].weights = DeviceWeights::random_preset(config_, plan_, seed);
      return;
    }
    load(io::Checkpoint::from_memory(config_, random_weights(config_, seed, DType::kBF16)));
  }

  std::string describe() const override { return describe_config(config_) + plan_.to_string(); }
  size_t weight_bytes_per_rank() const override { return ranks_[0].weights->bytes(); }
  double decode_weight_bytes(int batch) const override {
    return tpmoe::decode_weight_bytes(config_, ranks_[0].shard, plan_, batch, DType::kBF16);
  }
  const std::vector<std::string>& unknown_tensors() const override { return unused_; }

  GenerateResult generate(const GenerateRequest& req) override {
    validate_request(req, config_.vocab_size);
    GenerateResult result;
    auto body = [&](Rank& r) {
      cuda::CudaOps ops(CudaReserve::for_request(config_, plan_, r.shard, req));
      r.comm->set_stream(ops.stream());
      struct Unbind {
        NcclCommunicator& c;
        ~Unbind() { c.set_stream(nullptr); }
      } unbind{*r.comm};
      Model model(config_, plan_, r.shard, r.weights->weights(), ops, *r.comm);
      ops.init_cache(request_cache_shape(model, req, ops.records_steps()));
      // Under mpirun every process records its own result (only rank 0's stdout is shown).
      generate_on_rank(ops, model, config_.vocab_size, req, mpi_ || r.rank == 0 ? &result : nullptr);
    };
    if (mpi_ && mpi_world().size > 1) {
      // A rank failing alone mid-generation leaves its peers inside a collective: end the job.
      try {
        on_ranks(body);
      } catch (const std::exception& e) {
        mpi_abort(fmt::format("rank {}: {}", ranks_[0].rank, e.what()).c_str());
      }
    } else {
      on_ranks(body);
    }
    return result;
  }

 private:
  // Runs f on every local rank, each in its own thread with its GPU current; rethrows the error of
  // the lowest failing rank.
  //
  // A rank that fails alone mid-step leaves its peers spinning inside a fused kernel's barrier,
  // which nothing on the host can interrupt (the MPI mode ends the job for the same reason). So once
  // a rank has failed, a watchdog gives the others kPeerGraceSeconds to finish or fail too, and then
  // reports the first error and ends the process instead of hanging.
  template <class F>
  void on_ranks(F&& f) {
    constexpr int kPeerGraceSeconds = 30;
    std::vector<std::exception_ptr> errors(ranks_.size());
    std::mutex mutex;
    std::condition_variable changed;
    size_t finished = 0;
    std::string first_error;
    auto run = [&](size_t i) {
      std::exception_ptr error;
      std::string message;
      try {
        CUDA_CHECK(cudaSetDevice(ranks_[i].device));
        f(ranks_[i]);
      } catch (const std::exception& e) {
        error = std::current_exception();
        message = fmt::format("rank {}: {}", ranks_[i].rank, e.what());
      } catch (...) {
        error = std::current_exception();
        message = fmt::format("rank {} failed", ranks_[i].rank);
      }
      std::lock_guard lock(mutex);
      errors[i] = error;
      if (error && first_error.empty()) first_error = message;
      ++finished;
      changed.notify_all();
    };
    std::thread watchdog;
    if (ranks_.size() > 1) {
      watchdog = std::thread([&] {
        std::unique_lock lock(mutex);
        changed.wait(lock, [&] { return finished == ranks_.size() || !first_error.empty(); });
        if (finished == ranks_.size()) return;
        if (changed.wait_for(lock, std::chrono::seconds(kPeerGraceSeconds), [&] { return finished == ranks_.size(); }))
          return;
        std::fprintf(stderr, "error: %s (the other ranks are blocked in a collective; ending the process)\n",
                     first_error.c_str());
        std::_Exit(1);
      });
    }
    std::vector<std::thread> threads;
    for (size_t i = 1; i < ranks_.size(); ++i) threads.emplace_back(run, i);
    run(0);
    for (auto& t : threads) t.join();
    if (watchdog.joinable()) watchdog.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  EngineOptions options_;
  ModelConfig config_;
  ParallelLayout layout_;
  FusionPlan plan_;
  bool mpi_ = false;
  std::vector<Rank> ranks_;  // the ranks this process drives: all of them, or its own under mpirun
  std::vector<std::string> unused_;
};

}  // namespace

bool use_nccl_engine(const EngineOptions& options) {
  const char* force = std::getenv("TPMOE_FORCE_NCCL");
  return options.tp > 1 || launched_by_mpi() || (force && std::string(force) == "1");
}

std::unique_ptr<Engine> make_tp_engine(const io::Checkpoint& ckpt, const EngineOptions& options) {
  auto engine = std::make_unique<TpEngine>(ckpt.config(), options, shared_expert_format_matches(ckpt));
  engine->load(ckpt);
  return engine;
}

std::unique_ptr<Engine> make_tp_preset_engine(const ModelConfig& config, uint64_t seed, const EngineOptions& options) {
  auto engine = std::make_unique<TpEngine>(config, options, true);
  engine->generate_preset(seed);
  return engine;
}

}  // namespace tpmoe::cuda
