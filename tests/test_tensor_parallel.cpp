// Tensor parallelism (SPEC §4) must not change what the model computes: any tp, with or without the
// fused all-reduce and shared-expert paths, and with pipeline stage ends in the plan, gives the
// logits of the plain tp-1 run.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "io/checkpoint.h"
#include "model/presets.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

namespace fs = std::filesystem;

// TP changes only the order of fp32 sums (per-rank partial sums, then the reduction), so results
// agree to float rounding; a wrong slice, a lost or doubled reduction is off by O(1).
constexpr double kTpTolerance = 1e-5;
constexpr uint64_t kSeed = 1234;

// A teacher-forced request with every prefill position's logits: prompts longer than the 2 kept
// blocks of 8 keys, so sparse block selection matters, and a few decode steps.
GenerateRequest synthetic_request(int vocab) {
  GenerateRequest req;
  for (int b = 0; b < 2; ++b) {
    std::vector<int32_t> prompt, forced;
    for (int i = 0; i < 18 + 2 * b; ++i) prompt.push_back(int32_t(1 + (b * 131 + i * 29) % (vocab - 1)));
    for (int i = 0; i < 3; ++i) forced.push_back(int32_t(1 + (b * 17 + i * 53) % (vocab - 1)));
    req.prompts.push_back(prompt);
    req.forced_tokens.push_back(forced);
  }
  req.max_new_tokens = 4;
  req.return_prefill_logits = true;
  return req;
}

EngineOptions options(int tp, bool allreduce_fusion = true, bool shared_expert_fusion = true,
                      std::vector<int> pp_stage_ends = {}, int shared_fusion_max_tokens = -1) {
  EngineOptions o;
  o.tp = tp;
  o.allreduce_fusion = allreduce_fusion;
  o.shared_expert_fusion = shared_expert_fusion;
  o.shared_fusion_max_tokens = shared_fusion_max_tokens;
  o.pp_stage_ends = std::move(pp_stage_ends);
  return o;
}

void expect_same_logits(const GenerateResult& got, const GenerateResult& want, const std::string& what) {
  SCOPED_TRACE(what);
  const double prefill_err = test::relative_l2(test::concat(got.prefill_logits), test::concat(want.prefill_logits));
  const double step_err = test::relative_l2(test::concat(got.step_logits), test::concat(want.step_logits));
  EXPECT_LT(prefill_err, kTpTolerance);
  EXPECT_LT(step_err, kTpTolerance);
  EXPECT_EQ(got.generated, want.generated);
}

// Runs `req` on the checkpoint at tp 1 and compares every `tps` run against it.
void expect_tp_invariant(const fs::path& dir, const GenerateRequest& req, std::initializer_list<int> tps) {
  const GenerateResult base = Engine::from_checkpoint(dir, options(1))->generate(req);
  ASSERT_FALSE(base.prefill_logits.empty());
  for (int tp : tps)
    expect_same_logits(Engine::from_checkpoint(dir, options(tp))->generate(req), base, fmt::format("tp {}", tp));
}

class TensorParallel : public ::testing::Test {
 protected:
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  // Writes `config` with random weights as a layout-A checkpoint and returns its directory.
  const fs::path& write_model(const ModelConfig& config) {
    dir_ = test::make_temp_dir("tp");
    io::write_checkpoint(dir_, config, random_weights(config, kSeed), io::CheckpointLayout::kTransformers);
    return dir_;
  }
  fs::path dir_;
};

// m3-tiny has 4 q heads and 2 KV heads: tp 2 splits KV heads, tp 4 replicates them.
TEST_F(TensorParallel, FixtureMatchesTp1) {
  expect_tp_invariant(test::fixtures_dir() / "m3-tiny", test::teacher_forced_request(test::load_fixture_reference()),
                      {2, 4});
}

// The tiny preset has 8 q heads, 4 KV heads and 16 experts: tp 2 and 4 split every dimension.
TEST_F(TensorParallel, TinyPresetMatchesTp1) {
  const ModelConfig config = preset_config("tiny");
  expect_tp_invariant(write_model(config), synthetic_request(config.vocab_size), {2, 4});
}

// 2 KV heads (and so 2 index heads) at tp 4: pairs of ranks share one replicated KV/index head.
TEST_F(TensorParallel, ReplicatedKvHeadsMatchTp1) {
  ModelConfig config = preset_config("tiny");
  config.num_kv_heads = 2;
  config.index_n_heads = 2;
  config.validate("tiny with 2 kv heads");
  expect_tp_invariant(write_model(config), synthetic_request(config.vocab_size), {2, 4});
}

// Every fusion switch at every tp computes the same function: a deferred partial without a consumer,
// a shared slot binned by E instead of E+n, or a shared expert reduced twice would all show here.
// With the shared fusion's step limit at 1 token, the prefills and the batch's decode steps run the
// fused rows as the shared MLP (a row view of the wrong expert, or its slots still appended, would
// show).
TEST_F(TensorParallel, FusionSwitchesDoNotChangeLogits) {
  const GenerateRequest req = synthetic_request(preset_config("tiny").vocab_size);
  const GenerateResult base = Engine::from_preset("tiny", std::nullopt, kSeed, options(1))->generate(req);
  for (int tp : {1, 2, 4})
    for (bool shared : {true, false})
      for (bool allreduce : {true, false}) {
        // Fused in every step, the prefill included (by default steps of over 32 tokens are not).
        auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, options(tp, allreduce, shared, {}, 0));
        // The switches must reach the plan, or this test would compare a path with itself.
        const std::string plan = engine->describe();
        EXPECT_NE(plan.find(shared ? "every step appends them" : "turned off"), std::string::npos) << plan;
        if (tp > 1) {
          EXPECT_EQ(plan.find("deferred to the next input_layernorm") != std::string::npos, allreduce) << plan;
        }
        expect_same_logits(engine->generate(req), base,
                           fmt::format("tp {}, shared fusion {}, all-reduce fusion {}", tp, shared, allreduce));
      }
  for (int tp : {1, 2}) {
    auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, options(tp, true, true, {}, 1));
    const std::string plan = engine->describe();
    EXPECT_NE(plan.find("steps of up to 1 token append"), std::string::npos) << plan;
    expect_same_logits(engine->generate(req), base, fmt::format("tp {}, shared fusion on up to 1 token a step", tp));
  }
}

// A pipeline stage end makes layer 1 reduce immediately and layer 2 take a plain add + norm: the
// plan changes at that boundary and the result must not.
TEST_F(TensorParallel, PipelineStageEndMatchesTp1) {
  const GenerateRequest req = synthetic_request(preset_config("tiny").vocab_size);
  const GenerateResult base = Engine::from_preset("tiny", std::nullopt, kSeed, options(1))->generate(req);
  auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, options(2, true, true, {1}));
  EXPECT_NE(engine->describe().find("[stage end]"), std::string::npos) << engine->describe();
  expect_same_logits(engine->generate(req), base, "tp 2, stage end after layer 1");
}

}  // namespace
}  // namespace tpmoe
