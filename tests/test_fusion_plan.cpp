// The fusion plan (SPEC §4) rule by rule, and the layout checks that guard it. The plan is a pure
// function of config, layout and switches, so each rule gets its own small test on the tiny preset
// (layer 0 dense, layers 1-3 MoE, Is == I, one shared expert).
#include "model/fusion_plan.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <functional>

#include "core/error.h"
#include "model/presets.h"

namespace tpmoe {
namespace {

constexpr FusionOptions kAllreduceFusionOff{.allreduce_fusion = false, .shared_expert_fusion = true};
constexpr FusionOptions kSharedFusionOff{.allreduce_fusion = true, .shared_expert_fusion = false};

FusionPlan plan_for(int tp, FusionOptions options = {}, std::vector<int> stage_ends = {},
                    ModelConfig config = preset_config("tiny")) {
  ParallelLayout layout;
  layout.tp = tp;
  layout.pp_stage_ends = std::move(stage_ends);
  return build_fusion_plan(config, layout, options);
}

FusionPlan plan_for(const ModelConfig& config, const ParallelLayout& layout, bool shared_format_matches = true) {
  return build_fusion_plan(config, layout, {}, shared_format_matches);
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Expects `fn` to throw a tpmoe::Error whose message holds every one of `needles`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_TRUE(contains(e.what(), n)) << "'" << n << "' not in: " << e.what();
    return;
  }
  ADD_FAILURE() << "no tpmoe::Error thrown";
}

TEST(FusionPlan, Tp1ReducesAndDefersNothing) {
  const FusionPlan plan = plan_for(1);
  for (const LayerPlan& lp : plan.layers) {
    EXPECT_EQ(lp.attention, Reduce::kNone);
    EXPECT_EQ(lp.mlp, Reduce::kNone);
    EXPECT_FALSE(lp.fuse_input_allreduce);
    EXPECT_TRUE(lp.mlp_reduce_results());
  }
  EXPECT_FALSE(plan.final_norm_fused);
  EXPECT_NO_THROW(check_plan_consistent(plan));
}

// The seed-1 path: each MLP leaves its partial sum for the next layer's input norm, and attention is
// always reduced inside post_attention_layernorm.
TEST(FusionPlan, EveryMlpDefersToTheNextInputNorm) {
  for (int tp : {2, 4}) {
    const FusionPlan plan = plan_for(tp);
    ASSERT_EQ(plan.layers.size(), 4u);
    for (size_t l = 0; l < plan.layers.size(); ++l) {
      SCOPED_TRACE(fmt::format("tp {} layer {}", tp, l));
      const LayerPlan& lp = plan.layers[l];
      EXPECT_EQ(lp.attention, Reduce::kFusedIntoNorm);
      EXPECT_EQ(lp.mlp, Reduce::kDeferred);
      EXPECT_FALSE(lp.mlp_reduce_results());
      EXPECT_EQ(lp.fuse_input_allreduce, l > 0);  // layer 0's input is the embedding: nothing to reduce
    }
    EXPECT_NO_THROW(check_plan_consistent(plan));
  }
}

// A partial sum must not leave a pipeline stage: the stage's last layer reduces immediately and the
// next stage's first layer does a plain add + norm.
TEST(FusionPlan, StageEndReducesImmediately) {
  const FusionPlan plan = plan_for(2, {}, {1});
  EXPECT_EQ(plan.layers[0].mlp, Reduce::kDeferred);
  EXPECT_TRUE(plan.layers[1].fuse_input_allreduce);
  EXPECT_TRUE(plan.layers[1].stage_end);
  EXPECT_EQ(plan.layers[1].mlp, Reduce::kImmediate);
  EXPECT_TRUE(contains(plan.layers[1].mlp_reason, "pipeline stage")) << plan.layers[1].mlp_reason;
  EXPECT_FALSE(plan.layers[2].fuse_input_allreduce);
  EXPECT_EQ(plan.layers[2].attention, Reduce::kFusedIntoNorm);  // attention fusion stays inside the layer
  EXPECT_EQ(plan.layers[2].mlp, Reduce::kDeferred);
  EXPECT_TRUE(plan.layers[3].fuse_input_allreduce);
  EXPECT_NO_THROW(check_plan_consistent(plan));
}

// The final norm consumes the last layer's deferral; when the last layer reduced, it must not reduce again.
TEST(FusionPlan, FinalNormFusesOnlyADeferredLastLayer) {
  const FusionPlan fused = plan_for(2);
  EXPECT_EQ(fused.layers.back().mlp, Reduce::kDeferred);
  EXPECT_TRUE(fused.layers.back().stage_end);  // the model's last layer ends the last stage, yet may defer
  EXPECT_TRUE(fused.final_norm_fused);

  const FusionPlan off = plan_for(2, kAllreduceFusionOff);
  EXPECT_FALSE(off.final_norm_fused);
  EXPECT_FALSE(off.final_norm_reason.empty());

  ModelConfig config = preset_config("tiny");
  ParallelLayout layout;
  layout.tp = 2;
  layout.sequence_parallel = true;
  const FusionPlan sp = plan_for(config, layout);
  EXPECT_EQ(sp.layers.back().mlp, Reduce::kImmediate);
  EXPECT_FALSE(sp.final_norm_fused);
  EXPECT_NO_THROW(check_plan_consistent(sp));
}

TEST(FusionPlan, FusionOffReducesEverythingImmediately) {
  const FusionPlan plan = plan_for(4, kAllreduceFusionOff);
  for (const LayerPlan& lp : plan.layers) {
    EXPECT_EQ(lp.attention, Reduce::kImmediate);
    EXPECT_EQ(lp.mlp, Reduce::kImmediate);
    EXPECT_FALSE(lp.fuse_input_allreduce);
    EXPECT_TRUE(contains(lp.mlp_reason, "off")) << lp.mlp_reason;
  }
  EXPECT_NO_THROW(check_plan_consistent(plan));
}

// An expert-parallel MoE's combine already reduced its output; only the dense layer may still defer.
TEST(FusionPlan, ExpertParallelForcesImmediateMoeReduction) {
  ParallelLayout layout;
  layout.tp = 2;
  layout.expert_parallel = true;
  const FusionPlan plan = plan_for(preset_config("tiny"), layout);
  EXPECT_EQ(plan.layers[0].mlp, Reduce::kDeferred);  // dense
  for (int l = 1; l < 4; ++l) {
    EXPECT_EQ(plan.layers[l].mlp, Reduce::kImmediate) << "layer " << l;
    EXPECT_TRUE(contains(plan.layers[l].mlp_reason, "expert-parallel")) << plan.layers[l].mlp_reason;
  }
  EXPECT_NO_THROW(check_plan_consistent(plan));
}

TEST(FusionPlan, SequenceParallelForcesImmediateReduction) {
  ParallelLayout layout;
  layout.tp = 2;
  layout.sequence_parallel = true;
  const FusionPlan plan = plan_for(preset_config("tiny"), layout);
  for (const LayerPlan& lp : plan.layers) {
    EXPECT_EQ(lp.mlp, Reduce::kImmediate);
    EXPECT_TRUE(contains(lp.mlp_reason, "sequence-parallel")) << lp.mlp_reason;
    EXPECT_FALSE(lp.fuse_input_allreduce);
  }
}

// Seed 2: the shared expert becomes routed row E, so everything binned by expert is sized E + n.
TEST(FusionPlan, SharedExpertFusedAddsPhysicalRows) {
  const ModelConfig tiny = preset_config("tiny");
  const FusionPlan plan = plan_for(2);
  EXPECT_TRUE(plan.shared_expert.fused);
  EXPECT_EQ(plan.shared_expert.physical_rows, tiny.num_experts + 1);

  ModelConfig two = tiny;
  two.num_shared_experts = 2;
  const FusionPlan plan2 = plan_for(2, {}, {}, two);
  EXPECT_TRUE(plan2.shared_expert.fused);
  EXPECT_EQ(plan2.shared_expert.physical_rows, tiny.num_experts + 2);
}

// Fused rows ride as slots up to a step size (the measured default, or the option), and above it
// run as the shared MLP; 0 keeps every step fused. Unfused or refused plans never append slots.
TEST(FusionPlan, SharedSlotsUpToTheMaxFusedTokens) {
  const SharedExpertPlan fused = plan_for(2).shared_expert;
  EXPECT_EQ(fused.max_fused_tokens, kSharedExpertMaxFusedTokens);
  EXPECT_TRUE(fused.slots_at(1));
  EXPECT_TRUE(fused.slots_at(kSharedExpertMaxFusedTokens));
  EXPECT_FALSE(fused.slots_at(kSharedExpertMaxFusedTokens + 1));
  EXPECT_TRUE(contains(fused.reason, fmt::format("up to {} tokens", kSharedExpertMaxFusedTokens))) << fused.reason;

  const SharedExpertPlan four = plan_for(2, {.shared_expert_max_fused_tokens = 4}).shared_expert;
  EXPECT_TRUE(four.slots_at(4));
  EXPECT_FALSE(four.slots_at(5));
  const SharedExpertPlan always = plan_for(2, {.shared_expert_max_fused_tokens = 0}).shared_expert;
  EXPECT_TRUE(always.slots_at(1 << 20));
  EXPECT_TRUE(contains(always.reason, "every step")) << always.reason;
  EXPECT_FALSE(plan_for(2, kSharedFusionOff).shared_expert.slots_at(1));

  // MXFP8 experts: fused in every step by default (measured faster there), a limit when asked.
  ModelConfig mx = preset_config("tiny");
  mx.quantization.method = QuantMethod::kMxfp8;
  EXPECT_EQ(plan_for(2, {}, {}, mx).shared_expert.max_fused_tokens, 0);
  EXPECT_EQ(plan_for(2, {.shared_expert_max_fused_tokens = 8}, {}, mx).shared_expert.max_fused_tokens, 8);
}

// Each refusal keeps physical_rows == E (nothing extra to bin) and says why.
TEST(FusionPlan, SharedExpertFusionRefusedWithReason) {
  const ModelConfig tiny = preset_config("tiny");
  auto expect_refused = [&](const FusionPlan& plan, const std::string& why) {
    EXPECT_FALSE(plan.shared_expert.fused) << why;
    EXPECT_EQ(plan.shared_expert.physical_rows, tiny.num_experts) << why;
    EXPECT_TRUE(contains(plan.shared_expert.reason, why)) << plan.shared_expert.reason;
  };

  ModelConfig wide = tiny;
  wide.shared_intermediate_size = 2 * tiny.moe_intermediate_size;
  expect_refused(plan_for(2, {}, {}, wide), "shared_intermediate_size");

  ParallelLayout tp2;
  tp2.tp = 2;
  expect_refused(plan_for(tiny, tp2, /*shared_format_matches=*/false), "format");

  ParallelLayout ep = tp2;
  ep.expert_parallel = true;
  expect_refused(plan_for(tiny, ep), "expert parallel");

  expect_refused(plan_for(2, kSharedFusionOff), "turned off");
}

// A deferred partial with no consumer is silent garbage; the checker is the last line of defence.
TEST(FusionPlan, ConsistencyCheckCatchesHandBrokenPlans) {
  FusionPlan missing_consumer = plan_for(2);
  missing_consumer.layers[2].fuse_input_allreduce = false;
  expect_error([&] { check_plan_consistent(missing_consumer); }, {"layer 1", "layer 2"});

  FusionPlan double_reduce = plan_for(2, kAllreduceFusionOff);
  double_reduce.layers[2].fuse_input_allreduce = true;
  expect_error([&] { check_plan_consistent(double_reduce); }, {"layer 1", "layer 2"});

  FusionPlan final_unconsumed = plan_for(2);
  final_unconsumed.final_norm_fused = false;
  expect_error([&] { check_plan_consistent(final_unconsumed); }, {"layer 3", "final norm"});

  FusionPlan tp1_reduces = plan_for(1);
  tp1_reduces.layers[0].attention = Reduce::kImmediate;
  expect_error([&] { check_plan_consistent(tp1_reduces); }, {"tp=1", "layer 0"});
}

// `tpmoe inspect` prints this: every layer, the shared-expert decision and the final norm must show.
TEST(FusionPlan, ToStringShowsEveryLayer) {
  const FusionPlan plan = plan_for(2, {}, {1});
  const std::string s = plan.to_string();
  for (size_t l = 0; l < plan.layers.size(); ++l)
    EXPECT_TRUE(contains(s, fmt::format("\n  {:>5}  ", l))) << "layer " << l << " missing from:\n" << s;
  EXPECT_TRUE(contains(s, "tp=2")) << s;
  EXPECT_TRUE(contains(s, plan.shared_expert.reason)) << s;
  EXPECT_TRUE(contains(s, "[stage end]")) << s;
  EXPECT_TRUE(contains(s, "allreduce+norm")) << s;
  EXPECT_TRUE(contains(s, "final norm")) << s;
}

// ---- ParallelLayout::validate: each refusal names the thing the user has to change ----

void expect_layout_error(const ParallelLayout& layout, const ModelConfig& config,
                         std::initializer_list<std::string> needles) {
  expect_error([&] { layout.validate(config); }, needles);
}

ParallelLayout tp_layout(int tp, std::vector<int> stage_ends = {}) {
  ParallelLayout layout;
  layout.tp = tp;
  layout.pp_stage_ends = std::move(stage_ends);
  return layout;
}

TEST(ParallelLayoutValidate, AcceptsSplitAndReplicatedKv) {
  const ModelConfig tiny = preset_config("tiny");
  for (int tp : {1, 2, 4, 8}) EXPECT_NO_THROW(tp_layout(tp).validate(tiny)) << "tp " << tp;  // tp 8 replicates KV
  EXPECT_NO_THROW(tp_layout(2, {0, 2}).validate(tiny));
}

TEST(ParallelLayoutValidate, TpMustDivideHeads) {
  expect_layout_error(tp_layout(3), preset_config("tiny"), {"--tp 3", "num_attention_heads"});
}

TEST(ParallelLayoutValidate, TpAndKvHeadsMustNest) {
  ModelConfig c = preset_config("tiny");
  c.num_heads = 12;  // tp 2 divides 12, but neither of tp 2 and 3 KV heads divides the other
  c.num_kv_heads = c.index_n_heads = 3;
  c.validate("12 heads, 3 kv heads");
  expect_layout_error(tp_layout(2), c, {"--tp 2", "num_key_value_heads 3"});
}

TEST(ParallelLayoutValidate, TpMustDivideIntermediateSizes) {
  const ModelConfig tiny = preset_config("tiny");
  ModelConfig routed = tiny;
  routed.moe_intermediate_size = 66;  // divisible by 2, not 4
  routed.shared_intermediate_size = 64;
  expect_layout_error(tp_layout(4), routed, {"--tp 4", "does not divide intermediate_size 66"});

  ModelConfig shared = tiny;
  shared.shared_intermediate_size = 68;  // divisible by 4, not 8
  expect_layout_error(tp_layout(8), shared, {"--tp 8", "shared_intermediate_size 68"});

  ModelConfig dense = tiny;
  dense.dense_intermediate_size = 190;
  expect_layout_error(tp_layout(4), dense, {"--tp 4", "dense_intermediate_size 190"});
}

TEST(ParallelLayoutValidate, StageListMustBeAscendingLayerIndices) {
  const ModelConfig tiny = preset_config("tiny");
  expect_layout_error(tp_layout(2, {4}), tiny, {"--pp-stages", "4", "4 layers"});
  expect_layout_error(tp_layout(2, {-1}), tiny, {"--pp-stages", "-1"});
  expect_layout_error(tp_layout(2, {2, 1}), tiny, {"--pp-stages", "ascending"});
  expect_layout_error(tp_layout(2, {1, 1}), tiny, {"--pp-stages", "ascending"});
}

}  // namespace
}  // namespace tpmoe
