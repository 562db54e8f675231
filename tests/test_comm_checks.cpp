// Rank-consistency checks of a tensor-parallel group (model/rank_checks.h), without a GPU: ranks
// that disagree on the TP size, the model or the fusion plan, a rank without a GPU, too few GPUs
// for --tp in one process. Each failure must name what differs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "model/presets.h"
#include "model/rank_checks.h"

namespace tpmoe {
namespace {

FusionPlan plan_for(const ModelConfig& c, int tp, bool allreduce_fusion = true) {
  ParallelLayout layout;
  layout.tp = tp;
  return build_fusion_plan(c, layout, {allreduce_fusion, true});
}

std::vector<RankFingerprint> group(const ModelConfig& c, int tp) {
  std::vector<RankFingerprint> all;
  for (int r = 0; r < tp; ++r) all.push_back(make_fingerprint(c, plan_for(c, tp), r, tp, tp, r, tp));
  return all;
}

std::string error_of(const std::vector<RankFingerprint>& all) {
  try {
    check_fingerprints(all);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CommChecks, AgreeingRanksPass) {
  const ModelConfig c = preset_config("tiny");
  EXPECT_NO_THROW(check_fingerprints(group(c, 2)));
  EXPECT_NO_THROW(check_fingerprints(group(c, 1)));
}

TEST(CommChecks, FingerprintIsDeterministicAndSensitive) {
  const ModelConfig c = preset_config("tiny");
  const auto a = make_fingerprint(c, plan_for(c, 2), 0, 2, 2, 0, 2);
  const auto b = make_fingerprint(c, plan_for(c, 2), 0, 2, 2, 0, 2);
  EXPECT_EQ(a.config_hash, b.config_hash);
  EXPECT_EQ(a.plan_hash, b.plan_hash);
  ModelConfig other = c;
  other.rms_norm_eps = 1e-5f;  // a field the short summary does not show still changes the hash
  EXPECT_NE(make_fingerprint(other, plan_for(other, 2), 0, 2, 2, 0, 2).config_hash, a.config_hash);
}

TEST(CommChecks, DifferentTpSizeIsNamed) {
  const ModelConfig c = preset_config("tiny");
  auto all = group(c, 2);
  all[1].tp = 4;
  const std::string e = error_of(all);
  EXPECT_TRUE(contains(e, "tensor-parallel size")) << e;
  EXPECT_TRUE(contains(e, "rank 1 has --tp 4")) << e;
}

TEST(CommChecks, DifferentModelIsNamed) {
  const ModelConfig c = preset_config("tiny");
  ModelConfig bigger = preset_config("tiny", 3);
  auto all = group(c, 2);
  all[1] = make_fingerprint(bigger, plan_for(bigger, 2), 1, 2, 2, 1, 2);
  const std::string e = error_of(all);
  EXPECT_TRUE(contains(e, "disagree on the model")) << e;
  EXPECT_TRUE(contains(e, "rank 1 loaded")) << e;
  EXPECT_TRUE(contains(e, "3 layers")) << e;
}

TEST(CommChecks, DifferentPlanIsNamed) {
  const ModelConfig c = preset_config("tiny");
  auto all = group(c, 2);
  all[1] = make_fingerprint(c, plan_for(c, 2, /*allreduce_fusion=*/false), 1, 2, 2, 1, 2);
  const std::string e = error_of(all);
  EXPECT_TRUE(contains(e, "fusion plan")) << e;
  EXPECT_TRUE(contains(e, "--allreduce-fusion")) << e;
}

TEST(CommChecks, WrongNumberOfProcessesIsNamed) {
  const ModelConfig c = preset_config("tiny");
  std::vector<RankFingerprint> all;
  for (int r = 0; r < 2; ++r) all.push_back(make_fingerprint(c, plan_for(c, 4), r, 4, 2, r, 2));
  const std::string e = error_of(all);
  EXPECT_TRUE(contains(e, "--tp 4 but 2 rank(s) were launched")) << e;
}

TEST(CommChecks, MissingGpuIsNamedFirst) {
  const ModelConfig c = preset_config("tiny");
  auto all = group(c, 4);
  for (auto& f : all) f.visible_gpus = 2;  // 4 processes on a host with 2 GPUs
  all[3].tp = 8;                           // a later disagreement is not what gets reported
  const std::string e = error_of(all);
  EXPECT_TRUE(contains(e, "rank 2")) << e;
  EXPECT_TRUE(contains(e, "needs GPU 2")) << e;
  EXPECT_TRUE(contains(e, "sees 2 GPU(s)")) << e;
}

TEST(CommChecks, OtherBuildIsNamed) {
  const ModelConfig c = preset_config("tiny");
  auto all = group(c, 2);
  all[1].magic = 0;
  EXPECT_TRUE(contains(error_of(all), "rank 1 runs a different tpmoe build"));
}

TEST(CommChecks, TooFewGpusForTp) {
  // The visible count is passed in: this runs on machines without a GPU.
  EXPECT_NO_THROW(check_gpus_for_tp(2, 2));
  EXPECT_NO_THROW(check_gpus_for_tp(1, 8));
  try {
    check_gpus_for_tp(4, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "--tp 4 needs 4 GPUs")) << e.what();
    EXPECT_TRUE(contains(e.what(), "2 are visible")) << e.what();
  }
  try {
    check_gpus_for_tp(1, 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "no CUDA GPU is visible")) << e.what();
  }
}

}  // namespace
}  // namespace tpmoe
