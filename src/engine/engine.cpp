// The CPU engine and the Engine factory. The CPU engine loads each rank's shard and runs the ranks SPMD
// (one thread per rank, the same program on each, talking only through the communicator).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/local_comm.h"
#include "core/error.h"
#include "engine/backends.h"
#include "engine/generation.h"
#include "engine/report.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/presets.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {

namespace {

class CpuEngine final : public Engine {
 public:
  CpuEngine(const io::Checkpoint& ckpt, const EngineOptions& options) : options_(options), config_(ckpt.config()) {
    layout_.tp = options.tp;
    layout_.pp_stage_ends = options.pp_stage_ends;
    layout_.validate(config_);
    FusionOptions fusion{options.allreduce_fusion, options.shared_expert_fusion};
    plan_ = build_fusion_plan(config_, layout_, fusion, shared_expert_format_matches(ckpt));
    for (int r = 0; r < options.tp; ++r)
      ranks_.push_back(load_rank_weights(ckpt, RankShard::make(config_, layout_, r), plan_));
    unused_ = ckpt.unused_tensors();
  }

  std::string describe() const override {
    std::string s = describe_config(config_) + plan_.to_string();
    if (!unused_.empty()) s += fmt::format("unknown tensors (not read): {}\n", fmt::join(unused_, ", "));
    return s;
  }
  size_t weight_bytes_per_rank() const override { return ranks_.front().bytes; }
  double decode_weight_bytes(int batch) const override {
    return tpmoe::decode_weight_bytes(config_, RankShard::make(config_, layout_, 0), plan_, batch,
                                      ranks_.front().embed.dtype);
  }
  const std::vector<std::string>& unknown_tensors() const override { return unused_; }

  GenerateResult generate(const GenerateRequest& req) override {
    validate_request(req, config_.vocab_size);
    GenerateResult result;
    cpu::LocalCommGroup group(options_.tp);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(options_.tp));
    const int hw = options_.threads > 0 ? options_.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    auto run_rank = [&](int rank) {
      try {
        omp_set_num_threads(std::max(1, hw / options_.tp));
        cpu::CpuOps ops;
        Model model(config_, plan_, RankShard::make(config_, layout_, rank), ranks_[rank], ops, group.rank(rank));
        ops.init_cache(request_cache_shape(model, req, ops.records_steps()));
        generate_on_rank(ops, model, config_.vocab_size, req, rank == 0 ? &result : nullptr);
      } catch (...) {
        errors[rank] = std::current_exception();
        group.abort();
      }
    };
    std::vector<std::thread> threads;
    for (int r = 1; r < options_.tp; ++r) threads.emplace_back(run_rank, r);
    run_rank(0);
    for (auto& t : threads) t.join();
    // Report the rank that failed, not the peers it woke with PeerFailed.
    std::exception_ptr peer_failed;
    for (auto& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const cpu::PeerFailed&) {
        peer_failed = e;
      }
    }
    if (peer_failed) std::rethrow_exception(peer_failed);
    return result;
  }

 private:
  EngineOptions options_;
  ModelConfig config_;
  ParallelLayout layout_;
  FusionPlan plan_;
  std::vector<ModelWeights> ranks_;
  std::vector<std::string> unused_;
};

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const io::Checkpoint& ckpt, const EngineOptions& options) {
  return std::make_unique<CpuEngine>(ckpt, options);
}

namespace {

void check_device(const std::string& device) {
  TPMOE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '{}'", device);
#ifndef TPMOE_WITH_CUDA
  TPMOE_CHECK(device == "cpu", "--device cuda: this build has no CUDA backend (configure with -DTPMOE_CUDA=ON)");
#endif
}

}  // namespace

std::string default_device() {
#ifdef TPMOE_WITH_CUDA
  if (cuda_device_present()) return "cuda";
#endif
  return "cpu";
}

double measure_copy_bandwidth(const std::string& device) {
  check_device(device);
#ifdef TPMOE_WITH_CUDA
  if (device == "cuda") return cuda_copy_bandwidth();
#endif
  // Host: a copy much larger than the caches, median of a few (read + written bytes per second).
  const size_t bytes = size_t(256) << 20;
  std::vector<std::byte> a(bytes, std::byte{1}), b(bytes);
  std::vector<double> rates;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(2.0 * double(bytes) / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

std::unique_ptr<Engine> Engine::from_checkpoint(const std::filesystem::path& dir, const EngineOptions& options) {
  check_device(options.device);
  const auto ckpt = io::Checkpoint::open(dir);
#ifdef TPMOE_WITH_CUDA
  if (options.device == "cuda") return make_cuda_engine(ckpt, options);
#endif
  return make_cpu_engine(ckpt, options);
}

std::unique_ptr<Engine> Engine::from_preset(const std::string& preset, std::optional<int> layers, uint64_t seed,
                                            const EngineOptions& options) {
  check_device(options.device);
  const ModelConfig config = preset_config(preset, layers);
#ifdef TPMOE_WITH_CUDA
  if (options.device == "cuda") return make_cuda_preset_engine(config, seed, options);
#endif
  return make_cpu_engine(io::Checkpoint::from_memory(config, random_weights(config, seed)), options);
}

}  // namespace tpmoe
