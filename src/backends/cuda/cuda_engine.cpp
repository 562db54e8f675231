// The engine on one GPU: device weights, a CudaOps per request (its KV cache sized for the request),
// decode steps recorded as CUDA graphs per batch bucket. Tensor parallelism across GPUs (and runs
// under mpirun) go to the NCCL engine in tp_engine.cpp: tp must be 1 here.
#include <algorithm>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/device_weights.h"
#include "backends/cuda/tp_engine.h"
#include "core/error.h"
#include "engine/backends.h"
#include "engine/generation.h"
#include "engine/report.h"
#include "model/model.h"

namespace tpmoe {

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
};

class CudaEngine final : public Engine {
 public:
  CudaEngine(const ModelConfig& config, const EngineOptions& options, bool shared_format_matches)
      : options_(options), config_(config) {
    layout_.tp = options.tp;
    layout_.pp_stage_ends = options.pp_stage_ends;
    layout_.validate(config_);
    TPMOE_CHECK(options.tp == 1,
                "--device cuda --tp {}: tensor parallelism on GPUs needs the NCCL communicator, "
                "which this build does not have yet; use --tp 1 or --device cpu",
                options.tp);
    int devices = 0;
    TPMOE_CHECK(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, "--device cuda: no CUDA GPU is visible");
    plan_ = build_fusion_plan(config_, layout_, {options.allreduce_fusion, options.shared_expert_fusion},
                              shared_format_matches);
    shard_ = RankShard::make(config_, layout_, 0);
  }

  void load(const io::Checkpoint& ckpt) {
    weights_ = cuda::DeviceWeights::upload(load_rank_weights(ckpt, shard_, plan_, {.keep_mxfp8 = true}));
    unused_ = ckpt.unused_tensors();
  }
  void generate_preset(uint64_t seed) { weights_ = cuda::DeviceWeights::random_preset(config_, plan_, seed); }

  std::string describe() const override { return describe_config(config_) + plan_.to_string(); }
  size_t weight_bytes_per_rank() const override { return weights_->bytes(); }
  double decode_weight_bytes(int batch) const override {
    return tpmoe::decode_weight_bytes(config_, shard_, plan_, batch, DType::kBF16);
  }
  const std::vector<std::string>& unknown_tensors() const override { return unused_; }

  GenerateResult generate(const GenerateRequest& req) override {
    validate_request(req, config_.vocab_size);
    cuda::CudaOps ops(cuda::CudaReserve::for_request(config_, plan_, shard_, req));
    SingleRank comm;
    Model model(config_, plan_, shard_, weights_->weights(), ops, comm);
    ops.init_cache(request_cache_shape(model, req, ops.records_steps()));
    GenerateResult result;
    generate_on_rank(ops, model, config_.vocab_size, req, &result);
    return result;
  }

 private:
  EngineOptions options_;
  ModelConfig config_;
  ParallelLayout layout_;
  FusionPlan plan_;
  RankShard shard_;
  std::unique_ptr<cuda::DeviceWeights> weights_;
  std::vector<std::string> unused_;
};

}  // namespace

std::unique_ptr<Engine> make_cuda_engine(const io::Checkpoint& ckpt, const EngineOptions& options) {
  if (cuda::use_nccl_engine(options)) return cuda::make_tp_engine(ckpt, options);
  auto engine = std::make_unique<CudaEngine>(ckpt.config(), options, shared_expert_format_matches(ckpt));
  engine->load(ckpt);
  return engine;
}

std::unique_ptr<Engine> make_cuda_preset_engine(const ModelConfig& config, uint64_t seed,
                                                const EngineOptions& options) {
  if (cuda::use_nccl_engine(options)) return cuda::make_tp_preset_engine(config, seed, options);
  auto engine = std::make_unique<CudaEngine>(config, options, true);
  engine->generate_preset(seed);
  return engine;
}

}  // namespace tpmoe
