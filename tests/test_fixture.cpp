// The fixture m3-tiny: logits computed by the public reference implementation (transformers, fp32
// on the bf16 weights). tpmoe's CPU oracle must reproduce them, in both checkpoint layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "oracle_margins.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

// fp32 CPU math against an fp32 reference on the same bf16 weights: only summation order differs.
constexpr double kFixtureTolerance = 1e-4;

GenerateResult run_teacher_forced(const std::filesystem::path& dir, const test::FixtureReference& ref,
                                  EngineOptions options = {}) {
  return Engine::from_checkpoint(dir, options)->generate(test::teacher_forced_request(ref));
}

void expect_matches_reference(const GenerateResult& r, const test::FixtureReference& ref) {
  const double prefill_err = test::relative_l2(test::concat(r.prefill_logits), ref.prefill_logits);
  const double step_err = test::relative_l2(test::concat(r.step_logits), ref.step_logits);
  ::testing::Test::RecordProperty("prefill_rel_l2", std::to_string(prefill_err));
  ::testing::Test::RecordProperty("step_rel_l2", std::to_string(step_err));
  std::printf("relative L2 vs reference: prefill %.3g, steps %.3g\n", prefill_err, step_err);
  EXPECT_LT(prefill_err, kFixtureTolerance);
  EXPECT_LT(step_err, kFixtureTolerance);
  EXPECT_EQ(r.generated, ref.generated);
}

TEST(Fixture, LayoutAMatchesReference) {
  const test::FixtureReference ref = test::load_fixture_reference();
  expect_matches_reference(run_teacher_forced(test::fixtures_dir() / "m3-tiny", ref), ref);
}

TEST(Fixture, GreedyGenerationMatchesReferenceIds) {
  const test::FixtureReference ref = test::load_fixture_reference();
  auto engine = Engine::from_checkpoint(test::fixtures_dir() / "m3-tiny", {});
  GenerateRequest req;
  req.prompts = ref.prompts;
  req.max_new_tokens = int(ref.G);
  EXPECT_EQ(engine->generate(req).generated, ref.generated);
}

TEST(Fixture, LayoutBShardedLegacyConfigMatchesReference) {
  // Rewrite the fixture as the original hub files: per-expert tensors, language_model. prefix, two
  // shards with an index, config under text_config with the legacy keys.
  const auto src = io::SafetensorsSet::open_file(test::fixtures_dir() / "m3-tiny" / "model.safetensors");
  std::map<std::string, io::OwnedTensor> tensors;
  for (const auto& name : src.names()) tensors[name] = io::OwnedTensor::copy_of(*src.find(name));
  const ModelConfig config = ModelConfig::from_file(test::fixtures_dir() / "m3-tiny" / "config.json");
  const auto dir = test::make_temp_dir("layout-b");
  io::write_checkpoint(dir, config, tensors, io::CheckpointLayout::kHub, 2);
  ASSERT_TRUE(std::filesystem::exists(dir / "model.safetensors.index.json"));
  ASSERT_TRUE(std::filesystem::exists(dir / "model-00002-of-00002.safetensors"));
  const auto ckpt = io::Checkpoint::open(dir);
  EXPECT_EQ(ckpt.layout(), io::CheckpointLayout::kHub);

  const test::FixtureReference ref = test::load_fixture_reference();
  expect_matches_reference(run_teacher_forced(dir, ref), ref);
  std::filesystem::remove_all(dir);
}

// The table the GPU fixture test prints, for the CPU oracle: per row its smallest decision margin,
// its error and reference_bf16's against the fp32 reference, the bound and whether it is exempt. The
// fp32 oracle must pass the bf16 yardstick everywhere with room to spare, and the rows where
// reference_bf16 itself took the other branch must be among the rows the oracle's margins exempt:
// otherwise the exemption threshold misses the near-ties a bf16 path really flips.
TEST(Fixture, OracleAgainstTheBf16Yardstick) {
  const test::FixtureReference ref = test::load_fixture_reference();
  const test::FixtureYardstick yard = test::load_fixture_yardstick();
  const test::OracleRun oracle = test::run_fixture_oracle(ref);
  const test::FixtureRows rows = test::fixture_logit_rows(ref, oracle.decisions);
  test::print_exempt_rows(rows);
  // reference_bf16 flipped a choice on a row when its error there is this far over its median row
  // (a flip moves a row by ~0.2 on the fixture; rounding alone leaves ~0.01).
  constexpr double kFlipOverMedian = 8.0;
  for (const bool steps : {false, true}) {
    const std::vector<float> got = test::concat(steps ? oracle.result.step_logits : oracle.result.prefill_logits);
    const std::vector<test::LogitRow>& labels = steps ? rows.steps : rows.prefill;
    const test::YardstickResult j =
        test::judge_against_yardstick(got, steps ? ref.step_logits : ref.prefill_logits,
                                      steps ? yard.step_logits : yard.prefill_logits, size_t(ref.V), labels);
    std::printf("CPU oracle (fp32), %s against the fp32 reference:\n%s", steps ? "decode steps" : "prefill",
                j.table.c_str());
    EXPECT_TRUE(j.ok());
    for (const std::string& f : j.failures) ADD_FAILURE() << f;
    for (size_t r = 0; r < labels.size(); ++r) EXPECT_LT(j.error[r], kFixtureTolerance) << labels[r].label;
    std::vector<double> sorted = j.yardstick_error;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[sorted.size() / 2];
    for (size_t r = 0; r < labels.size(); ++r) {
      if (j.yardstick_error[r] <= kFlipOverMedian * median) continue;
      EXPECT_TRUE(labels[r].exempt) << labels[r].label << ": reference_bf16 is " << j.yardstick_error[r]
                                    << " off there (median row " << median
                                    << "), a flipped choice, but the oracle's margin there is " << labels[r].margin;
    }
  }
}

// The yardstick rule can fail: a non-exempt row pushed past slack x reference_bf16 + floor fails (and
// with it the overall figure), an exempt row may move by a flip's worth but not past the exempt limit,
// and a NaN fails anywhere.
TEST(Fixture, YardstickRuleRejectsWhatItShould) {
  const test::FixtureReference ref = test::load_fixture_reference();
  const test::FixtureYardstick yard = test::load_fixture_yardstick();
  const size_t V = size_t(ref.V), rows = size_t(ref.B * ref.P);
  std::vector<test::LogitRow> labels(rows);
  for (size_t r = 0; r < rows; ++r) labels[r].label = "row " + std::to_string(r);
  labels[16].exempt = true;
  const test::YardstickRule rule;
  // Every row moved by exactly its bound's worth times `factor` (row 16 by `exempt_move`).
  auto moved = [&](double factor, double exempt_move) {
    std::vector<float> got = ref.prefill_logits;
    for (size_t r = 0; r < rows; ++r) {
      const auto row = std::span(ref.prefill_logits).subspan(r * V, V);
      const double bound =
          labels[r].exempt ? exempt_move
                           : factor * (rule.per_row_slack *
                                           test::relative_l2(std::span(yard.prefill_logits).subspan(r * V, V), row) +
                                       rule.per_row_floor);
      for (size_t v = 0; v < V; ++v) got[r * V + v] = float(row[v] * (1.0 + bound));  // relative L2 = bound
    }
    return got;
  };
  const auto judge = [&](const std::vector<float>& got) {
    return test::judge_against_yardstick(got, ref.prefill_logits, yard.prefill_logits, V, labels, rule);
  };
  EXPECT_TRUE(judge(ref.prefill_logits).ok());
  // Just inside every row's bound: only the overall figure fails (every row near 2x reference_bf16 +
  // floor is over 1.5x reference_bf16 together).
  const test::YardstickResult inside = judge(moved(0.99, 0.3));
  ASSERT_EQ(inside.failures.size(), 1u) << inside.table;
  EXPECT_NE(inside.failures.front().find("together"), std::string::npos) << inside.failures.front();
  const test::YardstickResult outside = judge(moved(1.05, 0.6));
  EXPECT_EQ(outside.failures.size(), rows + 1) << "every row and the overall figure";
  std::vector<float> nan_row = ref.prefill_logits;
  nan_row[16 * V + 3] = std::nanf("");
  EXPECT_FALSE(judge(nan_row).ok()) << "a NaN in an exempt row";
}

}  // namespace
}  // namespace tpmoe
