// The engine: loads each rank's shard, runs the ranks SPMD (one thread per rank, the same program
// on each, talking only through the communicator), and drives prefill and greedy decode.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/local_comm.h"
#include "core/error.h"
#include "engine/report.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/presets.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {

namespace {

std::vector<int32_t> greedy(Ops& ops, Tensor logits) {
  Tensor ids = ops.alloc_typed(logits.dim(0), 1, DType::kI32);
  ops.argmax(logits, ids);
  return ops.ids_to_host(ids);
}

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
  const std::vector<std::string>& unknown_tensors() const override { return unused_; }

  GenerateResult generate(const GenerateRequest& req) override {
    const int B = int(req.prompts.size()), G = req.max_new_tokens, V = config_.vocab_size;
    TPMOE_CHECK(B > 0, "generate: no prompts");
    TPMOE_CHECK(G >= 1, "generate: max_new_tokens must be at least 1, got {}", G);
    int max_prompt = 0;
    for (const auto& p : req.prompts) {
      TPMOE_CHECK(!p.empty(), "generate: empty prompt");
      max_prompt = std::max(max_prompt, int(p.size()));
    }
    if (!req.forced_tokens.empty()) {
      TPMOE_CHECK(int(req.forced_tokens.size()) == B, "teacher forcing: {} rows of forced tokens for {} prompts",
                  req.forced_tokens.size(), B);
      for (const auto& f : req.forced_tokens)
        TPMOE_CHECK(int(f.size()) >= G - 1, "teacher forcing: {} forced tokens, need {} for {} new tokens", f.size(),
                    G - 1, G);
    }
    GenerateResult result;
    result.vocab_size = V;
    cpu::LocalCommGroup group(options_.tp);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(options_.tp));
    const int hw = options_.threads > 0 ? options_.threads : int(std::max(1u, std::thread::hardware_concurrency()));
    auto run_rank = [&](int rank) {
      try {
        omp_set_num_threads(std::max(1, hw / options_.tp));
        run(rank, group.rank(rank), req, max_prompt + G, rank == 0 ? &result : nullptr);
      } catch (...) {
        errors[rank] = std::current_exception();
        group.abort();
      }
    };
    std::vector<std::thread> threads;
    for (int r = 1; r < options_.tp; ++r) threads.emplace_back(run_rank, r);
    run_rank(0);
    for (auto& t : threads) t.join();
    // Report the rank that failed first, not the peers it woke with "another rank failed".
    for (int pass = 0; pass < 2; ++pass)
      for (auto& e : errors) {
        if (!e) continue;
        try {
          std::rethrow_exception(e);
        } catch (const Error& err) {
          if (pass == 1 || std::string(err.what()) != "another tensor-parallel rank failed") throw;
        }
      }
    return result;
  }

 private:
  // One rank's whole generation. Every rank runs it; only rank 0 records (`out` non-null). Ranks
  // agree on every token because the collectives give them bitwise identical logits.
  void run(int rank, Communicator& comm, const GenerateRequest& req, int max_len, GenerateResult* out) {
    const int B = int(req.prompts.size()), G = req.max_new_tokens, V = config_.vocab_size;
    cpu::CpuOps ops;
    Model model(config_, plan_, RankShard::make(config_, layout_, rank), ranks_[rank], ops, comm);
    ops.init_cache(model.cache_shape(B, max_len));

    // Prefill: every prompt in one step. Logits only where they are wanted: the last prompt token
    // of each sequence, or every position when prefill logits are asked for.
    StepTokens step;
    std::vector<int> last_row(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      const auto& p = req.prompts[b];
      for (int i = 0; i < int(p.size()); ++i) {
        if (req.return_prefill_logits || i + 1 == int(p.size())) step.logit_rows.push_back(step.num_tokens());
        step.token_ids.push_back(p[i]);
        step.positions.push_back(i);
        step.seq_slots.push_back(b);
      }
      last_row[b] = int(step.logit_rows.size()) - 1;
    }
    auto t0 = std::chrono::steady_clock::now();
    ops.begin_step(step);
    Tensor logits = model.forward(step);
    std::vector<int32_t> next = greedy(ops, logits);  // one id per logit row
    std::vector<std::vector<int32_t>> generated(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) generated[b].push_back(next[last_row[b]]);
    if (out && (req.return_step_logits || req.return_prefill_logits)) {
      const std::vector<float> host = ops.to_host(logits);
      std::vector<float> step_logits(size_t(B) * V);
      for (int b = 0; b < B; ++b) std::copy_n(&host[size_t(last_row[b]) * V], V, &step_logits[size_t(b) * V]);
      if (req.return_step_logits) out->step_logits.push_back(std::move(step_logits));
      if (req.return_prefill_logits) {
        size_t row = 0;
        for (int b = 0; b < B; ++b) {
          const size_t n = req.prompts[b].size() * size_t(V);
          out->prefill_logits.emplace_back(host.begin() + row * V, host.begin() + row * V + n);
          row += req.prompts[b].size();
        }
      }
    }
    auto t1 = std::chrono::steady_clock::now();

    // Decode: one token per sequence per step.
    for (int i = 1; i < G; ++i) {
      StepTokens d;
      for (int b = 0; b < B; ++b) {
        d.token_ids.push_back(req.forced_tokens.empty() ? generated[b][i - 1] : req.forced_tokens[b][i - 1]);
        d.positions.push_back(int(req.prompts[b].size()) + i - 1);
        d.seq_slots.push_back(b);
        d.logit_rows.push_back(b);
      }
      ops.begin_step(d);
      logits = model.forward(d);
      next = greedy(ops, logits);
      for (int b = 0; b < B; ++b) generated[b].push_back(next[b]);
      if (out && req.return_step_logits) out->step_logits.push_back(ops.to_host(logits));
    }
    auto t2 = std::chrono::steady_clock::now();
    if (out) {
      out->generated = std::move(generated);
      out->prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
      out->decode_seconds = std::chrono::duration<double>(t2 - t1).count();
    }
  }

  EngineOptions options_;
  ModelConfig config_;
  ParallelLayout layout_;
  FusionPlan plan_;
  std::vector<ModelWeights> ranks_;
  std::vector<std::string> unused_;
};

std::unique_ptr<Engine> make_engine(const io::Checkpoint& ckpt, const EngineOptions& options) {
  if (options.device == "cuda") {
    TPMOE_FAIL("--device cuda: the CUDA backend is not part of this build yet; use --device cpu");
  }
  TPMOE_CHECK(options.device == "cpu", "--device must be cpu or cuda, got '{}'", options.device);
  return std::make_unique<CpuEngine>(ckpt, options);
}

}  // namespace

std::unique_ptr<Engine> Engine::from_checkpoint(const std::filesystem::path& dir, const EngineOptions& options) {
  return make_engine(io::Checkpoint::open(dir), options);
}

std::unique_ptr<Engine> Engine::from_preset(const std::string& preset, std::optional<int> layers, uint64_t seed,
                                            const EngineOptions& options) {
  const ModelConfig config = preset_config(preset, layers);
  return make_engine(io::Checkpoint::from_memory(config, random_weights(config, seed)), options);
}

}  // namespace tpmoe
