// The CPU oracle's decision-margin recorder: the margins of hand-made router and indexer choices are
// the ones worked out by hand, and on the fixture the recorder leaves the logits bitwise unchanged
// and reports a finite positive margin for every row (the smallest ones are printed, so they can be
// compared with the figures the fixture's exemptions rest on).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/decision_margins.h"
#include "oracle_margins.h"
#include "test_util.h"

namespace tpmoe {
namespace {

using cpu::DecisionKind;

// The margin a hand computation gives, up to fp32 rounding of the inputs.
constexpr double kHandTolerance = 1e-6;

TEST(DecisionMargins, TopKBoundaryByHand) {
  const std::vector<float> v{0.5f, 0.9f, 0.1f, 0.8f};
  const auto b = cpu::top_k_boundary(v, 2);  // keeps 0.9 and 0.8, drops 0.5 first
  ASSERT_TRUE(b);
  EXPECT_EQ(b->kept, 0.8f);
  EXPECT_EQ(b->dropped, 0.5f);
  EXPECT_NEAR(b->relative, 0.3 / 0.8, kHandTolerance);
  EXPECT_FALSE(cpu::top_k_boundary(v, 4)) << "nothing dropped: no boundary";
  EXPECT_FALSE(cpu::top_k_boundary(v, 0)) << "nothing chosen: no boundary";
  // A tie is a margin of exactly 0; negative values are measured against their magnitude; a kept
  // value of exactly 0 falls back to the dropped one's magnitude.
  EXPECT_EQ(cpu::top_k_boundary(std::vector<float>{1.f, 2.f, 1.f}, 2)->relative, 0.0);
  EXPECT_NEAR(cpu::top_k_boundary(std::vector<float>{-2.f, -1.f}, 1)->relative, 1.0, kHandTolerance);
  EXPECT_NEAR(cpu::top_k_boundary(std::vector<float>{0.f, 1.f, -0.5f}, 2)->relative, 1.0, kHandTolerance);
}

TEST(DecisionMargins, IndexerBoundaryByHand) {
  // Query at position 21, blocks of 8: block 0 = keys 0-7 (max 5), block 1 = keys 8-15 (max 4),
  // block 2 = keys 16-21 (the local block, forced to +inf whatever its scores).
  std::vector<float> scores(22, 0.f);
  scores[3] = 5.f;
  scores[12] = 4.f;
  scores[17] = 100.f;
  const auto blocks = cpu::indexer_block_scores(scores.data(), 21, 8, 1);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(blocks[0], 5.f);
  EXPECT_EQ(blocks[1], 4.f);
  EXPECT_TRUE(std::isinf(blocks[2]) && blocks[2] > 0);
  // Two kept: the local block and one of the two finite ones; the choice is 5 over 4.
  const auto b = cpu::indexer_block_boundary(blocks, 2);
  ASSERT_TRUE(b);
  EXPECT_EQ(b->kept, 5.f);
  EXPECT_EQ(b->dropped, 4.f);
  EXPECT_NEAR(b->relative, 0.2, kHandTolerance);
  EXPECT_EQ(cpu::select_blocks(scores.data(), 21, 8, 2, 1), (std::vector<int>{2, 0}));
  EXPECT_FALSE(cpu::indexer_block_boundary(blocks, 3)) << "every block kept: no boundary";
  // Two local blocks fill both slots: the forced blocks are not a choice, so no boundary.
  EXPECT_FALSE(cpu::indexer_block_boundary(cpu::indexer_block_scores(scores.data(), 21, 8, 2), 2));
}

// The hooks inside CpuOps: a tiny sparse attention step and a routing step, their margins worked
// out by hand from the index scores and router choices fed in.
TEST(DecisionMargins, CpuOpsRecordsWhatTheOpsDecide) {
  cpu::CpuOps ops;
  cpu::DecisionRecorder recorder;
  ops.set_decision_recorder(&recorder);
  CacheShape cache;
  cache.num_layers = 2;
  cache.sparse_layer = {false, true};
  cache.num_kv_heads = 1;
  cache.head_dim = 2;
  cache.index_head_dim = 2;
  cache.max_seqs = 1;
  cache.max_len = 8;
  cache.num_pages = 1;
  ops.init_cache(cache);
  StepTokens step;
  for (int t = 0; t < 6; ++t) {
    step.token_ids.push_back(0);
    step.positions.push_back(t);
    step.seq_slots.push_back(0);
  }
  ops.begin_step(step);
  const int T = 6;
  Tensor q = ops.alloc(T, 2), k = ops.alloc(T, 2), v = ops.alloc(T, 2), iq = ops.alloc(T, 2), ik = ops.alloc(T, 2);
  Tensor out = ops.alloc(T, 2);
  for (int t = 0; t < T; ++t) {
    for (Tensor x : {q, k, v}) x.as<float>()[2 * t] = 1.f, x.as<float>()[2 * t + 1] = float(t);
    iq.as<float>()[2 * t] = 1.f, iq.as<float>()[2 * t + 1] = 0.f;  // reads the first channel of the keys
  }
  iq.as<float>()[2 * 4] = 0.f, iq.as<float>()[2 * 4 + 1] = 1.f;  // position 4 reads the second channel
  // Index keys (first, second channel) of positions 0..5.
  const float index_keys[6][2] = {{3.f, 1.f}, {1.f, 4.f}, {2.f, 2.f}, {2.5f, 3.f}, {0.f, 0.f}, {0.f, 0.f}};
  std::memcpy(ik.data, index_keys, sizeof index_keys);
  AttentionParams p;
  p.layer = 1;
  p.num_q_heads = 1;
  p.num_kv_heads = 1;
  p.head_dim = 2;
  p.scale = 1.f;
  p.num_index_heads = 1;
  p.index_head_dim = 2;
  p.block_size = 2;
  p.topk_blocks = 2;
  p.local_blocks = 1;
  ops.attention(q, k, v, iq, ik, p, out);
  // Blocks of 2: positions 0-3 see at most two blocks (all kept); positions 4 and 5 see three, the
  // last one local, so one of blocks {0, 1} is kept. Position 5 reads channel 0: block 0 max 3,
  // block 1 max 2.5, margin 0.5/3. Position 4 reads channel 1: block 0 max 4, block 1 max 3, 1/4.
  // Router of layer 1: scores sigmoid(0) = 0.5 plus the bias choose;
  // choices 0.8, 0.6, 0.7, 0.5 keep 0.8 and 0.7 over 0.6, margin 0.1/0.7 on every token.
  Tensor logits = ops.alloc_typed(T, 4, DType::kF32), bias = ops.alloc_typed(1, 4, DType::kF32);
  std::fill_n(logits.as<float>(), T * 4, 0.f);
  const float bias_values[4] = {0.3f, 0.1f, 0.2f, 0.f};
  std::memcpy(bias.data, bias_values, sizeof bias_values);
  RouterParams rp;
  rp.layer = 1;
  rp.num_experts = 4;
  rp.top_k = 2;
  Tensor ids = ops.alloc_typed(T, 2, DType::kI32), weights = ops.alloc_typed(T, 2, DType::kF32);
  ops.route(logits, bias, rp, ids, weights);

  ASSERT_EQ(recorder.steps().size(), 1u);
  const auto& rows = recorder.steps()[0];
  ASSERT_EQ(rows.size(), size_t(T));
  for (int t = 0; t < T; ++t) {
    EXPECT_EQ(rows[t].position, t);
    int routers = 0, indexers = 0;
    for (const cpu::Decision& d : rows[t].decisions) {
      EXPECT_EQ(d.layer, 1) << d.describe();
      if (d.kind == DecisionKind::kRouterTopK) {
        ++routers;
        EXPECT_NEAR(d.boundary.relative, 0.1 / 0.7, kHandTolerance) << "position " << t;
      } else {
        ++indexers;
        EXPECT_EQ(d.head, 0);
        EXPECT_NEAR(d.boundary.relative, t == 5 ? 0.5 / 3.0 : 1.0 / 4.0, kHandTolerance) << "position " << t;
      }
    }
    EXPECT_EQ(routers, 1) << "position " << t;
    EXPECT_EQ(indexers, t >= 4 ? 1 : 0) << "position " << t;
  }
  EXPECT_NEAR(rows[5].smallest()->boundary.relative, 0.1 / 0.7, kHandTolerance);
  EXPECT_EQ(recorder.find(0, 4), &rows[4]);
  EXPECT_EQ(recorder.find(0, 7), nullptr);
}

TEST(DecisionMargins, RecordingAFixtureRunChangesNoLogit) {
  const test::FixtureReference ref = test::load_fixture_reference();
  const GenerateRequest req = test::teacher_forced_request(ref);
  const test::OracleRun plain = test::run_cpu_oracle(test::fixtures_dir() / "m3-tiny", req, false);
  const test::OracleRun recorded = test::run_cpu_oracle(test::fixtures_dir() / "m3-tiny", req, true);
  EXPECT_TRUE(plain.decisions.steps().empty());
  const auto a = test::concat(plain.result.prefill_logits), b = test::concat(recorded.result.prefill_logits);
  const auto sa = test::concat(plain.result.step_logits), sb = test::concat(recorded.result.step_logits);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(sa.size(), sb.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "prefill logits differ";
  EXPECT_EQ(std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)), 0) << "step logits differ";
  EXPECT_EQ(plain.result.generated, recorded.result.generated);
  // One step for the prefill, one per further token.
  EXPECT_EQ(recorded.decisions.steps().size(), size_t(ref.G));
}

TEST(DecisionMargins, FixtureMarginsAreFinitePositiveAndPrinted) {
  const test::FixtureReference ref = test::load_fixture_reference();
  const test::OracleRun run = test::run_fixture_oracle(ref);
  const ModelConfig config = ModelConfig::from_file(test::fixtures_dir() / "m3-tiny" / "config.json");
  int moe_layers = 0, sparse_layers = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    moe_layers += config.mlp_layer_types[l] == MlpType::kMoe;
    sparse_layers += config.layer_types[l] == AttentionType::kSparse;
  }
  // Every (sequence, position) the fixture's logits come from, with what the oracle decided there.
  std::vector<std::pair<std::string, const cpu::TokenDecisions*>> rows;
  for (int b = 0; b < int(ref.B); ++b) {
    const int P = int(ref.prompts[b].size());
    for (int pos = 0; pos < P + int(ref.G) - 1; ++pos)
      rows.push_back({pos < P ? fmt::format("prefill {}", pos) : fmt::format("step {} (pos {})", pos - P + 1, pos),
                      run.decisions.find(b, pos)});
  }
  std::vector<std::pair<double, std::string>> all;  // every decision on the fixture, for the smallest overall
  std::printf("Oracle decision margins on the fixture, the three smallest per row:\n");
  for (const auto& [label, row] : rows) {
    ASSERT_NE(row, nullptr) << label << ": the recorder saw no such row";
    // Each MoE layer's router decides on every row; each sparse layer's index heads decide once a
    // row sees more blocks than it keeps (beyond topk_blocks * block_size keys).
    int routers = 0, indexers = 0;
    for (const cpu::Decision& d : row->decisions) {
      (d.kind == DecisionKind::kRouterTopK ? routers : indexers)++;
      all.push_back({d.boundary.relative, label + ": " + d.describe()});
    }
    EXPECT_EQ(routers, moe_layers) << label;
    const bool sees_more_blocks = row->position / config.index_block_size + 1 > config.index_topk_blocks;
    EXPECT_EQ(indexers, sees_more_blocks ? sparse_layers * config.index_n_heads : 0) << label;
    const cpu::Decision* smallest = row->smallest();
    ASSERT_NE(smallest, nullptr) << label;
    EXPECT_TRUE(std::isfinite(smallest->boundary.relative) && smallest->boundary.relative > 0)
        << label << ": " << smallest->describe();
    std::vector<cpu::Decision> sorted = row->decisions;
    std::sort(sorted.begin(), sorted.end(),
              [](const cpu::Decision& x, const cpu::Decision& y) { return x.boundary.relative < y.boundary.relative; });
    std::string line;
    for (size_t i = 0; i < std::min<size_t>(3, sorted.size()); ++i) line += (i ? ", " : "") + sorted[i].describe();
    std::printf("  %-18s %s%s\n", label.c_str(), line.c_str(),
                smallest->boundary.relative < test::kExemptMargin ? "  <- under the exemption threshold" : "");
  }
  std::sort(all.begin(), all.end());
  std::printf("The ten smallest decision margins on the fixture:\n");
  for (size_t i = 0; i < std::min<size_t>(10, all.size()); ++i) std::printf("  %s\n", all[i].second.c_str());
}

}  // namespace
}  // namespace tpmoe
