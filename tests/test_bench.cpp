// The decode benchmark (src/engine/bench.h): on the tiny preset with all four fusion settings and two
// batches, the printed table and the JSON hold the same rows and numbers, every field is present,
// and the gains follow from the rows.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <sstream>

#include "engine/bench.h"

namespace tpmoe {
namespace {

using nlohmann::json;

std::vector<std::string> split_ws(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The printed number `text` is `value` rounded to the digits it shows.
void expect_printed(const std::string& text, double value, const std::string& what) {
  const size_t dot = text.find('.');
  const int decimals = dot == std::string::npos ? 0 : int(text.size() - dot - 1);
  const double half_ulp = 0.5 * std::pow(10.0, -decimals);
  EXPECT_NEAR(std::stod(text), value, half_ulp * 1.0001 + 1e-12) << what << ": printed " << text;
}

class BenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    BenchOptions o;
    o.preset = "tiny";
    o.device = "cpu";
    o.tp = 2;  // the all-reduce fusion changes the plan only at tp > 1
    o.threads = 2;
    o.batches = {1, 3};
    o.prompt_len = 8;
    o.new_tokens = 6;
    o.warmup = 1;
    o.settings = all_fusion_settings();
    o.progress = nullptr;
    report_ = new BenchReport(run_bench(o));
  }
  static void TearDownTestSuite() { delete report_; }
  static BenchReport* report_;
};
BenchReport* BenchTest::report_ = nullptr;

TEST_F(BenchTest, EveryRowHasEveryField) {
  const json j = bench_json(*report_);
  for (const char* key :
       {"tool", "model", "device", "tp", "prompt_len", "new_tokens", "warmup", "copy_bandwidth_gbs",
        "read_bandwidth_gbs", "weights_gib_per_rank", "protocol", "rows", "gains", "shared_expert_plan"})
    EXPECT_TRUE(j.contains(key)) << key;
  // The plan's shared-expert decision, as the engine with the fusion on made it.
  EXPECT_NE(j["shared_expert_plan"].get<std::string>().find("steps of up to 32 tokens"), std::string::npos)
      << j["shared_expert_plan"];
  ASSERT_EQ(j["rows"].size(), 8u);  // 4 settings x 2 batches
  for (const auto& row : j["rows"]) {
    for (const char* key : {"setting", "shared_expert_fusion", "allreduce_fusion", "batch", "ttft_ms", "first_step_ms",
                            "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "timed_steps", "launches_per_step",
                            "tokens_per_s", "gb_per_step", "floor_ms", "ratio"})
      EXPECT_TRUE(row.contains(key)) << key << " in " << row.dump();
    EXPECT_EQ(row["timed_steps"].get<int>(), 4);  // 6 new tokens: 5 decode steps, the first not timed
    EXPECT_GT(row["tokens_per_s"].get<double>(), 0);
    EXPECT_LE(row["tpot_p50_ms"].get<double>(), row["tpot_p99_ms"].get<double>());
    EXPECT_NEAR(row["tokens_per_s"].get<double>(), row["batch"].get<int>() * 1e3 / row["tpot_mean_ms"].get<double>(),
                1e-6 * row["tokens_per_s"].get<double>());
    EXPECT_FALSE(row.contains("tokens_per_s_extrapolated"));  // only for --preset m3 --layers N
  }
  // The four settings, each at both batches.
  std::set<std::string> settings;
  for (const auto& row : j["rows"]) settings.insert(row["setting"].get<std::string>());
  EXPECT_EQ(settings, (std::set<std::string>{"on/on", "off/on", "on/off", "off/off"}));
}

TEST_F(BenchTest, PrintedTableMatchesJson) {
  const std::string text = format_bench(*report_);
  const json j = bench_json(*report_);
  // Table rows: lines whose first word is a setting label.
  std::vector<std::vector<std::string>> printed;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto w = split_ws(line);
    if (!w.empty() && (w[0] == "on/on" || w[0] == "off/on" || w[0] == "on/off" || w[0] == "off/off"))
      printed.push_back(w);
  }
  ASSERT_EQ(printed.size(), j["rows"].size()) << text;
  const char* columns[] = {"ttft_ms",      "first_step_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms",
                           "tokens_per_s", "gb_per_step",   "floor_ms",     "ratio"};
  for (size_t i = 0; i < printed.size(); ++i) {
    const auto& w = printed[i];
    const json& row = j["rows"][i];
    ASSERT_EQ(w.size(), 12u) << text;
    EXPECT_EQ(w[0], row["setting"].get<std::string>());
    EXPECT_EQ(std::stoi(w[1]), row["batch"].get<int>());
    for (size_t c = 0; c < std::size(columns); ++c)
      expect_printed(w[2 + c], row[columns[c]].get<double>(), fmt::format("row {} {}", i, columns[c]));
    EXPECT_EQ(std::stoi(w[11]), row["launches_per_step"].get<int>());
  }
}

TEST_F(BenchTest, GainsFollowFromRows) {
  const json j = bench_json(*report_);
  auto tps = [&](bool se, bool ar, int batch) {
    for (const auto& r : j["rows"])
      if (r["shared_expert_fusion"] == se && r["allreduce_fusion"] == ar && r["batch"] == batch)
        return r["tokens_per_s"].get<double>();
    ADD_FAILURE() << "no row " << se << ar << batch;
    return 1.0;
  };
  ASSERT_EQ(j["gains"].size(), 8u);  // 2 fusions x 2 held settings x 2 batches
  for (const auto& g : j["gains"]) {
    const int batch = g["batch"];
    ASSERT_FALSE(g["gain"].is_null()) << g.dump();  // tp 2: both fusions mean something
    if (g["fusion"] == "shared_expert") {
      const bool ar = g["allreduce_fusion"];
      EXPECT_NEAR(g["gain"].get<double>(), tps(true, ar, batch) / tps(false, ar, batch) - 1, 1e-12);
    } else {
      const bool se = g["shared_expert_fusion"];
      EXPECT_NEAR(g["gain"].get<double>(), tps(se, true, batch) / tps(se, false, batch) - 1, 1e-12);
    }
  }
  EXPECT_NE(format_bench(*report_).find("fusion gains"), std::string::npos);
}

TEST(BenchGains, AllReduceFusionIsNotAGainAtTp1OrUnderEmulation) {
  std::vector<BenchRow> rows;
  for (bool se : {true, false})
    for (bool ar : {true, false}) {
      BenchRow r;
      r.shared_expert_fusion = se;
      r.allreduce_fusion = ar;
      r.batch = 4;
      r.tokens_per_s = 100.0 + (se ? 20 : 0) + (ar ? 3 : 0);
      rows.push_back(r);
    }
  for (const FusionGain& g : fusion_gains(rows, 1, false)) {
    if (g.fusion == "allreduce") {
      EXPECT_FALSE(g.gain.has_value());
      EXPECT_EQ(g.note, "n/a at tp 1");
    } else {
      ASSERT_TRUE(g.gain.has_value());
      EXPECT_NEAR(*g.gain, g.other_on ? 123.0 / 103.0 - 1 : 120.0 / 100.0 - 1, 1e-12);
    }
  }
  // Under --emulate-tp the unfused all-reduce of one rank does nothing: no gain either; at a real
  // tp 2 there is one.
  for (const FusionGain& g : fusion_gains(rows, 2, true)) {
    if (g.fusion != "allreduce") continue;
    EXPECT_FALSE(g.gain.has_value());
    EXPECT_EQ(g.note, "n/a emulated (no peers)");
  }
  size_t measured = 0;
  for (const FusionGain& g : fusion_gains(rows, 2, false))
    if (g.fusion == "allreduce") {
      ASSERT_TRUE(g.gain.has_value());
      EXPECT_NEAR(*g.gain, g.other_on ? 123.0 / 120.0 - 1 : 103.0 / 100.0 - 1, 1e-12);
      ++measured;
    }
  EXPECT_EQ(measured, 2u);
}

// --preset m3 --layers N adds the extrapolated column; it is printed last and matches the JSON.
TEST(BenchFormat, ExtrapolatedColumnMatchesJson) {
  BenchReport rep;
  rep.model = "preset m3, 4 layers";
  rep.device = "cuda";
  rep.new_tokens = 64;
  rep.full_layers = 60;
  rep.extrapolation = "tok/s @60L (extrapolated) = ...";
  BenchRow r;
  r.setting = "on/on";
  r.batch = 16;
  r.tpot_mean_ms = 3.25;
  r.tokens_per_s = 16 / 3.25e-3;
  r.tokens_per_s_full = 345.678;
  rep.rows.push_back(r);
  const std::string text = format_bench(rep);
  EXPECT_NE(text.find("tok/s @60L (extrapolated)"), std::string::npos) << text;
  const json j = bench_json(rep);
  EXPECT_EQ(j["extrapolated_layers"], 60);
  EXPECT_DOUBLE_EQ(j["rows"][0]["tokens_per_s_extrapolated"].get<double>(), 345.678);
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto w = split_ws(line);
    if (w.empty() || w[0] != "on/on") continue;
    ASSERT_EQ(w.size(), 13u) << line;
    expect_printed(w[12], 345.678, "extrapolated tokens/s");
  }
}

TEST(BenchOptionsCheck, TooFewNewTokensIsAnError) {
  BenchOptions o;
  o.new_tokens = 2;
  o.progress = nullptr;
  EXPECT_THROW(run_bench(o), std::exception);
}

}  // namespace
}  // namespace tpmoe
