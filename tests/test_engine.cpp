// The one engine (src/engine/engine.cpp) on the CPU backend: the weight table every loader and
// report reads, emulating rank 0 of a larger group, routing statistics for the bandwidth floor,
// rank failures, and engines built and torn down many times in one process.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "backends/cpu/local_comm.h"
#include "engine/rank_runner.h"
#include "engine/report.h"
#include "io/checkpoint.h"
#include "model/presets.h"
#include "model/weight_table.h"
#include "model/weights.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe {
namespace {

constexpr uint64_t kSeed = 99;

EngineOptions cpu_options(int tp = 1) {
  EngineOptions o;
  o.tp = tp;
  o.threads = 2;
  return o;
}

GenerateRequest teacher_forced(int vocab, int batch, int prompt_len, int new_tokens) {
  GenerateRequest req;
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> prompt, forced;
    for (int i = 0; i < prompt_len; ++i) prompt.push_back(int32_t(1 + (b * 37 + i * 11) % (vocab - 1)));
    for (int i = 0; i + 1 < new_tokens; ++i) forced.push_back(int32_t(1 + (b * 13 + i * 7) % (vocab - 1)));
    req.prompts.push_back(prompt);
    req.forced_tokens.push_back(forced);
  }
  req.max_new_tokens = new_tokens;
  return req;
}

// The loader fills every byte the table declares, and the byte report adds up the same table.
TEST(WeightTable, LoaderAndByteReportAgree) {
  const ModelConfig config = preset_config("tiny");
  const auto ckpt = io::Checkpoint::from_memory(config, random_weights(config, kSeed, DType::kBF16));
  for (int tp : {1, 2, 4})
    for (bool fused : {true, false}) {
      SCOPED_TRACE(fmt::format("tp {} shared fusion {}", tp, fused));
      ParallelLayout layout;
      layout.tp = tp;
      const FusionPlan plan = build_fusion_plan(config, layout, {true, fused});
      for (int r = 0; r < tp; ++r) {
        const RankShard shard = RankShard::make(config, layout, r);
        const ModelWeights w = load_rank_weights(ckpt, shard, plan);
        EXPECT_EQ(w.bytes, rank_weight_bytes(config, shard, plan, DType::kBF16));
        // Every routed expert chosen: the step reads everything but the unused embedding rows.
        std::vector<double> all(size_t(config.num_layers), double(config.num_experts));
        const double step = decode_weight_bytes(config, shard, plan, 1, DType::kBF16, &all);
        const double embed_rows = double(config.vocab_size - 1) * config.hidden_size * 2;
        EXPECT_DOUBLE_EQ(step, double(w.bytes) - embed_rows);
      }
    }
}

// Vocab-parallel lm_head: each rank holds 1/tp of the vocabulary rows.
TEST(WeightTable, LmHeadIsSplitByVocabularyRows) {
  const ModelConfig config = preset_config("tiny");
  ParallelLayout layout;
  layout.tp = 4;
  const FusionPlan plan = build_fusion_plan(config, layout, {});
  const auto ckpt = io::Checkpoint::from_memory(config, random_weights(config, kSeed, DType::kF32));
  const io::TensorView head = ckpt.lm_head();
  for (int r = 0; r < 4; ++r) {
    const RankShard shard = RankShard::make(config, layout, r);
    ASSERT_TRUE(shard.vocab_parallel());
    const ModelWeights w = load_rank_weights(ckpt, shard, plan);
    ASSERT_EQ(w.lm_head.dim(0), config.vocab_size / 4);
    const float* want = reinterpret_cast<const float*>(head.data) + size_t(r) * w.lm_head.numel();
    EXPECT_TRUE(std::equal(want, want + w.lm_head.numel(), w.lm_head.as<float>())) << "rank " << r;
  }
}

// Every canonical tensor a preset generates is read by exactly the ranks' tables (nothing is made
// that no rank loads, nothing loaded that is not made): the host and device generators agree.
TEST(WeightTable, CanonicalTensorsAreWhatTheRanksRead) {
  const ModelConfig config = preset_config("tiny");
  std::set<std::string> made, read;
  for (const auto& t : canonical_tensors(config)) made.insert(t.name);
  ParallelLayout layout;
  layout.tp = 2;
  for (bool fused : {true, false}) {
    const FusionPlan plan = build_fusion_plan(config, layout, {true, fused});
    for (int r = 0; r < 2; ++r)
      for (const auto& e : rank_weight_table(config, RankShard::make(config, layout, r), plan))
        for (const auto& b : e.blocks) read.insert(canonical_location(config, b.source).name);
  }
  EXPECT_EQ(made, read);
}

// --emulate-tp 2 runs exactly rank 0 of a real tp-2 run. To compare the two, the model's rank-1
// slices of every row-parallel weight are zero: rank 1's partial sums are then exactly zero, the
// real all-reduce returns rank 0's partial, and the emulator (which has no peers) must agree on
// rank 0's share of the vocabulary, bit for bit up to summation order.
TEST(EmulateTp, MatchesRankZeroOfARealRunWhereTheyAreComparable) {
  const ModelConfig config = preset_config("tiny");
  auto tensors = random_weights(config, kSeed, DType::kF32);
  ParallelLayout layout;
  layout.tp = 2;
  const RankShard rank1 = RankShard::make(config, layout, 1);
  auto zero_columns = [&](const std::string& name, int64_t begin, int64_t count) {
    io::OwnedTensor& t = tensors.at(name);
    const int64_t K = t.shape.back(), rows = int64_t(t.bytes.size() / 4) / K;
    float* v = reinterpret_cast<float*>(t.bytes.data());
    for (int64_t r = 0; r < rows; ++r) std::fill(v + r * K + begin, v + r * K + begin + count, 0.f);
  };
  const int64_t hd = config.head_dim;
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    zero_columns(p + "self_attn.o_proj.weight", rank1.q_head_begin * hd, rank1.num_q_heads * hd);
    if (config.mlp_layer_types[l] == MlpType::kDense) {
      zero_columns(p + "mlp.down_proj.weight", rank1.dense_inter_begin, rank1.dense_inter);
      continue;
    }
    zero_columns(p + "mlp.experts.down_proj", rank1.moe_inter_begin, rank1.moe_inter);
    zero_columns(p + "mlp.shared_experts.down_proj.weight", rank1.shared_inter_begin, rank1.shared_inter);
  }
  const auto dir = test::make_temp_dir("emulate_tp");
  io::write_checkpoint(dir, config, tensors, io::CheckpointLayout::kTransformers);

  GenerateRequest req = teacher_forced(config.vocab_size, 2, 19, 4);
  req.return_prefill_logits = true;
  const GenerateResult real = Engine::from_checkpoint(dir, cpu_options(2))->generate(req);
  EngineOptions emulated_options = cpu_options(1);
  emulated_options.emulate_tp = 2;
  auto emulated_engine = Engine::from_checkpoint(dir, emulated_options);
  EXPECT_NE(emulated_engine->describe().find("emulating rank 0 of tp 2"), std::string::npos);
  const GenerateResult emulated = emulated_engine->generate(req);

  // Rank 0's vocabulary slice of every logit row.
  const int V = config.vocab_size, half = V / 2;
  auto rank0_share = [&](const std::vector<std::vector<float>>& rows) {
    std::vector<float> out;
    for (const auto& row : rows)
      for (size_t i = 0; i < row.size(); i += size_t(V)) out.insert(out.end(), row.begin() + i, row.begin() + i + half);
    return out;
  };
  const double prefill = test::relative_l2(rank0_share(emulated.prefill_logits), rank0_share(real.prefill_logits));
  const double steps = test::relative_l2(rank0_share(emulated.step_logits), rank0_share(real.step_logits));
  EXPECT_LT(prefill, test::kTolF32);
  EXPECT_LT(steps, test::kTolF32);
  // Not a vacuous comparison: without the zeroed slices the two differ (rank 1 contributes).
  const auto plain = test::make_temp_dir("emulate_tp_plain");
  io::write_checkpoint(plain, config, random_weights(config, kSeed, DType::kF32), io::CheckpointLayout::kTransformers);
  const GenerateResult real_plain = Engine::from_checkpoint(plain, cpu_options(2))->generate(req);
  const GenerateResult emulated_plain = Engine::from_checkpoint(plain, emulated_options)->generate(req);
  EXPECT_GT(test::relative_l2(rank0_share(emulated_plain.step_logits), rank0_share(real_plain.step_logits)), 1e-2);
}

// Routing statistics count what the router chose for the real sequences of each decode step.
TEST(RoutingStats, CountsTheDistinctRoutedExpertsOfEachStep) {
  const ModelConfig config = preset_config("tiny");
  auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options());
  for (int batch : {1, 3}) {
    GenerateRequest req = teacher_forced(config.vocab_size, batch, 9, 5);
    req.record_routing = true;
    const GenerateResult r = engine->generate(req);
    ASSERT_EQ(r.step_routed_experts.size(), 4u);
    for (const auto& step : r.step_routed_experts) {
      ASSERT_EQ(int(step.size()), config.num_layers);
      for (int l = 0; l < config.num_layers; ++l) {
        if (config.mlp_layer_types[l] == MlpType::kDense) {
          EXPECT_EQ(step[l], 0);
        } else if (batch == 1) {
          EXPECT_EQ(step[l], config.num_experts_per_tok);  // one token: k distinct experts
        } else {
          EXPECT_GE(step[l], config.num_experts_per_tok);
          EXPECT_LE(step[l], std::min(config.num_experts, batch * config.num_experts_per_tok));
        }
      }
    }
    // The floor from the routed experts never exceeds the floor with every expert read.
    std::vector<int> all(size_t(config.num_layers), config.num_experts);
    EXPECT_LT(engine->decode_weight_bytes(batch, &r.step_routed_experts[0]), engine->decode_weight_bytes(batch, &all));
  }
}

// The one failure policy: a rank that fails while its peer waits in a collective gets its own
// error reported (not the peer's "another rank failed"), and the peer is woken, not left hanging.
TEST(RankRunner, ReportsTheFailingRankAndWakesItsPeer) {
  cpu::LocalCommGroup group(2);
  const RankRunner runner(/*multi_process=*/false, /*grouped=*/true);
  std::vector<float> data(8, 1.f);
  try {
    runner.run(
        2,
        [&](size_t i) {
          if (i == 1) TPMOE_FAIL("rank 1 broke");
          group.rank(0).all_reduce(Tensor::make(data.data(), DType::kF32, 8));  // waits for rank 1 forever
        },
        [&] {
          group.abort();
          return true;
        },
        [](size_t i) { return int(i); });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "rank 1 broke");
  }
}

// A bad request at tp 2 is a clear error, and the engine keeps working.
TEST(Engine, BadRequestLeavesTheEngineUsable) {
  auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(2));
  GenerateRequest bad;
  bad.prompts = {{1, 2, 3}};
  bad.max_new_tokens = 0;
  try {
    engine->generate(bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_new_tokens"), std::string::npos) << e.what();
  }
  GenerateRequest ok;
  ok.prompts = {{1, 2, 3}};
  ok.max_new_tokens = 3;
  EXPECT_EQ(engine->generate(ok).generated[0].size(), 3u);
}

// Engines built and torn down many times in one process (as --compare-fusions does), at tp 2.
TEST(EngineLifetime, BuiltAndTornDownRepeatedly) {
  GenerateRequest req;
  req.prompts = {{5, 6, 7, 8}};
  req.max_new_tokens = 3;
  std::vector<int32_t> first;
  for (int i = 0; i < 12; ++i) {
    EngineOptions o = cpu_options(2);
    o.allreduce_fusion = i % 2 == 0;
    o.shared_expert_fusion = i % 3 == 0;
    const auto ids = Engine::from_preset("tiny", 2, kSeed, o)->generate(req).generated[0];
    if (i == 0) first = ids;
    EXPECT_EQ(ids, first) << "build " << i;
  }
}

}  // namespace
}  // namespace tpmoe

namespace tpmoe {
namespace {

GenerateRequest sampled_request(uint64_t seed) {
  GenerateRequest req;
  req.prompts = {{3, 1, 4, 1, 5, 9, 2, 6}, {2, 7, 1, 8}};
  req.max_new_tokens = 12;
  req.return_step_logits = false;
  req.sampling.temperature = 0.9f;
  req.sampling.top_p = 0.95f;
  req.sampling.top_k = 50;
  req.sampling.seed = seed;
  return req;
}

TEST(Sampling, SeedsReproduceAcrossEnginesAndTp) {
  auto tp1 = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(1));
  auto tp2 = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(2));
  const GenerateResult a = tp1->generate(sampled_request(5)), b = tp1->generate(sampled_request(5));
  EXPECT_EQ(a.generated, b.generated);
  // tp 2 (vocab-parallel logits gathered for the draw) draws the same tokens from the same seed.
  EXPECT_EQ(tp2->generate(sampled_request(5)).generated, a.generated);
  // Another seed, other tokens (12 tokens from a 512-token vocabulary at temperature 0.9).
  EXPECT_NE(tp1->generate(sampled_request(6)).generated, a.generated);
  // Not the greedy tokens either.
  GenerateRequest greedy = sampled_request(5);
  greedy.sampling = SamplingParams{};
  EXPECT_NE(tp1->generate(greedy).generated, a.generated);
}

TEST(Sampling, EosAndStopIdsEndASequenceAtTheirToken) {
  auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(1));
  GenerateRequest req = sampled_request(7);
  const GenerateResult free_run = engine->generate(req);
  ASSERT_EQ(free_run.generated[0].size(), 12u);
  EXPECT_EQ(free_run.finish_reasons, (std::vector<std::string>{"length", "length"}));
  // The token sequence 0 drew fourth, as an EOS id: it stops there (inclusive), the other goes on
  // (unless it happens to draw the same token).
  const int32_t eos = free_run.generated[0][3];
  req.eos_token_ids = {eos};
  const GenerateResult stopped = engine->generate(req);
  const auto first = std::find(free_run.generated[0].begin(), free_run.generated[0].end(), eos);
  const size_t want = size_t(first - free_run.generated[0].begin()) + 1;
  ASSERT_EQ(stopped.generated[0].size(), want);
  EXPECT_TRUE(std::equal(stopped.generated[0].begin(), stopped.generated[0].end(), free_run.generated[0].begin()));
  EXPECT_EQ(stopped.finish_reasons[0], "stop");
  req.eos_token_ids.clear();
  req.sampling.stop_token_ids = {eos};
  EXPECT_EQ(engine->generate(req).generated[0], stopped.generated[0]);
  req.sampling.ignore_eos = true;
  req.sampling.stop_token_ids.clear();
  req.eos_token_ids = {eos};
  EXPECT_EQ(engine->generate(req).generated[0].size(), 12u);
}

TEST(Sampling, StopStringsCutTheStreamedTextOnEveryRank) {
  for (int tp : {1, 2}) {
    SCOPED_TRACE(fmt::format("tp {}", tp));
    auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(tp));
    GenerateRequest req = sampled_request(9);
    req.detokenize = [](int, int32_t id) { return fmt::format("<{}>", id); };
    std::vector<std::string> streamed(2);
    req.on_text = [&](int b, const std::string& text) { streamed[b] += text; };
    const GenerateResult full = engine->generate(req);
    EXPECT_EQ(full.texts, streamed);
    ASSERT_EQ(full.texts[0].size() > 0, true);
    // Stop at sequence 0's third token's text: the text ends right before it, the ids at it.
    const std::string stop = fmt::format("<{}>", full.generated[0][2]);
    req.sampling.stop = {stop};
    streamed.assign(2, "");
    const GenerateResult cut = engine->generate(req);
    EXPECT_EQ(cut.texts, streamed);
    EXPECT_EQ(cut.finish_reasons[0], "stop");
    EXPECT_EQ(cut.texts[0], full.texts[0].substr(0, full.texts[0].find(stop)));
    EXPECT_EQ(cut.generated[0].size(),
              size_t(std::find(full.generated[0].begin(), full.generated[0].end(), full.generated[0][2]) -
                     full.generated[0].begin()) +
                  1);
  }
}

// Decode steps queued before the host reads the last step's ids (the ids fed back on the device)
// give the tokens and endings that one step at a time gives: greedy and sampled, one rank and a
// vocab-parallel pair (the winners combined by the ops), sequences ending early at an EOS id and a
// request whose every sequence ends before its length (a queued step dropped). Where the host needs
// the ids between steps (penalties), the steps do not overlap.
TEST(OverlappedDecode, SameTokensAndEndingsAsOneStepAtATime) {
  struct Case {
    const char* name;
    int tp, emulate_tp;
  };
  for (const Case& c : {Case{"tp 1", 1, 0}, Case{"tp 2", 2, 0}, Case{"emulated rank 0 of tp 2", 1, 2}}) {
    SCOPED_TRACE(c.name);
    EngineOptions o = cpu_options(c.tp);
    o.emulate_tp = c.emulate_tp;
    auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, o);
    auto both_ways = [&](GenerateRequest req, bool overlaps) {
      req.overlap_decode = false;
      const GenerateResult one_at_a_time = engine->generate(req);
      EXPECT_FALSE(one_at_a_time.overlapped_decode);
      req.overlap_decode = true;
      const GenerateResult overlapped = engine->generate(req);
      EXPECT_EQ(overlapped.overlapped_decode, overlaps);
      EXPECT_EQ(overlapped.generated, one_at_a_time.generated);
      EXPECT_EQ(overlapped.finish_reasons, one_at_a_time.finish_reasons);
      EXPECT_EQ(overlapped.step_seconds.size(), one_at_a_time.step_seconds.size());
      return overlapped;
    };
    GenerateRequest greedy = sampled_request(3);
    greedy.sampling = SamplingParams{};
    greedy.prompts.push_back({5, 5, 5});
    const GenerateResult full = both_ways(greedy, true);
    ASSERT_EQ(full.generated[1].size(), 12u);
    // Sequence 1 ends at its fifth token while the others go on (unless they draw it too).
    greedy.eos_token_ids = {full.generated[1][4]};
    const GenerateResult ended = both_ways(greedy, true);
    EXPECT_LE(ended.generated[1].size(), 5u);
    EXPECT_EQ(ended.finish_reasons[1], "stop");
    // Every sequence ends by its third token: the loop stops with a step queued behind the last.
    greedy.eos_token_ids = {full.generated[0][2], full.generated[1][2], full.generated[2][2]};
    const GenerateResult all_ended = both_ways(greedy, true);
    for (const auto& g : all_ended.generated) EXPECT_LE(g.size(), 3u);
    EXPECT_EQ(
        all_ended.step_seconds.size(),
        std::max({all_ended.generated[0].size(), all_ended.generated[1].size(), all_ended.generated[2].size()}) - 1);
    // Every sequence ends at its first token (from the prefill): no decode step, none overlapped.
    greedy.eos_token_ids = {full.generated[0][0], full.generated[1][0], full.generated[2][0]};
    EXPECT_TRUE(both_ways(greedy, false).step_seconds.empty());
    // Sampled draws keyed by each sequence's own step count; penalties keep the steps apart.
    both_ways(sampled_request(4), true);
    GenerateRequest penalised = sampled_request(4);
    penalised.sampling.presence_penalty = 0.5f;
    both_ways(penalised, false);
    // The engine is left as it was: a one-step request after all that.
    greedy.max_new_tokens = 1;
    EXPECT_EQ(engine->generate(greedy).generated[0].size(), 1u);
  }
}

TEST(Sampling, BadParametersAreClearErrors) {
  auto engine = Engine::from_preset("tiny", std::nullopt, kSeed, cpu_options(1));
  GenerateRequest req = sampled_request(1);
  req.sampling.temperature = -1;
  EXPECT_THROW(engine->generate(req), Error);
  req = sampled_request(1);
  req.sampling.stop = {"x"};  // no detokenize: stop strings cannot be matched
  try {
    engine->generate(req);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stop strings"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tpmoe
