// Batching must be invisible: sequences of different lengths share one prefill and one decode step
// (one token each), yet each must get exactly what it gets alone. A wrong position, cache slot,
// causal mask or block anchor for one sequence would show up as that sequence's logits moving.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "model/config.h"
#include "model/presets.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

// The batched and single runs do the same per-token fp32 math; only the summation order inside a
// multi-threaded kernel may differ with the number of rows, so they agree to float rounding.
constexpr double kBatchTolerance = 1e-5;
constexpr int kNewTokens = 6;
// Both models use blocks of 8 keys with 2 kept: the 27-token prompt (4 blocks) makes block selection
// drop keys, the 5- and 11-token ones keep every block; decode steps add keys to all three.
const std::vector<int> kPromptLengths = {5, 27, 11};

std::vector<std::vector<int32_t>> make_prompts(int vocab) {
  std::vector<std::vector<int32_t>> prompts;
  for (size_t b = 0; b < kPromptLengths.size(); ++b) {
    std::vector<int32_t> p;
    for (int i = 0; i < kPromptLengths[b]; ++i) p.push_back(int32_t(1 + (int(b) * 97 + i * 41 + i * i) % (vocab - 1)));
    prompts.push_back(p);
  }
  return prompts;
}

std::vector<std::vector<int32_t>> make_forced(int vocab) {
  std::vector<std::vector<int32_t>> forced;
  for (size_t b = 0; b < kPromptLengths.size(); ++b) {
    std::vector<int32_t> f;
    for (int i = 0; i < kNewTokens - 1; ++i) f.push_back(int32_t(1 + (int(b) * 13 + i * 71) % (vocab - 1)));
    forced.push_back(f);
  }
  return forced;
}

// Sequence b's logits of every step, out of a result whose steps are [b * V] rows.
std::vector<float> step_logits_of(const GenerateResult& r, size_t b) {
  std::vector<float> out;
  const auto V = size_t(r.vocab_size);
  for (const auto& step : r.step_logits) out.insert(out.end(), step.begin() + b * V, step.begin() + (b + 1) * V);
  return out;
}

// Runs all prompts as one batch, then each alone, greedy and teacher-forced, and compares.
void expect_batch_equals_singles(Engine& engine, int vocab) {
  const auto prompts = make_prompts(vocab);
  for (bool forced : {false, true}) {
    GenerateRequest batch;
    batch.prompts = prompts;
    batch.max_new_tokens = kNewTokens;
    batch.return_prefill_logits = true;
    if (forced) batch.forced_tokens = make_forced(vocab);
    const GenerateResult together = engine.generate(batch);
    ASSERT_EQ(together.generated.size(), prompts.size());
    for (size_t b = 0; b < prompts.size(); ++b) {
      SCOPED_TRACE(
          fmt::format("{}, sequence {} ({} tokens)", forced ? "teacher-forced" : "greedy", b, prompts[b].size()));
      GenerateRequest one = batch;
      one.prompts = {prompts[b]};
      if (forced) one.forced_tokens = {batch.forced_tokens[b]};
      const GenerateResult alone = engine.generate(one);
      EXPECT_LT(test::relative_l2(step_logits_of(together, b), step_logits_of(alone, 0)), kBatchTolerance);
      EXPECT_LT(test::relative_l2(together.prefill_logits[b], alone.prefill_logits[0]), kBatchTolerance);
      EXPECT_EQ(together.generated[b], alone.generated[0]);
    }
  }
}

EngineOptions with_tp(int tp) {
  EngineOptions o;
  o.tp = tp;
  return o;
}

class Batch : public ::testing::TestWithParam<int> {};  // the tp size

TEST_P(Batch, FixtureSequencesMatchTheirSingleRuns) {
  const auto dir = test::fixtures_dir() / "m3-tiny";
  auto engine = Engine::from_checkpoint(dir, with_tp(GetParam()));
  expect_batch_equals_singles(*engine, ModelConfig::from_file(dir / "config.json").vocab_size);
}

TEST_P(Batch, TinyPresetSequencesMatchTheirSingleRuns) {
  auto engine = Engine::from_preset("tiny", std::nullopt, 77, with_tp(GetParam()));
  expect_batch_equals_singles(*engine, preset_config("tiny").vocab_size);
}

INSTANTIATE_TEST_SUITE_P(Tp, Batch, ::testing::Values(1, 2),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
}  // namespace tpmoe
