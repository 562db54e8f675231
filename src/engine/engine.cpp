// The one engine: every device and every tensor-parallel size runs through SpmdEngine. A backend
// supplies the ranks this process drives (weights, communicator, ops per request); the engine
// decides the launch (ranks as threads, or one process per rank under mpirun), builds the fusion
// plan, sizes each request's steps and runs the same generation loop on every rank (SPMD) under
// RankRunner's one failure policy. tp 1 is a group of one.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>

#include "backends/backend.h"
#include "backends/cpu/cpu_backend.h"
#include "core/error.h"
#include "engine/generation.h"
#include "engine/launch.h"
#include "engine/op_bench.h"
#include "engine/rank_runner.h"
#include "engine/report.h"
#include "engine/sampling.h"
#include "engine/scheduler.h"
#include "engine/serve_loop.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/presets.h"
#include "tpmoe/tpmoe.h"
#ifdef TPMOE_WITH_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

namespace tpmoe {

namespace {

void check_device(const std::string& device) {
  TPMOE_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '{}'", device);
#ifndef TPMOE_WITH_CUDA
  TPMOE_CHECK(device == "cpu", "--device cuda: this build has no CUDA backend (configure with -DTPMOE_CUDA=ON)");
#endif
}

// The ranks this process drives and how it reaches the others.
RankLaunch make_launch(const EngineOptions& o) {
  RankLaunch launch;
  if (o.emulate_tp > 0) {
    TPMOE_CHECK(o.tp == 1, "--emulate-tp {} runs rank 0 of that group on one device: leave --tp at 1 (got --tp {})",
                o.emulate_tp, o.tp);
    TPMOE_CHECK(!launched_by_mpi(), "--emulate-tp runs in one process; start it without mpirun");
    launch.tp = o.emulate_tp;
    launch.emulated = true;
    launch.local_ranks = {0};
    launch.local_devices = {0};
    launch.broadcast_from_rank0 = [](void*, size_t) {};
    launch.allgather = [](const void* mine, void* all, size_t bytes) { std::memcpy(all, mine, bytes); };
  } else if (launched_by_mpi()) {
    const MpiWorld& world = mpi_world();
    // --tp defaults to the number of processes; the ranks check they agree before anything else.
    launch.tp = o.tp == 1 ? world.size : o.tp;
    launch.multi_process = true;
    launch.local_ranks = {world.rank};
    launch.local_devices = {world.local_rank};
    launch.broadcast_from_rank0 = [](void* data, size_t bytes) { mpi_broadcast(data, bytes, 0); };
    launch.allgather = [](const void* mine, void* all, size_t bytes) { mpi_allgather(mine, all, bytes); };
  } else {
    launch.tp = o.tp;
    for (int r = 0; r < o.tp; ++r) {
      launch.local_ranks.push_back(r);
      launch.local_devices.push_back(r);
    }
    launch.broadcast_from_rank0 = [](void*, size_t) {};
    launch.allgather = [](const void* mine, void* all, size_t bytes) { std::memcpy(all, mine, bytes); };
  }
  return launch;
}

class SpmdEngine final : public Engine {
 public:
  SpmdEngine(const ModelConfig& config, const EngineOptions& o, const WeightSource& source, bool shared_format_matches)
      : options_(o), config_(config) {
    check_device(o.device);
    launch_ = make_launch(o);
    runner_ = std::make_unique<RankRunner>(launch_.multi_process, launch_.tp > 1 && !launch_.emulated);
    // Collective set-up (communicators) runs on every local rank at once, under the same policy.
    launch_.on_local_ranks = [this](const std::function<void(size_t)>& f) {
      runner_->run(launch_.local_ranks.size(), f, {}, [this](size_t i) { return launch_.local_ranks[i]; });
    };
    layout_.tp = launch_.tp;
    layout_.pp_stage_ends = o.pp_stage_ends;
    layout_.validate(config_);
    plan_ =
        build_fusion_plan(config_, layout_, {o.allreduce_fusion, o.shared_expert_fusion, o.shared_fusion_max_tokens},
                          shared_format_matches);
#ifdef TPMOE_WITH_CUDA
    if (o.device == "cuda") {
      cuda::CudaBackendOptions co;
      co.ops.profile_ops = o.profile_ops;
      co.ops.kernel_timeline = o.kernel_timeline;
      co.ops.pdl = o.pdl;
      co.ops.decode_gemv = o.decode_gemv;
      co.nccl.path = cuda::parse_allreduce_path(o.allreduce_path);
      co.nccl_at_tp1 = o.nccl_at_tp1;
      group_ = cuda::make_rank_group(config_, layout_, plan_, source, launch_, co);
    }
#endif
    if (!group_) group_ = cpu::make_rank_group(config_, layout_, plan_, source, launch_, {o.threads});
    // Only now has every rank read what it needs from the checkpoint.
    if (source.checkpoint) unused_ = source.checkpoint->unused_tensors();
  }

  std::string describe() const override {
    std::string s = describe_config(config_) + plan_.to_string();
    if (launch_.emulated)
      s += fmt::format(
          "emulating rank 0 of tp {} on one device: its shard and plan; collectives replaced by a local stand-in that "
          "runs the fused add + RMSNorm over this rank's partial only (no communication; logits are not the model's)\n",
          launch_.tp);
    if (!unused_.empty()) s += fmt::format("unknown tensors (not read): {}\n", fmt::join(unused_, ", "));
    return s;
  }
  std::string shared_expert_plan() const override { return plan_.shared_expert.reason; }
  size_t weight_bytes_per_rank() const override { return group_->weight_bytes_per_rank(); }
  double decode_weight_bytes(int batch, const std::vector<int>* routed_experts_per_layer) const override {
    std::vector<double> routed;
    if (routed_experts_per_layer) routed.assign(routed_experts_per_layer->begin(), routed_experts_per_layer->end());
    // The bytes as the device holds them: bf16 matrices on the GPU (MXFP8 linears as FP8 + scales),
    // the checkpoint's dtype on the CPU.
    return tpmoe::decode_weight_bytes(config_, RankShard::make(config_, layout_, 0), plan_, batch,
                                      options_.device == "cuda" ? DType::kBF16 : group_weight_dtype(),
                                      routed_experts_per_layer ? &routed : nullptr, options_.device == "cuda");
  }
  const std::vector<std::string>& unknown_tensors() const override { return unused_; }
  bool is_primary() const override { return launch_.local_ranks.front() == 0; }
  std::vector<int32_t> eos_token_ids() const override { return config_.eos_token_ids; }
  int vocab_size() const override { return config_.vocab_size; }

  GenerateResult generate(const GenerateRequest& req) override {
    validate_request(req, config_.vocab_size);
    const StepBudget budget = step_budget(req);
    // One seed for the request, the same on every rank (rank 0's, under mpirun).
    uint64_t seed = resolve_seed(req.sampling);
    launch_.broadcast_from_rank0(&seed, sizeof seed);
    GenerateResult result;
    std::vector<RankBackend*> ranks = group_->local_ranks();
    runner_->run(
        ranks.size(),
        [&](size_t i) {
          RankBackend& r = *ranks[i];
          RankSession s = open_rank(r, budget);
          s.ops->init_cache(request_cache_shape(*s.model, req, s.ops->records_steps()));
          generate_on_rank(*s.ops, *s.model, config_.vocab_size, req, seed, r.rank() == 0 ? &result : nullptr);
        },
        [&] { return group_->wake_blocked_peers(); }, [&](size_t i) { return ranks[i]->rank(); });
    return result;
  }

  void serve(const ServeOptions& options, const std::function<void(Scheduler&)>& front) override {
    const ServeLayout layout = BatchScheduler::layout_for(options);
    StepBudget budget;
    budget.max_tokens = std::max(options.max_step_tokens, decode_bucket(options.max_batch));
    budget.max_logit_rows = decode_bucket(options.max_batch);
    budget.max_seqs = layout.max_seqs;
    budget.max_len = options.max_context;
    std::vector<RankBackend*> ranks = group_->local_ranks();
    // The scheduler and the front live in the process that holds rank 0; the other ranks follow
    // its plans (threads through the channel, processes through broadcasts).
    std::unique_ptr<BatchScheduler> scheduler;
    if (is_primary()) scheduler = std::make_unique<BatchScheduler>(options, config_.vocab_size);
    PlanChannel channel(ranks.size() - 1);  // to local ranks 1.. (rank 0 makes the plans)
    std::thread front_thread;
    std::exception_ptr front_error;
    try {
      runner_->run(
          ranks.size(),
          [&](size_t i) {
            RankBackend& r = *ranks[i];
            RankSession s = open_rank(r, budget);
            Ops& ops = *s.ops;
            Model& model = *s.model;
            ops.init_cache(
                model.cache_shape(layout.max_seqs, options.max_context, options.page_size, layout.num_pages));
            if (r.rank() != 0) {
              for (;;) {
                auto plan =
                    launch_.multi_process ? std::make_shared<const StepPlan>(receive_plan()) : channel.receive(i - 1);
                if (plan->shutdown) return;
                run_plan(ops, model, *plan);
              }
            }
            scheduler->set_records_steps(ops.records_steps());
            front_thread = std::thread([&] {
              try {
                front(*scheduler);
              } catch (...) {  // e.g. the port is taken: serving ends, and serve() rethrows it
                front_error = std::current_exception();
              }
              scheduler->shutdown();
            });
            for (;;) {
              auto plan = std::make_shared<const StepPlan>(scheduler->next_plan());
              if (launch_.multi_process)
                broadcast_plan(*plan);
              else
                channel.publish(plan);
              if (plan->shutdown) return;
              scheduler->complete(run_plan(ops, model, *plan));
            }
          },
          [&] {
            channel.close();
            if (scheduler) scheduler->shutdown("a rank failed");
            return group_->wake_blocked_peers();
          },
          [&](size_t i) { return ranks[i]->rank(); });
    } catch (const std::exception& e) {
      if (scheduler) scheduler->shutdown(e.what());
      if (front_thread.joinable()) front_thread.join();
      throw;
    }
    if (front_thread.joinable()) front_thread.join();
    if (front_error) std::rethrow_exception(front_error);
  }

 private:
  // Engine policy: a request's prefill runs as one step and its decode in batches padded to a
  // bucket (so a few recorded graphs serve every batch).
  static StepBudget step_budget(const GenerateRequest& req) {
    int prefill_tokens = 0, longest = 0;
    for (const auto& p : req.prompts) {
      prefill_tokens += int(p.size());
      longest = std::max(longest, int(p.size()));
    }
    const int decode_rows = decode_bucket(int(req.prompts.size()));
    StepBudget b;
    b.max_tokens = std::max(prefill_tokens, decode_rows);
    b.max_logit_rows = std::max(req.return_prefill_logits ? prefill_tokens : int(req.prompts.size()), decode_rows);
    b.max_seqs = decode_rows;
    b.max_len = longest + req.max_new_tokens;
    return b;
  }
  // A rank's ops for one request or serving run (scratch reserved for `budget`) and the model over
  // them; members in this order so the model goes first.
  struct RankSession {
    std::unique_ptr<Ops> ops;
    std::unique_ptr<Model> model;
  };
  // On the rank's own thread: makes its device current, then its ops and model.
  RankSession open_rank(RankBackend& r, const StepBudget& budget) const {
    r.activate();
    RankSession s;
    s.ops = r.make_ops(budget);
    s.model = std::make_unique<Model>(config_, plan_, RankShard::make(config_, layout_, r.rank()), r.weights(), *s.ops,
                                      r.comm());
    return s;
  }
  // Rank 0's plan to the other processes (mpirun): its size, then its bytes.
  void broadcast_plan(const StepPlan& plan) const {
    std::vector<std::byte> bytes = plan.serialize();
    uint64_t n = bytes.size();
    launch_.broadcast_from_rank0(&n, sizeof n);
    launch_.broadcast_from_rank0(bytes.data(), n);
  }
  StepPlan receive_plan() const {
    uint64_t n = 0;
    launch_.broadcast_from_rank0(&n, sizeof n);
    std::vector<std::byte> bytes(n);
    launch_.broadcast_from_rank0(bytes.data(), n);
    return StepPlan::deserialize(bytes);
  }

  DType group_weight_dtype() const { return group_->local_ranks().front()->weights().embed.dtype; }

  EngineOptions options_;
  ModelConfig config_;
  ParallelLayout layout_;
  FusionPlan plan_;
  RankLaunch launch_;
  std::unique_ptr<RankRunner> runner_;
  std::unique_ptr<RankGroup> group_;
  std::vector<std::string> unused_;
};

}  // namespace

void run_allreduce_bench(int tp) {
#ifdef TPMOE_WITH_CUDA
  EngineOptions o;
  o.tp = tp;
  RankLaunch launch = make_launch(o);
  const RankRunner runner(launch.multi_process, launch.tp > 1);
  launch.on_local_ranks = [&](const std::function<void(size_t)>& f) {
    runner.run(launch.local_ranks.size(), f, {}, [&](size_t i) { return launch.local_ranks[i]; });
  };
  cuda::run_allreduce_bench(launch);
#else
  TPMOE_FAIL("bench-op allreduce --tp {}: this build has no CUDA backend", tp);
#endif
}

std::string default_device() {
#ifdef TPMOE_WITH_CUDA
  if (cuda::visible_gpus() > 0) return "cuda";
#endif
  return "cpu";
}

double measure_read_bandwidth(const std::string& device) {
  check_device(device);
#ifdef TPMOE_WITH_CUDA
  if (device == "cuda") return cuda::read_bandwidth();
#endif
  // Host: 8-byte loads over a buffer much larger than the caches, the sum kept so they stay.
  const size_t words = size_t(64) << 20;
  std::vector<uint64_t> a(words, 0x5A5A5A5A5A5A5A5Aull);
  std::vector<double> rates;
  volatile uint64_t sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t acc = 0;
    for (size_t i = 0; i < words; ++i) acc ^= a[i];
    sink = sink ^ acc;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(double(words * sizeof(uint64_t)) / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

double measure_copy_bandwidth(const std::string& device) {
  check_device(device);
#ifdef TPMOE_WITH_CUDA
  if (device == "cuda") return cuda::copy_bandwidth();
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
  WeightSource source;
  source.checkpoint = &ckpt;
  return std::make_unique<SpmdEngine>(ckpt.config(), options, source, shared_expert_format_matches(ckpt));
}

std::unique_ptr<Engine> Engine::from_preset(const std::string& preset, std::optional<int> layers, uint64_t seed,
                                            const EngineOptions& options) {
  check_device(options.device);
  WeightSource source;
  source.preset_seed = seed;
  ModelConfig config = preset_config(preset, layers);
  TPMOE_CHECK(options.preset_dtype == "bf16" || options.preset_dtype == "mxfp8",
              "preset dtype must be bf16 or mxfp8, got '{}'", options.preset_dtype);
  if (options.preset_dtype == "mxfp8") set_mxfp8(config);
  return std::make_unique<SpmdEngine>(config, options, source, true);
}

}  // namespace tpmoe
