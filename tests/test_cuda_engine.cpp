// The one engine on one GPU: rank 0 of a larger group emulated on one device (its shard generated
// on the device from the weight table, the collectives replaced by the stand-in) against the same
// emulation on the CPU oracle, and the routing statistics the bandwidth floor counts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "cuda_test_util.h"
#include "model/config.h"
#include "model/presets.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

constexpr double kModelTolerance = 3e-2;  // a whole forward in bf16 against fp32 (as test_cuda_model)

GenerateRequest teacher_forced(int vocab, int batch) {
  GenerateRequest req;
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> p, f;
    for (int i = 0; i < 21 + 3 * b; ++i) p.push_back(int32_t(1 + (b * 41 + i * 13) % (vocab - 1)));
    for (int i = 0; i < 5; ++i) f.push_back(int32_t(1 + (b * 7 + i * 31) % (vocab - 1)));
    req.prompts.push_back(p);
    req.forced_tokens.push_back(f);
  }
  req.max_new_tokens = 6;
  req.return_prefill_logits = true;
  return req;
}

TEST(CudaEngine, EmulatedRankMatchesTheCpuOracle) {
  TPMOE_REQUIRE_GPU();
  const GenerateRequest req = teacher_forced(512, 3);
  for (int tp : {2, 4, 8}) {
    EngineOptions gpu, cpu;
    gpu.device = "cuda";
    gpu.emulate_tp = cpu.emulate_tp = tp;
    const GenerateResult a = Engine::from_preset("tiny", std::nullopt, 11, gpu)->generate(req);
    const GenerateResult b = Engine::from_preset("tiny", std::nullopt, 11, cpu)->generate(req);
    const double prefill = test::relative_l2(test::concat(a.prefill_logits), test::concat(b.prefill_logits));
    const double steps = test::relative_l2(test::concat(a.step_logits), test::concat(b.step_logits));
    std::printf("emulated rank 0 of tp %d, GPU vs CPU: relative L2 prefill %.3g, steps %.3g\n", tp, prefill, steps);
    EXPECT_LT(prefill, kModelTolerance) << "tp " << tp;
    EXPECT_LT(steps, kModelTolerance) << "tp " << tp;
  }
}

// MXFP8 weights generated on the device with the shared expert unfused: its row-parallel down is a
// column gather of one block (one shared expert), which the generator once refused. Rank 0 of tp 2
// (the tiny preset's shared width 64 halves to 32, one scale block).
TEST(CudaEngine, EmulatedMxfp8RankWithTheSharedExpertUnfusedMatchesTheCpuOracle) {
  TPMOE_REQUIRE_GPU();
  const GenerateRequest req = teacher_forced(512, 2);
  EngineOptions gpu, cpu;
  gpu.device = "cuda";
  gpu.emulate_tp = cpu.emulate_tp = 2;
  gpu.preset_dtype = cpu.preset_dtype = "mxfp8";
  gpu.shared_expert_fusion = cpu.shared_expert_fusion = false;
  const GenerateResult a = Engine::from_preset("tiny", std::nullopt, 11, gpu)->generate(req);
  const GenerateResult b = Engine::from_preset("tiny", std::nullopt, 11, cpu)->generate(req);
  const double prefill = test::relative_l2(test::concat(a.prefill_logits), test::concat(b.prefill_logits));
  const double steps = test::relative_l2(test::concat(a.step_logits), test::concat(b.step_logits));
  std::printf(
      "MXFP8, shared expert unfused, emulated rank 0 of tp 2, GPU vs CPU: relative L2 prefill %.3g, steps %.3g\n",
      prefill, steps);
  EXPECT_LT(prefill, kModelTolerance);
  EXPECT_LT(steps, kModelTolerance);
}

// Decode steps queued behind the running one (the ids fed back on the device, recorded steps
// replayed back to back) give the tokens one step at a time gives: one rank's argmax and rank 0 of a
// vocab-parallel tp 8 (its winners combined on the device; both recorded with the step), a padded
// batch, sequences ending early, and sampled draws (not recorded: their rows are uploaded).
TEST(CudaEngine, OverlappedDecodeGivesTheTokensOfOneStepAtATime) {
  TPMOE_REQUIRE_GPU();
  for (int tp : {1, 8}) {
    SCOPED_TRACE("emulated tp " + std::to_string(tp));
    EngineOptions gpu;
    gpu.device = "cuda";
    gpu.emulate_tp = tp;
    auto engine = Engine::from_preset("tiny", std::nullopt, 5, gpu);
    GenerateRequest req = teacher_forced(512, 3);
    req.forced_tokens.clear();
    req.return_prefill_logits = req.return_step_logits = false;
    req.max_new_tokens = 24;
    auto both_ways = [&] {
      req.overlap_decode = false;
      const GenerateResult one_at_a_time = engine->generate(req);
      req.overlap_decode = true;
      const GenerateResult overlapped = engine->generate(req);
      EXPECT_TRUE(overlapped.overlapped_decode);
      EXPECT_EQ(overlapped.generated, one_at_a_time.generated);
      EXPECT_EQ(overlapped.finish_reasons, one_at_a_time.finish_reasons);
      return overlapped;
    };
    const GenerateResult full = both_ways();
    ASSERT_EQ(full.generated[2].size(), 24u);
    req.eos_token_ids = {full.generated[2][10]};  // sequence 2 ends at its 11th token, or before
    const GenerateResult ended = both_ways();
    EXPECT_LE(ended.generated[2].size(), 11u);
    EXPECT_EQ(ended.finish_reasons[2], "stop");
    req.eos_token_ids.clear();
    req.sampling.temperature = 0.8f;
    req.sampling.top_k = 40;
    req.sampling.seed = 17;
    EXPECT_NE(both_ways().generated, full.generated);
  }
}

TEST(CudaEngine, RoutingStatsCountTheRealSequencesOnly) {
  TPMOE_REQUIRE_GPU();
  const ModelConfig config = preset_config("tiny");
  EngineOptions gpu, cpu;
  gpu.device = "cuda";
  auto g = Engine::from_preset("tiny", std::nullopt, 3, gpu);
  auto c = Engine::from_preset("tiny", std::nullopt, 3, cpu);
  for (int batch : {1, 3, 5}) {  // 3 and 5 decode in padded buckets of 4 and 8
    GenerateRequest req = teacher_forced(config.vocab_size, batch);
    req.return_prefill_logits = false;
    req.record_routing = true;
    const GenerateResult a = g->generate(req), b = c->generate(req);
    ASSERT_EQ(a.step_routed_experts.size(), b.step_routed_experts.size());
    int differ = 0;
    std::string where;  // step s, layer l: GPU count / CPU count, for each that differs
    for (size_t s = 0; s < a.step_routed_experts.size(); ++s)
      for (int l = 0; l < config.num_layers; ++l) {
        const int x = a.step_routed_experts[s][l], y = b.step_routed_experts[s][l];
        if (batch == 1 && config.mlp_layer_types[l] == MlpType::kMoe) {
          EXPECT_EQ(x, config.num_experts_per_tok);
        }
        differ += std::abs(x - y);
        if (x != y)
          where += " step " + std::to_string(s) + " layer " + std::to_string(l) + ": " + std::to_string(x) + " / " +
                   std::to_string(y) + ";";
      }
    // bf16 may flip a near-tied router choice; padding rows counted would add experts every step.
    EXPECT_LE(differ, 2) << "batch " << batch << ", GPU / CPU distinct experts:" << where;
  }
}

}  // namespace
}  // namespace tpmoe
