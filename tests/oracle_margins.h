// The CPU oracle (tp 1, fp32 math on the checkpoint's weights) run with its decision recorder, and
// the fixture's logit rows labelled with the oracle's smallest decision margin: the rows where a
// bf16 path may legitimately take the other branch are found from these margins at test time.
// Header-only, for tests that link the tpmoe library (test_util.cpp must link with tpmoe_io alone).
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backends/cpu/cpu_ops.h"
#include "backends/cpu/decision_margins.h"
#include "backends/cpu/local_comm.h"
#include "engine/generation.h"
#include "io/checkpoint.h"
#include "model/fusion_plan.h"
#include "model/model.h"
#include "model/weights.h"
#include "test_util.h"
#include "tpmoe/tpmoe.h"

namespace tpmoe::test {

// Rows whose smallest oracle margin is under this are exempt from the yardstick (and held to the
// exempt limit instead). 1%: bf16 keeps 8 significant bits, so one rounding moves a value by up to
// 2^-8 = 0.39% relative, and the router's and indexer's inputs come out of several such roundings
// (hidden state, projection weights, q/k norms) whose errors add up: a choice decided by under ~1%
// is one a bf16 path can take the other way. On the fixture (test_decision_margins prints them) this
// exempts prompt positions 37 and 16 (layer 3 indexer, 0.169% and 0.184%), 24, 28, 4 and 19 (router
// top-k, 0.395% layer 3, 0.677% layer 2, 0.704% layer 3, 0.94% layer 3) and decode step 9 (position
// 48, layer 3 indexer, 0.227%); reference_bf16 itself flips at 16 and at step 9. The next smallest
// margins are 1.09% (step 3) and 1.19% (position 8), both router top-k of layer 1.
inline constexpr double kExemptMargin = 0.01;

struct OracleRun {
  GenerateResult result;
  cpu::DecisionRecorder decisions;
};

// Runs `req` on the CPU oracle at tp 1, recording decision margins when `record` is set. Built from
// the engine's parts (checkpoint, fusion plan, shard, weights, ops, a one-rank communicator, the
// generation loop) so the recorder can be attached to the ops.
inline OracleRun run_cpu_oracle(const std::filesystem::path& dir, const GenerateRequest& req, bool record,
                                const FusionOptions& fusion = {}) {
  const auto ckpt = io::Checkpoint::open(dir);
  const ModelConfig& config = ckpt.config();
  ParallelLayout layout;
  layout.validate(config);
  const FusionPlan plan = build_fusion_plan(config, layout, fusion, shared_expert_format_matches(ckpt));
  const RankShard shard = RankShard::make(config, layout, 0);
  const ModelWeights weights = load_rank_weights(ckpt, shard, plan);
  validate_request(req, config.vocab_size);
  OracleRun run;
  cpu::LocalCommGroup group(1);
  cpu::CpuOps ops;
  if (record) ops.set_decision_recorder(&run.decisions);
  Model model(config, plan, shard, weights, ops, group.rank(0));
  ops.init_cache(request_cache_shape(model, req, ops.records_steps()));
  generate_on_rank(ops, model, config.vocab_size, req, /*seed=*/0, &run.result);  // greedy: no seed used
  return run;
}

// The oracle run teacher-forced on the fixture's prompts and generated tokens (SPEC §5), recorded.
inline OracleRun run_fixture_oracle(const FixtureReference& ref) {
  return run_cpu_oracle(fixtures_dir() / "m3-tiny", teacher_forced_request(ref), true);
}

// The smallest decision of the oracle row that produced a logit row, or nullptr when the row made
// no choice at all.
inline const cpu::Decision* smallest_decision(const cpu::DecisionRecorder& decisions, int seq, int position) {
  const cpu::TokenDecisions* row = decisions.find(seq, position);
  return row ? row->smallest() : nullptr;
}

inline LogitRow make_logit_row(std::string label, const cpu::Decision* d, double exempt_below) {
  LogitRow row;
  row.label = std::move(label);
  row.margin = d ? d->describe() : "no decision";
  row.exempt = d && d->boundary.relative < exempt_below;
  return row;
}

// One LogitRow per row of the fixture's prefill logits ([B, P]) and step logits ([G, B]), in their
// layouts. Prefill position p is the oracle row at (b, p); step 0 is the last prompt position, step
// i >= 1 the row that fed a forced token at position P + i - 1. Only the row's own decisions count:
// a choice flipped at an earlier position reaches later rows only through one cached key among
// many, which the yardstick's slack covers.
struct FixtureRows {
  std::vector<LogitRow> prefill, steps;
  double exempt_below = kExemptMargin;  // the threshold the rows were marked exempt by
};
inline FixtureRows fixture_logit_rows(const FixtureReference& ref, const cpu::DecisionRecorder& decisions,
                                      double exempt_below = kExemptMargin) {
  FixtureRows rows;
  rows.exempt_below = exempt_below;
  for (int b = 0; b < int(ref.B); ++b)
    for (int p = 0; p < int(ref.P); ++p)
      rows.prefill.push_back(
          make_logit_row(ref.B > 1 ? fmt::format("prefill {}.{}", b, p) : fmt::format("prefill {}", p),
                         smallest_decision(decisions, b, p), exempt_below));
  for (int i = 0; i < int(ref.G); ++i)
    for (int b = 0; b < int(ref.B); ++b) {
      const int pos = int(ref.prompts[b].size()) + i - 1;  // step 0: the last prompt position
      rows.steps.push_back(make_logit_row(
          ref.B > 1 ? fmt::format("step {}.{} (pos {})", i, b, pos) : fmt::format("step {} (pos {})", i, pos),
          smallest_decision(decisions, b, pos), exempt_below));
    }
  return rows;
}

// Prints every exempt row with its margin, layer and kind.
inline void print_exempt_rows(const FixtureRows& rows) {
  std::printf("Rows exempt from the yardstick (oracle margin under %.3g%%):\n", rows.exempt_below * 100);
  int n = 0;
  for (const auto* list : {&rows.prefill, &rows.steps}) {
    for (const LogitRow& r : *list) {
      if (!r.exempt) continue;
      std::printf("  %-20s %s\n", r.label.c_str(), r.margin.c_str());
      ++n;
    }
  }
  if (n == 0) std::printf("  none\n");
}

}  // namespace tpmoe::test
